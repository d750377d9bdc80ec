"""Shrinking a running SLURM job: which nodes to keep, the environment after, the scontrol call.

What SLURM allows (verified on the test cluster, docs/slurm.md): ``scontrol update JobId=ID
NodeList=<nodes kept>`` shrinks a running job; the released nodes are idle at once and other
jobs run on them. The node running the batch script cannot be released, so it is always kept.
Any step still running on a released node is killed, so the MPI step must have ended first
(:mod:`dynmo_hpc.handoff.resize`). ``scontrol`` then writes ``slurm_job_<id>_resize.sh``,
which re-exports the node list and counts and unsets the task counts; :func:`resized_env` does
the same for the manager's own environment, so the next ``srun`` sees the smaller job.

The choice and the environment are pure functions; :func:`shrink_job` is the one call out
(with its read-back of the node list after an scontrol that did not answer).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynmo_hpc.errors import SubmitError
from dynmo_hpc.slurm.environment import expand_hostlist, expand_per_node_counts
from dynmo_hpc.slurm.scheduler import SlurmTimeout, run_command

UNSET_AFTER_RESIZE = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_TASKS_PER_NODE")
"""Variables SLURM's resize script unsets: they describe the allocation before the shrink."""


def nodes_to_keep(node_list: Sequence[str], own_node: str | None, num_nodes: int) -> list[str]:
    """The ``num_nodes`` nodes to keep: the manager's own node first, then in allocation order.

    Example:
        >>> nodes_to_keep(["node1", "node2", "node3", "node4"], "node3", 2)
        ['node1', 'node3']
    """
    if not 1 <= num_nodes <= len(node_list):
        raise ValueError(f"num_nodes={num_nodes} must be in 1..{len(node_list)} (nodes held)")
    keep = {own_node} if own_node in node_list else set()
    for node in node_list:
        if len(keep) >= num_nodes:
            break
        keep.add(node)
    return [node for node in node_list if node in keep]


def nodes_after_release(
    node_list: Sequence[str], own_node: str | None, needed: int
) -> list[str] | None:
    """The nodes to keep when a job on ``node_list`` needs only ``needed`` of them (the
    manager's own node among them), or None when it needs them all: nothing to release.

    Example:
        >>> nodes_after_release(["node1", "node2", "node3", "node4"], "node1", 2)
        ['node1', 'node2']
        >>> nodes_after_release(["node1", "node2"], "node1", 2) is None
        True
    """
    if needed >= len(node_list):
        return None
    return nodes_to_keep(node_list, own_node or node_list[0], max(1, needed))


def compress_counts(counts: Sequence[int]) -> str:
    """SLURM's per-node count syntax: ``[2, 2, 2, 1]`` -> ``"2(x3),1"``."""
    items: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        items.append(f"{counts[i]}(x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return ",".join(items)


def resized_env(environ: Mapping[str, str], kept: Sequence[str]) -> dict[str, str | None]:
    """The variables to change after shrinking to ``kept`` (None: unset), as SLURM's resize
    script would."""
    old_nodes = expand_hostlist(environ.get("SLURM_JOB_NODELIST") or environ["SLURM_NODELIST"])
    nodes = ",".join(kept)
    changes: dict[str, str | None] = {
        "SLURM_NODELIST": nodes,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_NNODES": str(len(kept)),
        "SLURM_JOB_NUM_NODES": str(len(kept)),
    }
    cpus = environ.get("SLURM_JOB_CPUS_PER_NODE")
    if cpus:
        per_node = dict(zip(old_nodes, expand_per_node_counts(cpus), strict=False))
        changes["SLURM_JOB_CPUS_PER_NODE"] = compress_counts([per_node[n] for n in kept])
    for name in UNSET_AFTER_RESIZE:
        changes[name] = None
    return changes


def shrink_job(
    job_id: int,
    kept: Sequence[str],
    workdir: Path,
    *,
    confirm_s: float = 60.0,
    poll_s: float = 2.0,
) -> float:
    """``scontrol update JobId=<id> NodeList=<kept>``; returns the seconds it took.

    Run in ``workdir`` (the run directory), where scontrol leaves its
    ``slurm_job_<id>_resize.sh``/``.csh`` for anyone who wants the environment in a shell.
    An scontrol that does not answer in time is not a refusal: slurmctld may apply the update
    late, and a job that then went on with its old node list would launch on released nodes.
    So the job's node list is read back (``squeue``) every ``poll_s`` for up to ``confirm_s``;
    the shrink counts as done once the job holds exactly ``kept``.

    Raises:
        SubmitError: scontrol refused, or did not answer and the job still held other nodes
            after ``confirm_s`` (the message is SLURM's, with a HINT).
    """
    t0 = time.perf_counter()
    argv = ["scontrol", "update", f"JobId={job_id}", f"NodeList={','.join(kept)}"]
    try:
        out = run_command(argv, cwd=workdir)
    except SlurmTimeout as exc:
        held = _held_after(job_id, kept, confirm_s=confirm_s, poll_s=poll_s)
        if held == list(kept):
            return time.perf_counter() - t0
        raise SubmitError(
            f"{exc}; job {job_id} still held {','.join(held) or 'an unknown node list'} "
            f"{confirm_s:.0f} s later, not {','.join(kept)}; HINT: check slurmctld "
            "(scontrol ping) before resuming the job"
        ) from None
    if out.returncode != 0:
        raise SubmitError(
            f"scontrol could not shrink job {job_id} to {','.join(kept)}: "
            f"{(out.stderr or out.stdout).strip()}; HINT: the batch script's node cannot be "
            "released, and the cluster must allow shrinking running jobs"
        )
    return time.perf_counter() - t0


def _held_after(job_id: int, kept: Sequence[str], *, confirm_s: float, poll_s: float) -> list[str]:
    """The job's node list as ``squeue`` shows it, polled until it is ``kept`` or ``confirm_s``
    passed (an empty list when squeue never answered)."""
    deadline = time.monotonic() + confirm_s
    held: list[str] = []
    while True:
        try:
            out = run_command(["squeue", "-h", "-j", str(job_id), "-o", "%N"])
            if out.returncode == 0 and out.stdout.strip():
                held = expand_hostlist(out.stdout.strip())
        except SubmitError:
            pass
        if held == list(kept) or time.monotonic() >= deadline:
            return held
        time.sleep(poll_s)
