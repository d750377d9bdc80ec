"""The SLURM job environment, read from environment variables only.

Why only from ``os.environ``: inside an allocation the variables SLURM exports are the one source of
truth that needs no daemon, no subprocess and no network, and reading them is a pure function of a
mapping, so every case (arrays, heterogeneous task counts, a shrunk job) is testable in
milliseconds with a patched environment. This follows Lightning's ``SLURMEnvironment``.

SLURM writes two compressed forms that we expand ourselves (no ``scontrol show hostnames``
subprocess, which would need the controller):

* host lists: ``node[1-3,5],gpu[01-02]`` -> ``node1 node2 node3 node5 gpu01 gpu02``
  (zero padding is kept: ``gpu[08-10]`` -> ``gpu08 gpu09 gpu10``);
* per-node counts: ``2(x3),1`` -> ``[2, 2, 2, 1]`` (``SLURM_TASKS_PER_NODE``,
  ``SLURM_JOB_CPUS_PER_NODE``).

After a shrink (``scontrol update JobId=.. NumNodes=K``) the ``slurm_job_<id>_resize.sh`` script
re-exports ``SLURM_NODELIST``, ``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES`` and
``SLURM_JOB_CPUS_PER_NODE`` and unsets ``SLURM_NTASKS``, ``SLURM_NPROCS`` and
``SLURM_TASKS_PER_NODE``; so every one of those is optional here and the node list wins over stale
counts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dynmo_hpc.errors import DynmoError

__all__ = [
    "SlurmEnv",
    "SlurmEnvError",
    "expand_hostlist",
    "expand_per_node_counts",
    "in_slurm_job",
    "read_slurm_env",
]


class SlurmEnvError(DynmoError, ValueError):
    """The SLURM variables are missing or malformed; the message ends with a ``HINT:``."""


@dataclass(frozen=True, kw_only=True)
class SlurmEnv:
    """What this process knows about its SLURM job, from its environment."""

    job_id: int
    """``SLURM_JOB_ID``; for an array task this is the task's own job id."""
    job_name: str | None
    """``SLURM_JOB_NAME``."""
    array_job_id: int | None
    """``SLURM_ARRAY_JOB_ID``: the id shared by every task of an array, None outside arrays."""
    array_task_id: int | None
    """``SLURM_ARRAY_TASK_ID``: this task's index in the array, None outside arrays."""
    node_list: tuple[str, ...]
    """Expanded ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``): the allocation's nodes, in order."""
    num_nodes: int
    """Nodes in the allocation: ``len(node_list)``, which stays right after a shrink."""
    step_node_list: tuple[str, ...] | None
    """Expanded ``SLURM_STEP_NODELIST`` inside an srun step (may be a subset of ``node_list``);
    None in the batch script."""
    tasks_per_node: tuple[int, ...] | None
    """Tasks per node, one entry per node: of the step inside a step (``SLURM_STEP_TASKS_PER_NODE``
    over ``step_node_list``), else of the job (``SLURM_TASKS_PER_NODE`` over ``node_list``).
    None when unset: after a shrink, whose resize script unsets it."""
    num_tasks: int | None
    """Tasks of the step inside a step (``SLURM_STEP_NUM_TASKS``), else of the job
    (``SLURM_NTASKS`` / ``SLURM_NPROCS``); None when unset (after a shrink)."""
    cpus_per_node: tuple[int, ...] | None
    """Expanded ``SLURM_JOB_CPUS_PER_NODE``, one entry per node; None when unset."""
    cpus_per_task: int | None
    """``SLURM_CPUS_PER_TASK``: set only when the job asked for ``--cpus-per-task``."""
    proc_id: int | None
    """``SLURM_PROCID``: this task's global rank within its step; None in the batch script."""
    local_id: int | None
    """``SLURM_LOCALID``: this task's rank on its node; None in the batch script."""
    node_id: int | None
    """``SLURM_NODEID``: index of this task's node within the step's node list."""
    node_name: str | None
    """``SLURMD_NODENAME``: the node this process runs on. Several nodes can share one host (as
    in the test cluster), so this, not ``socket.gethostname()``, identifies the node."""
    step_id: int | None
    """``SLURM_STEP_ID``; None in the batch script (the ``batch`` step exports no number)."""
    submit_dir: str | None
    """``SLURM_SUBMIT_DIR``: where ``sbatch`` was run, for resolving relative paths."""

    @property
    def is_array_task(self) -> bool:
        """True for one task of a job array."""
        return self.array_task_id is not None

    @property
    def master_node(self) -> str:
        """The first node of the allocation: where rank 0's rendezvous should listen."""
        return self.node_list[0]


_COUNT_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_per_node_counts(spec: str) -> list[int]:
    """Expand SLURM's per-node count syntax: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Used for ``SLURM_TASKS_PER_NODE`` and ``SLURM_JOB_CPUS_PER_NODE``.

    Example:
        >>> expand_per_node_counts("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in spec.split(","):
        match = _COUNT_RE.match(item.strip())
        if match is None:
            raise SlurmEnvError(
                f"per-node count {spec!r}: item {item!r} is not N or N(xM). "
                "HINT: SLURM writes e.g. '2(x3),1'; check the variable was not edited by hand"
            )
        value, repeat = int(match.group(1)), int(match.group(2) or 1)
        if repeat < 1:
            raise SlurmEnvError(
                f"per-node count {spec!r}: repeat count in {item!r} must be >= 1. "
                "HINT: SLURM writes e.g. '2(x3),1'"
            )
        counts.extend([value] * repeat)
    return counts


def _split_top_level(spec: str) -> list[str]:
    """Split ``a[1-2],b,c[3,5]`` on the commas that are outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(
                    f"host list {spec!r}: nested '[' at position {i}. "
                    "HINT: a host list looks like 'node[1-3,5],gpu[01-02]'"
                )
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(
                    f"host list {spec!r}: unmatched ']' at position {i}. "
                    "HINT: a host list looks like 'node[1-3,5],gpu[01-02]'"
                )
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmEnvError(
            f"host list {spec!r}: unclosed '['. HINT: a host list looks like 'node[1-3,5]'"
        )
    parts.append(spec[start:])
    return parts


def _expand_range(spec: str, item: str) -> list[str]:
    """``"08-10"`` -> ``["08", "09", "10"]`` (the low end's width is kept); ``"5"`` -> ``["5"]``."""
    lo_text, sep, hi_text = item.partition("-")
    if not lo_text.isdigit() or (sep and not hi_text.isdigit()):
        raise SlurmEnvError(
            f"host list {spec!r}: range {item!r} is not N or N-M. "
            "HINT: a host list looks like 'node[1-3,5],gpu[01-02]'"
        )
    if not sep:
        return [lo_text]
    lo, hi = int(lo_text), int(hi_text)
    if hi < lo:
        raise SlurmEnvError(
            f"host list {spec!r}: range {item!r} runs backwards. HINT: write the low end first"
        )
    width = len(lo_text)
    return [str(i).zfill(width) for i in range(lo, hi + 1)]


def _expand_one(spec: str, part: str) -> list[str]:
    """Expand one top-level item; several bracket groups multiply (``r[1-2]n[1-2]``)."""
    names = [""]
    rest = part
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            names = [n + rest for n in names]
            break
        close_at = rest.index("]", open_at)
        prefix, body, rest = rest[:open_at], rest[open_at + 1 : close_at], rest[close_at + 1 :]
        if not body:
            raise SlurmEnvError(
                f"host list {spec!r}: empty brackets in {part!r}. "
                "HINT: a host list looks like 'node[1-3,5]'"
            )
        suffixes = [s for item in body.split(",") for s in _expand_range(spec, item.strip())]
        names = [n + prefix + s for n in names for s in suffixes]
    return names


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list: ``"node[1-3,5],gpu[01-02]"`` -> six names, in order.

    Our own parser, so that reading the environment never needs ``scontrol show hostnames``.

    Example:
        >>> expand_hostlist("node[1-3,5],gpu[01-02]")
        ['node1', 'node2', 'node3', 'node5', 'gpu01', 'gpu02']
    """
    spec = spec.strip()
    if not spec:
        raise SlurmEnvError(
            "host list is empty. HINT: SLURM_JOB_NODELIST is set by sbatch/salloc/srun; "
            "run inside an allocation"
        )
    hosts: list[str] = []
    for part in _split_top_level(spec):
        part = part.strip()
        if not part:
            raise SlurmEnvError(
                f"host list {spec!r} has an empty item. HINT: remove the doubled or trailing comma"
            )
        hosts.extend(_expand_one(spec, part))
    return hosts


def in_slurm_job(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a SLURM allocation (batch script, salloc shell or srun step).

    ``SLURM_JOB_ID`` is the marker: sbatch, salloc and srun all export it, while ``SLURM_CONF``
    alone only says where a cluster is.
    """
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def _get_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int; None if none is set."""
    for name in names:
        text = env.get(name)
        if text is None or text == "":
            continue
        try:
            return int(text)
        except ValueError:
            raise SlurmEnvError(
                f"{name}={text!r} is not an integer. "
                f"HINT: SLURM sets {name} to a number; unset it or fix the value"
            ) from None
    return None


def _per_node(env: Mapping[str, str], name: str, num_nodes: int) -> tuple[int, ...] | None:
    text = env.get(name)
    if not text:
        return None
    counts = expand_per_node_counts(text)
    if len(counts) != num_nodes:
        raise SlurmEnvError(
            f"{name}={text!r} covers {len(counts)} nodes but its node list has {num_nodes}. "
            "HINT: after a shrink, source the slurm_job_<id>_resize.sh that scontrol wrote"
        )
    return tuple(counts)


def _node_lists(
    env: Mapping[str, str], job_id: int
) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """The job's node list, checked against its declared count, and the step's (None outside
    a step)."""
    node_spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not node_spec:
        raise SlurmEnvError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST and SLURM_NODELIST are not. "
            "HINT: a hand-made environment needs SLURM_JOB_NODELIST too"
        )
    node_list = tuple(expand_hostlist(node_spec))
    num_nodes = len(node_list)
    step_spec = env.get("SLURM_STEP_NODELIST")
    step_node_list = tuple(expand_hostlist(step_spec)) if step_spec else None
    # Inside a step SLURM_NNODES describes the step, so only the job's own count is compared.
    fallback = () if step_node_list else ("SLURM_NNODES",)
    declared = _get_int(env, "SLURM_JOB_NUM_NODES", *fallback)
    if declared is not None and declared != num_nodes:
        raise SlurmEnvError(
            f"SLURM_JOB_NUM_NODES={declared} but SLURM_JOB_NODELIST={node_spec!r} names "
            f"{num_nodes} nodes. HINT: after a shrink, source slurm_job_{job_id}_resize.sh"
        )
    return node_list, step_node_list


def _tasks(
    env: Mapping[str, str], num_nodes: int, step_node_list: tuple[str, ...] | None
) -> tuple[tuple[int, ...] | None, int | None]:
    """Tasks per node and in all: of the step inside a step, else of the job; checked to
    agree."""
    if step_node_list:
        tasks_var, count_var = "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS"
        tasks_per_node = _per_node(env, tasks_var, len(step_node_list))
        num_tasks = _get_int(env, count_var)
    else:
        tasks_var, count_var = "SLURM_TASKS_PER_NODE", "SLURM_NTASKS"
        tasks_per_node = _per_node(env, tasks_var, num_nodes)
        num_tasks = _get_int(env, count_var, "SLURM_NPROCS")
    if tasks_per_node is not None and num_tasks is not None and sum(tasks_per_node) != num_tasks:
        raise SlurmEnvError(
            f"{tasks_var}={env[tasks_var]!r} sums to {sum(tasks_per_node)} but "
            f"{count_var}={num_tasks}. "
            "HINT: after a shrink, source the resize script, which unsets both"
        )
    return tasks_per_node, num_tasks


def _array_ids(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """The array job and task ids: both or neither."""
    array_job_id = _get_int(env, "SLURM_ARRAY_JOB_ID")
    array_task_id = _get_int(env, "SLURM_ARRAY_TASK_ID")
    if (array_job_id is None) != (array_task_id is None):
        raise SlurmEnvError(
            "only one of SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID is set. "
            "HINT: SLURM sets both for array tasks and neither otherwise"
        )
    return array_job_id, array_task_id


def read_slurm_env(environ: Mapping[str, str] | None = None) -> SlurmEnv:
    """Read the job environment from ``environ`` (default ``os.environ``).

    Raises:
        SlurmEnvError: outside a job, or when a variable is malformed or inconsistent.
    """
    env = os.environ if environ is None else environ
    job_id = _get_int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_id is None:
        raise SlurmEnvError(
            "SLURM_JOB_ID is not set: this process is not inside a SLURM job. "
            "HINT: submit with sbatch (dynmo-hpc submit) or run under salloc/srun"
        )
    node_list, step_node_list = _node_lists(env, job_id)
    num_nodes = len(node_list)
    cpus_per_node = _per_node(env, "SLURM_JOB_CPUS_PER_NODE", num_nodes)
    tasks_per_node, num_tasks = _tasks(env, num_nodes, step_node_list)
    array_job_id, array_task_id = _array_ids(env)
    proc_id = _get_int(env, "SLURM_PROCID")
    if proc_id is not None and num_tasks is not None and not 0 <= proc_id < num_tasks:
        raise SlurmEnvError(
            f"SLURM_PROCID={proc_id} is outside [0, SLURM_NTASKS={num_tasks}). "
            "HINT: do not export SLURM_PROCID by hand"
        )
    node_name = env.get("SLURMD_NODENAME") or None
    return SlurmEnv(
        job_id=job_id,
        job_name=env.get("SLURM_JOB_NAME") or None,
        array_job_id=array_job_id,
        array_task_id=array_task_id,
        node_list=node_list,
        num_nodes=num_nodes,
        step_node_list=step_node_list,
        tasks_per_node=tasks_per_node,
        num_tasks=num_tasks,
        cpus_per_node=cpus_per_node,
        cpus_per_task=_get_int(env, "SLURM_CPUS_PER_TASK"),
        proc_id=proc_id,
        local_id=_get_int(env, "SLURM_LOCALID"),
        node_id=_get_int(env, "SLURM_NODEID"),
        node_name=node_name,
        step_id=_get_int(env, "SLURM_STEP_ID", "SLURM_STEPID"),
        submit_dir=env.get("SLURM_SUBMIT_DIR") or None,
    )
