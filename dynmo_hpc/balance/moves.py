"""Migration planning: which layers change stage when one partition replaces another.

Why a pure function: the transfer code (MPI sends of weights, gradients and optimizer state) must
move exactly these layers and no others, and the decision rule must price exactly these bytes.
Deriving both from one list, computed from two boundary lists alone, keeps the plan, its price
and the transfer in agreement, and leaves no holes.

Because both partitions keep layers in global order with contiguous stages, a layer's new place
is fully determined by the new boundaries: nothing is appended or reordered, and a stage's layers
after migration are simply ``range(new_parts[p], new_parts[p+1])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynmo_hpc.balance.common import check_parts


@dataclass(frozen=True, order=True)
class Move:
    """One layer changing owner: global ``layer`` index, from stage ``src`` to stage ``dst``."""

    layer: int
    """Global layer index (0-based, in model order)."""
    src: int
    """Stage that holds the layer under the old partition."""
    dst: int
    """Stage that holds it under the new partition."""


def plan_moves(old_parts: Sequence[int], new_parts: Sequence[int]) -> list[Move]:
    """The layers whose stage differs between ``old_parts`` and ``new_parts``, by layer index.

    The two partitions must cover the same layers; they may have different stage counts (moving
    onto fewer or more stages is planned the same way). Runs in O(layers moved + stages): it
    walks the merged boundaries, within each piece of which the old and new stage are both constant.

    Example: ``plan_moves([0, 2, 4], [0, 3, 4]) == [Move(layer=2, src=1, dst=0)]``.
    """
    if len(old_parts) == 0 or len(new_parts) == 0:
        raise ValueError(f"partitions must not be empty: old={old_parts}, new={new_parts}")
    num_layers = int(old_parts[-1])
    if int(new_parts[-1]) != num_layers:
        raise ValueError(
            f"old_parts covers {num_layers} layers but new_parts covers {int(new_parts[-1])}; "
            "both must partition the same model"
        )
    old = check_parts(old_parts, num_layers, "old_parts")
    new = check_parts(new_parts, num_layers, "new_parts")
    moves: list[Move] = []
    i = j = 0  # stage index in old and new
    start = 0
    while start < num_layers:
        while old[i + 1] <= start:
            i += 1
        while new[j + 1] <= start:
            j += 1
        end = min(old[i + 1], new[j + 1])
        if i != j:
            moves.extend(Move(layer, i, j) for layer in range(start, end))
        start = end
    return moves
