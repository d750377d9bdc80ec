"""How a job's ranks sit on nodes: the one rule the packing decision and the manager share."""

from __future__ import annotations

from collections.abc import Sequence


def ranks_per_node(
    num_ranks: int, num_nodes: int, tasks_per_node: Sequence[int] | None = None
) -> int:
    """Ranks one node holds: the most SLURM placed on any node when its layout is known
    (``SLURM_TASKS_PER_NODE``), else the ranks spread evenly, rounded up (at least 1).

    Example: 5 ranks on 2 nodes -> 3; SLURM's ``[2, 2, 1]`` -> 2.
    """
    if tasks_per_node:
        return max(tasks_per_node)
    return max(1, -(-num_ranks // max(1, num_nodes)))
