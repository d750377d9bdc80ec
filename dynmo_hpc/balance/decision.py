"""The decision rule: enact a new partition only when it pays for its own migration.

Why: a better partition is not free. Moving a layer ships its weights, gradients and optimizer
state, and the pipeline waits for it. Rebalancing on every small gain (or moving a layer when the
pipeline is already balanced) can cost more than it saves. So the rule compares two
predictions over the coming interval, both in seconds:

- **gain** = ``(old bottleneck - new bottleneck) * steps_until_next_check``. A step's time is
  predicted by the heaviest stage (the pipeline's steady-state pace), using the costs measured
  now, on the assumption that they hold until the next check.
- **migration** = bytes through the busiest rank / bandwidth. Transfers between different pairs
  of ranks run concurrently and each rank's link is full duplex, so the transfer ends when the
  rank with the most to send (or to receive) is done: ``max over stages of max(bytes sent, bytes
  received)``. The total bytes are reported too, for a shared-link view.

The new partition is enacted iff ``gain > (1 + margin) * migration``; ``margin`` (a fraction,
e.g. 0.1 for 10 %) absorbs error in both predictions. Pure: no clock, no MPI; the caller supplies
the measured bandwidth.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynmo_hpc.balance.common import (
    CostsLike,
    check_parts,
    check_values,
    loads_from_prefix,
    prefix_sums,
)
from dynmo_hpc.balance.moves import plan_moves


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The one plan type: a candidate partition, what it is predicted to gain and cost, and
    whether to enact it, with the reason in words (:func:`should_rebalance` makes it; the
    trainer's rebalance step adds the algorithm that proposed the candidate)."""

    enact: bool
    """True: migrate to the new partition now."""
    old_parts: list[int] = field(default_factory=list)
    """The partition in force."""
    new_parts: list[int] = field(default_factory=list)
    """The candidate partition (equal to ``old_parts`` when nothing would change)."""
    algorithm: str = ""
    """What proposed the candidate: a balance algorithm, or ``forced`` (testing)."""
    predicted_gain_s: float
    """Seconds saved until the next check if the new partition is enacted (may be <= 0)."""
    predicted_migration_s: float
    """Seconds the migration is predicted to take (busiest rank's bytes / bandwidth)."""
    reason: str
    """One line saying why, with the numbers."""
    old_bottleneck_s: float = 0.0
    """Heaviest stage's load per step under the old partition."""
    new_bottleneck_s: float = 0.0
    """Heaviest stage's load per step under the new partition."""
    num_moves: int = 0
    """Layers that change stage."""
    bytes_moved: float = 0.0
    """Total bytes over all moves."""
    busiest_rank_bytes: float = 0.0
    """Bytes sent or received by the busiest rank: what the migration time is based on."""

    @property
    def parts_to_enact(self) -> list[int] | None:
        """The new partition if it is to be enacted, else None."""
        return list(self.new_parts) if self.enact else None

    def to_event(self) -> dict[str, Any]:
        """The decision as a run-log event detail (JSON-ready)."""
        return {
            "algorithm": self.algorithm,
            "old_parts": list(self.old_parts),
            "new_parts": list(self.new_parts),
            "enact": self.enact,
            "reason": self.reason,
            "predicted_gain_s": self.predicted_gain_s,
            "predicted_migration_s": self.predicted_migration_s,
            "old_bottleneck_s": self.old_bottleneck_s,
            "new_bottleneck_s": self.new_bottleneck_s,
            "num_moves": self.num_moves,
            "bytes_moved": self.bytes_moved,
        }


def _bytes_of_layers(bytes_per_layer: float | CostsLike, num_layers: int) -> list[float]:
    if isinstance(bytes_per_layer, int | float):
        if not math.isfinite(bytes_per_layer) or bytes_per_layer < 0:
            raise ValueError(f"bytes_per_layer={bytes_per_layer!r} must be finite and >= 0")
        return [float(bytes_per_layer)] * num_layers
    values = check_values(bytes_per_layer, "bytes_per_layer")
    if len(values) != num_layers:
        raise ValueError(
            f"bytes_per_layer has {len(values)} entries but costs has {num_layers}; "
            "pass one per layer or a single number"
        )
    return values


def should_rebalance(
    costs: CostsLike,
    old_parts: Sequence[int],
    new_parts: Sequence[int],
    bytes_per_layer: float | CostsLike,
    bandwidth_bytes_per_s: float,
    steps_until_next_check: int,
    margin: float = 0.1,
) -> Decision:
    """Whether moving from ``old_parts`` to ``new_parts`` pays off before the next check.

    Args:
        costs: measured seconds per layer per step.
        old_parts, new_parts: the partition in use and the candidate (same layers; the stage
            count may differ, e.g. after packing).
        bytes_per_layer: bytes that travel with a layer (weights + gradients + optimizer
            state), one number for all layers or one per layer.
        bandwidth_bytes_per_s: measured point-to-point bandwidth between ranks.
        steps_until_next_check: training steps over which the gain accrues.
        margin: required relative excess of gain over migration (0.1: 10 %).

    Example: 1 s/step saved over 100 steps versus 2 GB over 10 GB/s (0.2 s): enact.
    """
    values = check_values(costs)
    num_layers = len(values)
    old = check_parts(old_parts, num_layers, "old_parts")
    new = check_parts(new_parts, num_layers, "new_parts")
    if not (math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be finite and > 0")
    steps = steps_until_next_check
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"steps_until_next_check={steps_until_next_check!r} must be an int >= 0")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin={margin!r} must be a finite fraction >= 0 (0.1 means 10 %)")
    layer_bytes = _bytes_of_layers(bytes_per_layer, num_layers)

    prefix = prefix_sums(values)
    old_s = max(loads_from_prefix(prefix, old))
    new_s = max(loads_from_prefix(prefix, new))
    moves = plan_moves(old, new)
    num_ranks = max(len(old), len(new)) - 1
    sent = [0.0] * num_ranks
    received = [0.0] * num_ranks
    for move in moves:
        sent[move.src] += layer_bytes[move.layer]
        received[move.dst] += layer_bytes[move.layer]
    busiest = max(max(sent), max(received))
    gain_s = (old_s - new_s) * steps_until_next_check
    migration_s = busiest / bandwidth_bytes_per_s
    needed_s = (1.0 + margin) * migration_s

    if not moves:
        enact, reason = False, "no change: the new partition equals the old one"
    elif new_s >= old_s:
        enact = False
        reason = f"no gain: new bottleneck {new_s:.6g} s/step >= old {old_s:.6g} s/step"
    elif gain_s > needed_s:
        enact = True
        reason = (
            f"enact: gain {gain_s:.6g} s over {steps_until_next_check} steps > "
            f"(1 + margin {margin:g}) * migration {migration_s:.6g} s = {needed_s:.6g} s"
        )
    else:
        enact = False
        reason = (
            f"keep: gain {gain_s:.6g} s over {steps_until_next_check} steps <= "
            f"(1 + margin {margin:g}) * migration {migration_s:.6g} s = {needed_s:.6g} s"
        )
    return Decision(
        enact=enact,
        old_parts=list(old),
        new_parts=list(new),
        predicted_gain_s=gain_s,
        predicted_migration_s=migration_s,
        reason=reason,
        old_bottleneck_s=old_s,
        new_bottleneck_s=new_s,
        num_moves=len(moves),
        bytes_moved=sum(layer_bytes[m.layer] for m in moves),
        busiest_rank_bytes=busiest,
    )
