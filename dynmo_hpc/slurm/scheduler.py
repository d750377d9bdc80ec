"""Ask the scheduler: what the cluster has (sinfo), submit a script (sbatch), poll its state.

Why a module of its own: these are the only SLURM client calls besides submitit's, and they all go
through :func:`run_command`, so tests fake a cluster by patching one function (as submitit's
tests do). The decisions on top of the answers (:func:`parse_sinfo`, :func:`check_fits_cluster`)
are pure.

Job states come from ``sacct`` (accounting); without accounting, ``scontrol show job`` still
knows a finished job for ``MinJobAge`` seconds.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynmo_hpc import config as config_mod
from dynmo_hpc.errors import SubmitError

__all__ = [
    "TERMINAL_STATES",
    "PartitionInfo",
    "SubmitError",
    "check_fits_cluster",
    "parse_sinfo",
    "query_partitions",
    "run_command",
    "sbatch_job_state",
    "sbatch_log_paths",
    "submit_sbatch",
    "wait_for_sbatch_job",
]

TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
"""Scheduler states after which a job never runs again (without a requeue)."""


class SlurmTimeout(SubmitError):
    """A SLURM client command did not answer in time: what it asked for may still happen."""


def run_command(
    argv: Sequence[str], *, timeout_s: float = 60.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a SLURM client command, output captured; the one place this module starts processes."""
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, cwd=cwd
        )
    except FileNotFoundError:
        raise SubmitError(
            f"{argv[0]} not found; HINT: run on a SLURM login node, or load the SLURM module"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmTimeout(
            f"{' '.join(argv)} did not answer in {timeout_s:.0f} s; HINT: check that slurmctld "
            "is up (scontrol ping) and that SLURM_CONF points at the cluster"
        ) from None


@dataclass(frozen=True)
class PartitionInfo:
    """One group of identical nodes of a partition, as ``sinfo -e`` lists it."""

    name: str
    is_default: bool
    num_nodes: int
    cpus_per_node: int
    mem_mb: int
    gpus_per_node: int


_GPU_GRES = re.compile(r"gpu(?::[^:,()]+)?:(\d+)")


def parse_sinfo(text: str) -> list[PartitionInfo]:
    """Rows of ``sinfo -h -e -o %P|%D|%c|%m|%G``; the default partition's name ends in ``*``."""
    rows = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, nodes, cpus, mem, gres = fields
        gpus = sum(int(m.group(1)) for m in _GPU_GRES.finditer(gres))
        rows.append(
            PartitionInfo(
                name=name.rstrip("*"),
                is_default=name.endswith("*"),
                num_nodes=int(nodes),
                cpus_per_node=int(cpus.rstrip("+")),
                mem_mb=int(mem.rstrip("+")),
                gpus_per_node=gpus,
            )
        )
    return rows


def query_partitions() -> list[PartitionInfo]:
    """The cluster's partitions, from ``sinfo``."""
    out = run_command(["sinfo", "-h", "-e", "-o", "%P|%D|%c|%m|%G"])
    if out.returncode != 0:
        raise SubmitError(
            f"sinfo failed: {out.stderr.strip()}; HINT: is SLURM reachable here? "
            "(scontrol ping; set SLURM_CONF for a non-default cluster)"
        )
    return parse_sinfo(out.stdout)


def check_fits_cluster(cfg: config_mod.JobConfig, partitions: Sequence[PartitionInfo]) -> None:
    """Raise ConfigError if no partition can ever run the job; the message lists what is valid.

    These are the requests sbatch would reject at submission (unknown partition, memory or GPUs
    the nodes lack) or accept and never run (more nodes or CPUs than exist).
    """
    if not partitions:
        return
    s = cfg.slurm
    names = sorted({p.name for p in partitions})
    default = next((p.name for p in partitions if p.is_default), None)
    wanted = s.partition or default
    if wanted is None:
        return
    if wanted not in names:
        listing = ", ".join(f"{n} (default)" if n == default else n for n in names)
        raise config_mod.ConfigError(
            f"slurm.partition={wanted!r} is not a partition of this cluster; valid: {listing}. "
            "HINT: set slurm.partition to one of them, or null for the default"
        )
    groups = [p for p in partitions if p.name == wanted]
    nodes = s.num_nodes(cfg.pipeline.world_size)
    cpus = s.tasks_per_node * s.cpus_per_task
    mem_mb = config_mod.mem_mb(s.mem_gb)
    fitting = sum(
        g.num_nodes
        for g in groups
        if g.cpus_per_node >= cpus
        and (mem_mb is None or g.mem_mb >= mem_mb)
        and g.gpus_per_node >= s.gpus_per_node
    )
    if fitting >= nodes:
        return
    have = "; ".join(
        f"{g.num_nodes} node(s) with {g.cpus_per_node} CPUs, {g.mem_mb} MB, {g.gpus_per_node} GPUs"
        for g in groups
    )
    need = (
        f"{nodes} node(s) with slurm.tasks_per_node({s.tasks_per_node}) * "
        f"slurm.cpus_per_task({s.cpus_per_task}) = {cpus} CPUs"
        + (f", {mem_mb} MB (slurm.mem_gb={s.mem_gb})" if mem_mb is not None else "")
        + (f", {s.gpus_per_node} GPUs" if s.gpus_per_node else "")
    )
    raise config_mod.ConfigError(
        f"partition {wanted!r} cannot run this job: it needs {need}, but only {fitting} node(s) "
        f"fit; the partition has {have}. HINT: lower slurm.nodes, tasks_per_node, "
        "cpus_per_task, mem_gb or gpus_per_node, or choose another slurm.partition"
    )


def submit_sbatch(script_path: Path) -> int:
    """``sbatch --parsable SCRIPT``; returns the job id (the script's paths are absolute)."""
    out = run_command(["sbatch", "--parsable", str(script_path)])
    if out.returncode != 0:
        raise SubmitError(
            f"sbatch refused {script_path}: {out.stderr.strip()}; HINT: fix the slurm: "
            "settings the message names (dynmo-hpc sbatch JOB.yaml prints the script)"
        )
    return int(out.stdout.strip().split(";")[0])


def sbatch_log_paths(cfg: config_mod.JobConfig, job_id: int) -> tuple[Path, Path]:
    """The template's ``--output``/``--error`` files: ``<run_dir>/<job name>-<id>.out/.err``."""
    stem = f"{cfg.job.name}-{job_id}"
    return cfg.run_dir / f"{stem}.out", cfg.run_dir / f"{stem}.err"


def sbatch_job_state(job_id: int) -> str | None:
    """The job's state: from squeue while queued, then sacct; None while it is not final."""
    queued = run_command(["squeue", "-h", "-j", str(job_id), "-o", "%T"])
    if queued.returncode == 0 and queued.stdout.strip():
        return None
    acct = run_command(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State"])
    lines = acct.stdout.strip().splitlines() if acct.returncode == 0 else []
    if lines:
        state = lines[-1].strip()
        return state if state.split()[0] in TERMINAL_STATES else None
    # No accounting: scontrol remembers finished jobs for MinJobAge seconds.
    show = run_command(["scontrol", "show", "job", "-o", str(job_id)])
    found = re.search(r"JobState=(\S+)", show.stdout)
    if found and found.group(1) in TERMINAL_STATES:
        return found.group(1)
    return None


def wait_for_sbatch_job(job_id: int, *, poll_s: float = 0.5, timeout_s: float | None = None) -> str:
    """Poll until the job has ended; returns its final state.

    Polling squeue is quicker than ``sbatch --wait`` (which checks about every 10 s).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = sbatch_job_state(job_id)
        if state is not None:
            return state
        if deadline is not None and time.monotonic() > deadline:
            raise SubmitError(
                f"job {job_id} has not ended after {timeout_s:.0f} s; HINT: squeue -j {job_id}"
            )
        time.sleep(poll_s)
