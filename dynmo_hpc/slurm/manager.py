"""The job manager: runs once inside a SLURM allocation and starts the training ranks.

``python -m dynmo_hpc.slurm.manager JOB.yaml`` is what the sbatch template ``exec``s and what
:func:`dynmo_hpc.submit` runs through submitit (with ``use_srun=False``, so it runs once, in the
batch script, while the job holds all its nodes). It checks the allocation against the job (one
rank per pipeline stage), writes the resolved config into the run directory, and starts the ranks
as one MPI step over the allocation (``srun --mpi=pmix`` by default, or the venv's ``mpirun``;
see docs/slurm.md). SIGUSR2 (SLURM's warning before the time limit or a preemption) and SIGTERM
are forwarded to the step and recorded.

The manager is a separate process from the ranks because an MPI step cannot release a node
while it runs (SLURM kills a step's tasks on a released node): only a process outside the step
can end it and start another.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance.packing import nodes_for
from dynmo_hpc.errors import ConfigError, LaunchError
from dynmo_hpc.handoff.env import ATTEMPT_ENV, LAUNCH_TIME_ENV
from dynmo_hpc.launch import preflight
from dynmo_hpc.launch.local import worker_argv
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
from dynmo_hpc.slurm.resize import nodes_to_keep, resized_env, shrink_job
from dynmo_hpc.slurm.step import mpi_step_argv, slurm_mpi_env

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
    if cfg.pipeline.num_stages > slots:
        raise LaunchError(
            f"pipeline.num_stages({cfg.pipeline.num_stages}) > task slots in SLURM job "
            f"{env.job_id} ({slots} on {env.num_nodes} nodes); HINT: submit with more nodes or "
            "--ntasks-per-node, or lower pipeline.num_stages"
        )
    return slots


class ActiveStep:
    """The MPI step running now (if any) and the stop signal it was sent: shared between the
    manager's loop and the signal handlers (ours, or submitit's ``checkpoint()``)."""

    step: StepProcess | None = None
    stop_signal: int = 0

    @classmethod
    def stop(cls, signum: int) -> None:
        """Ask the running step to checkpoint at its next step boundary and end."""
        cls.stop_signal = signum
        if cls.step is not None:
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
    ``handle_preemption`` the manager catches SIGUSR2 and SIGTERM itself and passes them to the
    step; a submitit job leaves SIGUSR2 to submitit, whose handler calls
    :meth:`dynmo_hpc.slurm.requeue.ManagerJob.checkpoint`.
    """
    if not in_slurm_job():
        raise LaunchError(
            "dynmo_hpc.slurm.manager runs inside a SLURM allocation (no SLURM_JOB_ID here); "
            "HINT: use `dynmo-hpc run JOB.yaml` for local ranks, or `dynmo-hpc submit JOB.yaml`"
        )
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
            cfg.pipeline.num_stages, first.num_nodes, first.tasks_per_node
        ),
        handle_preemption=handle_preemption,
    )
    resume, resume_from = _starting_checkpoint(cfg.run_dir, resume, first.job_id, resume_path)
    t0 = time.perf_counter()
    with lock_run_dir(cfg.run_dir):
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


@dataclass(frozen=True)
class _AllocationSteps:
    """How this manager starts MPI steps in its allocation, and shrinks it for a pack."""

    launcher: str
    loopback_only: bool
    slots: int
    """Task slots in the allocation as first held."""
    ranks_per_node: int
    handle_preemption: bool

    def run_step(self, step_cfg: config_mod.JobConfig, launch: StepLaunch) -> StepResult:
        """Start one MPI step of ``step_cfg`` on the nodes it needs and wait for it."""
        held = read_slurm_env()
        num_stages = step_cfg.pipeline.num_stages
        argv = mpi_step_argv(
            self.launcher,
            worker_argv(launch.config_path, resume_from=launch.resume_from, restart=launch.restart),
            num_tasks=num_stages,
            num_nodes=min(held.num_nodes, nodes_for(num_stages, self.ranks_per_node))
            if launch.resume_from is not None
            else None,
        )
        env = {
            **os.environ,
            **slurm_mpi_env(self.launcher, loopback_only=self.loopback_only),
            LAUNCH_TIME_ENV: repr(time.time()),
            ATTEMPT_ENV: str(launch.attempt + 1000 * requeue_count()),
        }
        log.info(
            "job %s: %d stages on %d task slots (%d nodes); step: %s",
            held.job_id,
            num_stages,
            self.slots,
            held.num_nodes,
            " ".join(argv),
        )
        return _run_step(argv, env, self.handle_preemption)

    def shrink(self, smaller: config_mod.JobConfig) -> float:
        """Release the nodes ``smaller`` does not need (keeping this one); the seconds taken."""
        held = read_slurm_env()
        needed = nodes_for(smaller.pipeline.num_stages, self.ranks_per_node)
        if needed >= held.num_nodes:
            return 0.0
        kept = nodes_to_keep(held.node_list, held.node_name or held.node_list[0], needed)
        seconds = shrink_job(held.job_id, kept, smaller.run_dir)
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


def _run_step(argv: list[str], env: dict[str, str], handle_preemption: bool) -> StepResult:
    """Run one MPI step; with ``handle_preemption``, SIGUSR2/SIGTERM go on to it."""
    step = StepProcess(argv, env)
    ActiveStep.step = step
    ActiveStep.stop_signal = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        log.warning("received signal %d; passing it to the training step", signum)
        ActiveStep.stop(signum)

    signals = (signal.SIGUSR2, signal.SIGTERM) if handle_preemption else ()
    previous = {s: signal.signal(s, forward) for s in signals}
    try:
        rc = step.wait()
    except BaseException:
        step.kill_all()
        raise
    finally:
        ActiveStep.step = None
        for s, handler in previous.items():
            signal.signal(s, handler)
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
