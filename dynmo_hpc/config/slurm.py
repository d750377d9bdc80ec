"""The ``slurm:`` section, and the rules for sbatch options (shared by rendering and submitit)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dynmo_hpc.config.bounds import printable
from dynmo_hpc.config.sections import PipelineSection
from dynmo_hpc.config.slurm_time import MAX_TIME_MIN, slurm_time_minutes
from dynmo_hpc.errors import ConfigError

LAUNCHERS = ("auto", "srun", "mpirun")
"""How the manager starts the ranks in an allocation (see :mod:`dynmo_hpc.slurm.step`)."""

SRUN_MPI_PLUGINS = ("auto", "pmix", "pmi2", "cray_shasta", "none")
"""``slurm.mpi``: SLURM's MPI plugin for ``srun --mpi=...``; auto follows the MPI
implementation (pmix for Open MPI, pmi2 for MPICH)."""

MPI_IMPLEMENTATIONS = ("openmpi", "mpich")
"""The MPI implementations a job can run on (:mod:`dynmo_hpc.launch.mpi_impl`)."""

MAX_NODES = 100_000
"""More nodes than any cluster has."""
MAX_PER_NODE = 1024
"""Tasks or CPUs per node: more than any node has cores."""
MAX_GPUS_PER_NODE = 64
"""GPUs per node: more than any node holds."""
MAX_MEM_GB = 1e6
"""A petabyte per node: larger is a unit mistake (the key is in GB)."""

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_.+@%:/=,-]+$")
"""What may appear in an ``#SBATCH`` value: sbatch does no shell quoting there."""


def mem_mb(mem_gb: float | None) -> int | None:
    """``--mem`` in whole MB for a per-node memory in GB (rounded up); None stays None."""
    return None if mem_gb is None else math.ceil(mem_gb * 1024)


def sbatch_option_problems(p: Mapping[str, Any]) -> list[str]:
    """What sbatch would reject, or the job could not survive, in a full set of options.

    Pure: one list of human-readable problems (empty when the options are fine), each naming the
    option, the value and the fix. Shared by config validation and sbatch rendering.
    """
    problems: list[str] = []

    def need_int(name: str, minimum: int, maximum: int) -> None:
        value = p[name]
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name}={value!r} must be an integer")
        elif value < minimum:
            problems.append(f"{name}={value} must be >= {minimum}")
        elif value > maximum:
            problems.append(f"{name}={value} must be <= {maximum} (a typo?)")

    need_int("nodes", 1, MAX_NODES)
    need_int("tasks_per_node", 1, MAX_PER_NODE)
    need_int("cpus_per_task", 1, MAX_PER_NODE)
    need_int("gpus_per_node", 0, MAX_GPUS_PER_NODE)
    need_int("time_min", 1, MAX_TIME_MIN)
    need_int("signal_delay_s", 0, MAX_TIME_MIN * 60)
    if not problems and p["signal_delay_s"] >= p["time_min"] * 60:
        problems.append(
            f"signal_delay_s={p['signal_delay_s']} is not less than time_min*60="
            f"{p['time_min'] * 60}: the preemption signal would come before the job starts; "
            "lower signal_delay_s or raise time_min"
        )
    mem_gb = p["mem_gb"]
    if mem_gb is not None and (
        isinstance(mem_gb, bool)
        or not isinstance(mem_gb, int | float)
        or not math.isfinite(mem_gb)
        or mem_gb <= 0
        or mem_gb > MAX_MEM_GB
    ):
        problems.append(
            f"mem_gb={mem_gb!r} must be a positive number of GB up to {MAX_MEM_GB:g} (or None); "
            "e.g. 4 for --mem=4G"
        )
    for name in ("partition", "account", "qos"):
        value = p[name]
        if isinstance(value, str) and not _SAFE_WORD.match(value):
            problems.append(
                f"{name}={value!r} has characters sbatch cannot take in an #SBATCH line "
                "(spaces, quotes, newlines), or is empty; use letters, digits and _.+@%:/=,-, or "
                "null for the default"
            )
    for name in ("venv", "conda_env"):
        value = p[name]
        if isinstance(value, str) and (not value.strip() or not value.isprintable()):
            problems.append(
                f"{name}={value!r} must be a non-empty path or name without control characters"
            )
    if p["venv"] and p["conda_env"]:
        problems.append(
            f"venv={p['venv']!r} and conda_env={p['conda_env']!r} are both set; "
            "the job activates one environment: keep one of them"
        )
    if not isinstance(p["mpi_loopback_only"], bool):
        problems.append(f"mpi_loopback_only={p['mpi_loopback_only']!r} must be true or false")
    if p["launcher"] not in LAUNCHERS:
        problems.append(f"launcher={p['launcher']!r} must be one of {', '.join(LAUNCHERS)}")
    if p["mpi"] not in SRUN_MPI_PLUGINS:
        problems.append(f"mpi={p['mpi']!r} must be one of {', '.join(SRUN_MPI_PLUGINS)}")
    for name in ("modules", "extra_sbatch"):
        value = p[name]
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            problems.append(f"{name}={value!r} must be a list of strings (not one string)")
        elif any(not v.isprintable() or not v.strip() for v in value):
            problems.append(
                f"{name}={list(value)!r} has an empty entry or a newline (or another "
                "control character): each entry is one line of the script"
            )
    if not problems:
        for line in p["extra_sbatch"]:
            if not line.startswith("-"):
                problems.append(
                    f"extra_sbatch entry {line!r} must be an sbatch flag such as '--exclusive'"
                )
    return problems


@dataclass(frozen=True, kw_only=True)
class SlurmSection:
    """How the job is submitted to SLURM (``dynmo-hpc sbatch`` / ``dynmo-hpc submit``).

    :meth:`sbatch_options` maps the fields onto the sbatch template's parameters, once, so one
    job file renders the same allocation through the sbatch template and through submitit. Local
    runs (``dynmo-hpc run``) ignore the section.
    """

    nodes: int | None = None
    """``--nodes``; null = one node per rank (``pipeline.replicas * pipeline.num_stages``)."""
    tasks_per_node: int = 1
    """``--ntasks-per-node``: MPI ranks per node; nodes * tasks_per_node >= the job's ranks."""
    gpus_per_node: int = 0
    """``--gpus-per-node``; 0 leaves it out (CPU nodes)."""
    cpus_per_task: int = 1
    """``--cpus-per-task``; raise it with runtime.threads_per_rank."""
    time_min: int | str = 30
    """``--time``: whole minutes, or a SLURM time string ("MM:SS", "HH:MM:SS", "D-HH",
    "D-HH:MM", "D-HH:MM:SS"; seconds round up to a minute); the job is killed after it."""
    partition: str | None = None
    """``--partition``; null = the cluster's default partition."""
    account: str | None = None
    """``--account`` to charge; null = the user's default."""
    qos: str | None = None
    """``--qos``; null = the default quality of service."""
    mem_gb: float | None = None
    """``--mem`` per node in GB; null = the partition's default."""
    signal_delay_s: int = 120
    """SIGUSR2 reaches the job manager this many seconds before the time limit (checkpoint)."""
    venv: str | None = None
    """Virtual environment the job activates; null = the one running at submit time
    (``sys.prefix``), or none when that is not a venv."""
    conda_env: str | None = None
    """Conda environment the job activates instead of a venv (not together with venv)."""
    modules: list[str] = field(default_factory=list)
    """Environment modules to ``module load``, in order, before activation (e.g. an MPI, CUDA)."""
    launcher: Literal["auto", "srun", "mpirun"] = "auto"
    """How the manager starts the ranks: ``srun --mpi=pmix``, the venv's ``mpirun``; auto = srun."""
    mpi: Literal["auto", "pmix", "pmi2", "cray_shasta", "none"] = "auto"
    """SLURM's MPI plugin for ``srun --mpi=...`` (and ``SLURM_MPI_TYPE``): ``pmix``, ``pmi2``,
    ``cray_shasta`` (Cray-MPICH), ``none``; auto = ``pmix`` with Open MPI, ``pmi2`` with MPICH.
    Open MPI 5 takes ``pmix`` or ``none`` only."""
    loopback_only: bool = False
    """Pin Open MPI to TCP over ``lo``: true only where all nodes share one host (test clusters);
    no effect on MPICH."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` flags, verbatim, e.g. ``[--exclusive]``."""

    @property
    def time_minutes(self) -> int:
        """``time_min`` in whole minutes (a SLURM time string parsed)."""
        if isinstance(self.time_min, str):
            return slurm_time_minutes(self.time_min)
        return self.time_min

    def num_nodes(self, num_ranks: int) -> int:
        """The node count to ask for: ``nodes``, or one node per rank (``num_ranks``: the
        job's ``pipeline.world_size``, replicas times stages)."""
        return num_ranks if self.nodes is None else self.nodes

    def sbatch_options(self, num_ranks: int) -> dict[str, Any]:
        """The allocation as sbatch-template parameters: the one mapping from this section.

        :func:`dynmo_hpc.slurm.sbatch.render_sbatch` takes these keywords (plus the job's name,
        config path, output directory and Python), submitit's executor parameters are derived
        from them, and :meth:`validate` checks them with the same rules.
        """
        return {
            "nodes": self.num_nodes(num_ranks),
            "tasks_per_node": self.tasks_per_node,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "time_min": self.time_minutes,
            "partition": self.partition,
            "account": self.account,
            "qos": self.qos,
            "mem_gb": self.mem_gb,
            "signal_delay_s": self.signal_delay_s,
            "venv": self.venv,
            "conda_env": self.conda_env,
            "modules": list(self.modules),
            "launcher": self.launcher,
            "mpi": self.mpi,
            "mpi_loopback_only": self.loopback_only,
            "extra_sbatch": list(self.extra_sbatch),
        }

    def validate(self) -> None:
        for name in ("partition", "account", "qos", "venv", "conda_env"):
            printable(f"slurm.{name}", getattr(self, name))
        options = self.sbatch_options(num_ranks=1)
        problems = sbatch_option_problems(options)
        if problems:
            text = "; ".join(
                "slurm." + m.replace("mpi_loopback_only", "loopback_only") for m in problems
            )
            raise ConfigError(
                text + "; HINT: fix it under slurm: in the job file or with --set slurm.KEY=VALUE"
            )

    def validate_for(self, pipeline: PipelineSection) -> None:
        """One MPI rank per stage of each replica: the allocation must hold a task slot for
        every one of them."""
        num_ranks = pipeline.world_size
        num_nodes = self.num_nodes(num_ranks)
        slots = num_nodes * self.tasks_per_node
        if slots < num_ranks:
            needed = f"pipeline.num_stages({pipeline.num_stages})"
            if pipeline.replicas > 1:
                needed = f"pipeline.replicas({pipeline.replicas}) * {needed} = {num_ranks}"
            raise ConfigError(
                f"slurm.nodes({num_nodes}) * slurm.tasks_per_node({self.tasks_per_node}) = "
                f"{slots} < {needed}: every stage of every replica needs a task slot; "
                "HINT: raise slurm.nodes or slurm.tasks_per_node, or set slurm.nodes: null "
                "(one node per rank)"
            )
