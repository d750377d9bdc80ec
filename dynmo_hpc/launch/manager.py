"""The job manager: runs once inside a SLURM allocation and starts the training ranks.

``python -m dynmo_hpc.launch.manager JOB.yaml`` is what the sbatch template ``exec``s and what
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
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance.packing import nodes_for
from dynmo_hpc.errors import ConfigError, LaunchError
from dynmo_hpc.launch.local import LAUNCH_TIME_ENV, worker_argv
from dynmo_hpc.launch.resize import run_elastic
from dynmo_hpc.logging_utils import setup_logging
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


def run_manager(
    config_path: str | Path,
    overrides: list[str] | None = None,
    *,
    launcher: str | None = None,
    loopback_only: bool | None = None,
) -> int:
    """Run the job's training as MPI steps in the current allocation; returns the exit code.

    One step normally; with ``elastic.enabled`` a step that asks to pack is followed by a
    shrink of the allocation (``scontrol update``, keeping this node) and a new, smaller step
    that resumes from the pack's checkpoint (:func:`~dynmo_hpc.launch.resize.run_elastic`).
    """
    if not in_slurm_job():
        raise LaunchError(
            "dynmo_hpc.launch.manager runs inside a SLURM allocation (no SLURM_JOB_ID here); "
            "HINT: use `dynmo-hpc run JOB.yaml` for local ranks, or `dynmo-hpc submit JOB.yaml`"
        )
    cfg = config_mod.load(config_path, overrides)
    slots = check_allocation(cfg)
    launcher = launcher or os.environ.get("DYNMO_MPI_LAUNCHER", "auto")
    if loopback_only is None:
        loopback_only = os.environ.get("DYNMO_MPI_LOOPBACK_ONLY", "0") == "1"
    first = read_slurm_env()
    ranks_per_node = (
        max(first.tasks_per_node)
        if first.tasks_per_node
        else max(1, -(-cfg.pipeline.num_stages // first.num_nodes))
    )
    t0 = time.perf_counter()

    def run_step(step_cfg: config_mod.JobConfig, resolved: Path, resume: Path | None) -> int:
        held = read_slurm_env()
        argv = mpi_step_argv(
            launcher,
            worker_argv(resolved, resume_from=resume),
            num_tasks=step_cfg.pipeline.num_stages,
            num_nodes=min(held.num_nodes, nodes_for(step_cfg.pipeline.num_stages, ranks_per_node))
            if resume is not None
            else None,
        )
        env = {
            **os.environ,
            **slurm_mpi_env(launcher, loopback_only=loopback_only),
            LAUNCH_TIME_ENV: repr(time.time()),
        }
        log.info(
            "job %s: %d stages on %d task slots (%d nodes); step: %s",
            held.job_id,
            step_cfg.pipeline.num_stages,
            slots,
            held.num_nodes,
            " ".join(argv),
        )
        return _run_forwarding_signals(argv, env)

    def shrink(smaller: config_mod.JobConfig) -> float:
        held = read_slurm_env()
        needed = nodes_for(smaller.pipeline.num_stages, ranks_per_node)
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

    rc = run_elastic(cfg, run_step, shrink)
    elapsed_s = time.perf_counter() - t0
    if rc == 0:
        log.info("training finished in %.1f s; run directory %s", elapsed_s, cfg.run_dir)
    else:
        log.error(
            "training step failed (exit code %d) after %.1f s; run directory %s",
            rc,
            elapsed_s,
            cfg.run_dir,
        )
    return rc


def _run_forwarding_signals(argv: list[str], env: dict[str, str]) -> int:
    """Run one MPI step; SIGUSR2/SIGTERM to the manager go on to the step."""
    proc = subprocess.Popen(argv, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        log.warning("received signal %d; forwarding to the training step", signum)
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    setup_logging(0)
    if not args:
        print(
            "usage: python -m dynmo_hpc.launch.manager JOB.yaml [section.key=value ...]",
            file=sys.stderr,
        )
        return 2
    try:
        return run_manager(args[0], args[1:])
    except (ConfigError, LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
