"""The job manager: runs once inside a SLURM allocation and starts the training ranks.

``python -m dynmo_hpc.slurm.manager JOB.yaml`` is what the sbatch template ``exec``s and what
:func:`dynmo_hpc.submit` runs through submitit (with ``use_srun=False``, so it runs once, in the
batch script, while the job holds all its nodes). It checks the allocation against the job (one
rank per pipeline stage), writes the resolved config into the run directory, and starts the ranks
as one MPI step over the allocation (``srun --mpi=pmix`` by default, or the venv's ``mpirun``;
see docs/slurm.md). SIGUSR2 (SLURM's warning before the time limit or a preemption) and SIGTERM
are caught for the manager's whole run: forwarded to the step while one runs, and between steps
(a shrink, a checkpoint search) they stop the job before the next step starts, the same way.

The error paths keep a healthy job (docs/elastic.md, "SLURM error paths"): a refused shrink
continues at the current size, a relaunch that starts no rank after a resize is tried once more,
and a requeued packed job that SLURM hands its original node count releases the nodes its
packed config does not need.

The manager is a separate process from the ranks because an MPI step cannot release a node
while it runs (SLURM kills a step's tasks on a released node): only a process outside the step
can end it and start another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance.packing import nodes_for
from dynmo_hpc.errors import ConfigError, LaunchError, SubmitError
from dynmo_hpc.handoff import rank_status
from dynmo_hpc.handoff.env import ATTEMPT_ENV, LAUNCH_TIME_ENV
from dynmo_hpc.handoff.resize import ShrinkRefused
from dynmo_hpc.launch import preflight
from dynmo_hpc.launch.local import worker_argv
from dynmo_hpc.launch.mpi_impl import detect
from dynmo_hpc.launch.rundir import lock_run_dir
from dynmo_hpc.launch.step_process import StepProcess
from dynmo_hpc.launch.supervisor import (
    JobOutcome,
    StepLaunch,
    StepResult,
    newest_checkpoint,
    supervise,
)
from dynmo_hpc.logging_utils import setup_logging
from dynmo_hpc.placement import ranks_per_node
from dynmo_hpc.slurm.environment import in_slurm_job, read_slurm_env
from dynmo_hpc.slurm.resize import nodes_after_release, resized_env, shrink_job
from dynmo_hpc.slurm.step import mpi_step_argv, slurm_mpi_env, srun_mpi_plugin

log = logging.getLogger(__name__)


def check_allocation(cfg: config_mod.JobConfig, environ: dict[str, str] | None = None) -> int:
    """Task slots in the allocation; raises if the job needs more ranks than it holds."""
    env = read_slurm_env(environ)
    if env.tasks_per_node is not None:
        slots = sum(env.tasks_per_node)
    elif env.num_tasks is not None:
        slots = env.num_tasks
    else:
        slots = env.num_nodes
    if cfg.pipeline.world_size > slots:
        raise LaunchError(
            f"pipeline.replicas({cfg.pipeline.replicas}) * pipeline.num_stages"
            f"({cfg.pipeline.num_stages}) = {cfg.pipeline.world_size} ranks > task slots in "
            f"SLURM job {env.job_id} ({slots} on {env.num_nodes} nodes); HINT: submit with more "
            "nodes or --ntasks-per-node, or lower pipeline.num_stages or pipeline.replicas"
        )
    return slots


class ActiveStep:
    """The MPI step running now (if any) and the stop signal the job got: shared between the
    manager's loop and the signal handlers (ours, or submitit's ``checkpoint()``).

    ``stop_signal`` stays set for the rest of the manager's run: a signal that arrives between
    steps keeps the next step from starting (:func:`_run_step`).
    """

    step: StepProcess | None = None
    stop_signal: int = 0
    forwarded: bool = False
    """The running step was sent ``stop_signal``."""

    @classmethod
    def reset(cls) -> None:
        """A new manager run: no step, no signal yet."""
        cls.step, cls.stop_signal, cls.forwarded = None, 0, False

    @classmethod
    def stop(cls, signum: int) -> None:
        """Ask the running step to checkpoint at its next step boundary and end; with no step
        running, keep the next one from starting."""
        cls.stop_signal = signum
        if cls.step is not None:
            cls.forwarded = True
            cls.step.send(signum)

    @classmethod
    def wait_stopped(cls, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the running step to end; True once none runs."""
        step = cls.step
        deadline = time.monotonic() + timeout_s
        while step is not None and not step.has_ended():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def requeue_count(environ: dict[str, str] | None = None) -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 for a first run)."""
    value = (os.environ if environ is None else environ).get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.strip().isdigit() else 0


def run_manager(
    config_path: str | Path,
    overrides: list[str] | None = None,
    *,
    launcher: str | None = None,
    loopback_only: bool | None = None,
    resume: bool | None = None,
    resume_path: str | Path | None = None,
    handle_preemption: bool = True,
) -> JobOutcome:
    """Run the job's training as MPI steps in the current allocation; returns how it ended.

    One step normally. A pack (``elastic.enabled``) shrinks the allocation (``scontrol
    update``, keeping this node) and starts a smaller step from the pack's checkpoint; a failed
    step is restarted from the newest complete checkpoint, up to ``fault.max_restarts`` times
    (:func:`~dynmo_hpc.launch.supervisor.supervise`).

    ``resume``: continue from the run's newest complete checkpoint (from the start, appending to
    the run log, when there is none); None: when SLURM has requeued the job. ``resume_path``:
    the checkpoint the job's first run continues from (``sbatch|submit --resume``, checked on
    the submit host); a requeued run ignores it and continues from the newest. With
    ``handle_preemption`` the manager catches SIGUSR2 and SIGTERM itself for its whole run and
    passes them to the step (between steps: no further step starts); a submitit job leaves
    SIGUSR2 to submitit, whose handler calls :meth:`dynmo_hpc.slurm.requeue.ManagerJob.checkpoint`.
    """
    if not in_slurm_job():
        raise LaunchError(
            "dynmo_hpc.slurm.manager runs inside a SLURM allocation (no SLURM_JOB_ID here); "
            "HINT: use `dynmo-hpc run JOB.yaml` for local ranks, or `dynmo-hpc submit JOB.yaml`"
        )
    ActiveStep.reset()
    with _stop_signals_caught(handle_preemption):
        return _run_in_allocation(
            config_path, overrides, launcher, loopback_only, resume, resume_path
        )


def _run_in_allocation(
    config_path: str | Path,
    overrides: list[str] | None,
    launcher: str | None,
    loopback_only: bool | None,
    resume: bool | None,
    resume_path: str | Path | None,
) -> JobOutcome:
    """:func:`run_manager` once its signal handlers are in place."""
    cfg = config_mod.load(config_path, overrides)
    slots = check_allocation(cfg)
    # On the node itself: its data path, run directory and device (the submit host checked
    # what it could see, which may be another machine).
    preflight.check_data(cfg)
    preflight.check_run_dir(cfg.run_dir)
    preflight.check_local_device(cfg.runtime.device)
    first = read_slurm_env()
    steps = _AllocationSteps(
        launcher=launcher or os.environ.get("DYNMO_MPI_LAUNCHER", "auto"),
        loopback_only=os.environ.get("DYNMO_MPI_LOOPBACK_ONLY", "0") == "1"
        if loopback_only is None
        else loopback_only,
        slots=slots,
        ranks_per_node=ranks_per_node(
            cfg.pipeline.world_size, first.num_nodes, first.tasks_per_node
        ),
        implementation=detect(),
        mpi=cfg.slurm.mpi,
    )
    resume, resume_from = _starting_checkpoint(cfg.run_dir, resume, first.job_id, resume_path)
    t0 = time.perf_counter()
    with lock_run_dir(cfg.run_dir):
        if resume:
            # A requeued packed job may get its original --nodes back: keep only what it needs.
            steps.release_surplus(cfg)
        outcome = supervise(
            cfg,
            steps.run_step,
            steps.shrink,
            resume_from=resume_from,
            restart=resume and not resume_from,
        )
    _log_outcome(outcome, time.perf_counter() - t0, cfg.run_dir)
    return outcome


def _starting_checkpoint(
    run_dir: Path, resume: bool | None, job_id: int, resume_path: str | Path | None = None
) -> tuple[bool, Path | None]:
    """Whether the job continues (``resume``, or None: when SLURM requeued it) and from which
    checkpoint (None: from the beginning, appending to the run log). ``resume_path`` names it
    for a first run; a requeued run has written newer checkpoints, so it takes the newest."""
    if resume_path is not None and requeue_count() == 0 and resume is not True:
        return True, Path(resume_path)
    if resume is None:
        resume = requeue_count() > 0
    resume_from = newest_checkpoint(run_dir) if resume else None
    if resume:
        log.warning(
            "job %s (requeue %d): continuing from %s",
            job_id,
            requeue_count(),
            resume_from or "the beginning (no complete checkpoint)",
        )
    return resume, resume_from


def retry_relaunch(after_resize: bool, result: StepResult, any_rank_started: bool) -> bool:
    """Whether to start a failed step once more, at once: only the first step after a resize
    that failed before any rank started (no rank status file). That is what a launch racing the
    scheduler's view of the shrunk allocation looks like; a second failure is not transient.

    Example:
        >>> retry_relaunch(True, StepResult(1), any_rank_started=False)
        True
        >>> retry_relaunch(True, StepResult(1), any_rank_started=True)
        False
    """
    return (
        after_resize and result.exit_code != 0 and not result.interrupted and not any_rank_started
    )


@dataclass
class _AllocationSteps:
    """How this manager starts MPI steps in its allocation, and shrinks it for a pack."""

    launcher: str
    loopback_only: bool
    slots: int
    """Task slots in the allocation as first held."""
    ranks_per_node: int
    implementation: str = "openmpi"
    """The MPI the ranks' mpi4py loads (:mod:`dynmo_hpc.launch.mpi_impl`)."""
    mpi: str = "auto"
    """``slurm.mpi``: the ``srun --mpi=`` plugin (auto: by implementation)."""
    resized: bool = False
    """A resize (a shrink, or a refused one) came since the last step started."""

    def run_step(self, step_cfg: config_mod.JobConfig, launch: StepLaunch) -> StepResult:
        """Start one MPI step of ``step_cfg``; after a resize, once more if no rank started."""
        after_resize, self.resized = self.resized, False
        result = self._start(step_cfg, launch)
        started = bool(rank_status.read_all(step_cfg.run_dir))
        if not retry_relaunch(after_resize, result, started):
            return result
        log.warning(
            "the step after the resize started no rank (exit code %d); relaunching it once: %s",
            result.exit_code,
            result.output_tail.strip()[-500:] or "no launcher output",
        )
        rank_status.clear(step_cfg.run_dir)
        result = self._start(step_cfg, launch)
        if result.exit_code != 0 and not rank_status.read_all(step_cfg.run_dir):
            log.error(
                "the relaunch after the resize started no rank twice (exit code %d); the job "
                "stops with its checkpoint %s. HINT: the launcher's output is in this job's "
                "stderr log; continue the job by submitting it again with its checkpoint",
                result.exit_code,
                launch.resume_from,
            )
        return result

    def _start(self, step_cfg: config_mod.JobConfig, launch: StepLaunch) -> StepResult:
        """Start one MPI step of ``step_cfg`` on the nodes it needs and wait for it."""
        held = read_slurm_env()
        num_stages = step_cfg.pipeline.num_stages
        num_ranks = step_cfg.pipeline.world_size  # replica r's stages: ranks r*P .. r*P+P-1
        argv = mpi_step_argv(
            self.launcher,
            worker_argv(launch.config_path, resume_from=launch.resume_from, restart=launch.restart),
            num_tasks=num_ranks,
            num_nodes=min(held.num_nodes, nodes_for(num_ranks, self.ranks_per_node))
            if launch.resume_from is not None
            else None,
            srun_mpi=srun_mpi_plugin(self.mpi, self.implementation),
        )
        mpi_env = slurm_mpi_env(
            self.launcher,
            loopback_only=self.loopback_only,
            implementation=self.implementation,
            mpi=self.mpi,
        )
        env = {
            **os.environ,
            **mpi_env,
            LAUNCH_TIME_ENV: repr(time.time()),
            ATTEMPT_ENV: str(launch.attempt + 1000 * requeue_count()),
        }
        log.info(
            "job %s: %d replicas x %d stages on %d task slots (%d nodes); step: %s",
            held.job_id,
            step_cfg.pipeline.replicas,
            num_stages,
            self.slots,
            held.num_nodes,
            " ".join(argv),
        )
        return _run_step(argv, env)

    def shrink(self, smaller: config_mod.JobConfig) -> float:
        """Release the nodes ``smaller`` does not need (keeping this one); the seconds taken.

        Raises:
            ShrinkRefused: SLURM refused; the job still holds every node.
        """
        self.resized = True
        return self._release(smaller)

    def release_surplus(self, cfg: config_mod.JobConfig) -> None:
        """At the start of a resumed job: give back the nodes ``cfg`` does not need (a packed
        job that SLURM requeued with its original node count); a refusal only costs nodes."""
        try:
            self._release(cfg)
        except ShrinkRefused as exc:
            log.warning("could not release the nodes this job does not need: %s", exc)

    def _release(self, cfg: config_mod.JobConfig) -> float:
        held = read_slurm_env()
        needed = nodes_for(cfg.pipeline.world_size, self.ranks_per_node)
        kept = nodes_after_release(held.node_list, held.node_name, needed)
        if kept is None:
            return 0.0
        try:
            seconds = shrink_job(held.job_id, kept, cfg.run_dir)
        except SubmitError as exc:
            raise ShrinkRefused(str(exc)) from None
        for name, value in resized_env(os.environ, kept).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        log.warning(
            "job %s shrunk to %s (%d -> %d nodes) in %.2f s",
            held.job_id,
            ",".join(kept),
            held.num_nodes,
            needed,
            seconds,
        )
        return seconds


def _log_outcome(outcome: JobOutcome, elapsed_s: float, run_dir: Path) -> None:
    if outcome.interrupted:
        log.warning(
            "training stopped by signal %d after %.1f s; run directory %s",
            outcome.interrupted,
            elapsed_s,
            run_dir,
        )
    elif outcome.exit_code == 0:
        log.info("training finished in %.1f s; run directory %s", elapsed_s, run_dir)
    else:
        last = outcome.failures[-1].describe() if outcome.failures else "no rank named"
        log.error(
            "training failed (exit code %d) after %.1f s and %d restart(s): %s (%s); "
            "run directory %s",
            outcome.exit_code,
            elapsed_s,
            outcome.restarts,
            last,
            outcome.gave_up or "not restarted",
            run_dir,
        )


STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
"""SLURM's warning before the time limit or a preemption, and a plain stop."""


@contextlib.contextmanager
def _stop_signals_caught(enabled: bool) -> Iterator[None]:
    """While the manager runs, SIGUSR2/SIGTERM go to the running step, or, between steps, keep
    the next one from starting: either way the job stops with its newest checkpoint (and is
    requeued on SIGUSR2) instead of the manager dying mid-shrink or mid-search."""
    if not enabled:
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if ActiveStep.step is not None:
            log.warning("received signal %d; passing it to the training step", signum)
        else:
            log.warning(
                "received signal %d between MPI steps; no further step starts, the job stops "
                "with its newest checkpoint",
                signum,
            )
        ActiveStep.stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_step(argv: list[str], env: dict[str, str]) -> StepResult:
    """Run one MPI step, unless a stop signal came first (then none starts)."""
    if ActiveStep.stop_signal:
        log.warning("not starting the next step: signal %d arrived", ActiveStep.stop_signal)
        return StepResult(0, "", interrupted=ActiveStep.stop_signal)
    step = StepProcess(argv, env)
    ActiveStep.forwarded = False
    ActiveStep.step = step
    if ActiveStep.stop_signal and not ActiveStep.forwarded:  # came while the step started
        ActiveStep.stop(ActiveStep.stop_signal)
    try:
        rc = step.wait()
    except BaseException:
        step.kill_all()
        raise
    finally:
        ActiveStep.step = None
    return StepResult(rc, step.tail(), interrupted=ActiveStep.stop_signal)


CONTINUE_GENERIC = "dynmo-hpc sbatch <its run directory>/config.yaml --submit --resume"
"""The command that continues a run, when its config path is not known."""


def continue_command(config_path: str | Path) -> str:
    """The command that continues this run on the cluster from its newest checkpoint: the
    resolved ``config.yaml`` in the run directory holds every ``--set`` already."""
    return f"dynmo-hpc sbatch {shlex.quote(str(config_path))} --submit --resume"


def requeue(job_id: str | int, config_path: str | Path | None = None) -> bool:
    """``scontrol requeue``: SLURM ends this run of the job and queues it again; False (logged)
    when SLURM refused (e.g. a job submitted with ``--no-requeue``)."""
    try:
        out = subprocess.run(
            ["scontrol", "requeue", str(job_id)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("cannot requeue job %s: %s", job_id, exc)
        return False
    if out.returncode != 0:
        hint = continue_command(config_path) if config_path is not None else CONTINUE_GENERIC
        log.error(
            "scontrol requeue %s failed: %s; HINT: the run continues from its newest checkpoint "
            "with: %s",
            job_id,
            (out.stderr or out.stdout).strip(),
            hint,
        )
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    setup_logging(0)
    if not args:
        print(
            "usage: python -m dynmo_hpc.slurm.manager JOB.yaml [--resume CHECKPOINT_DIR] "
            "[section.key=value ...]",
            file=sys.stderr,
        )
        return 2
    config_path, rest = args[0], args[1:]
    resume_path = None
    if rest[:1] == ["--resume"] and len(rest) >= 2:
        resume_path, rest = rest[1], rest[2:]
    try:
        outcome = run_manager(config_path, rest, resume_path=resume_path)
    except (ConfigError, LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if outcome.interrupted == signal.SIGUSR2:
        # SLURM's warning before the time limit or a preemption: the step has checkpointed;
        # run again from there (the template asks for --requeue).
        job_id = read_slurm_env().job_id
        log.warning("requeueing job %s; it will resume from its newest checkpoint", job_id)
        return 0 if requeue(job_id, config_path) else 1
    return outcome.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
