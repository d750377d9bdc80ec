"""The decision rule: enact a new partition only when it pays for its own migration.

Why: a better partition is not free. Moving a layer ships its weights, gradients and optimizer
state, and the pipeline waits for it. Rebalancing on every small gain (or moving a layer when the
pipeline is already balanced) can cost more than it saves. So the rule compares two
predictions over the coming interval, both in seconds:

- **gain** = ``(old bottleneck - new bottleneck) * steps_until_next_check``. A step's time is
  predicted by the heaviest stage (the pipeline's steady-state pace), using the costs measured
  now, on the assumption that they hold until the next check. The caller counts the steps the
  new partition will really run: until the next check or the end of training, whichever is
  first.
- **migration** = bytes through the busiest rank / bandwidth, where a rank's bytes are what it
  sends *plus* what it receives: ``max over stages of (bytes sent + bytes received)``. This is
  how :func:`dynmo_hpc.pipeline.migration.move.migrate` runs: every move is posted at once, so moves
  between different pairs of ranks proceed concurrently, but on each rank one thread drives MPI
  progress for all of its transfers and hashes every chunk it sends and every chunk it receives
  (:mod:`dynmo_hpc.pipeline.migration.wire`), so a rank's own sends and receives share that
  time instead of overlapping. ``bandwidth_bytes_per_s`` is the rate of one transfer between two
  ranks (:func:`~dynmo_hpc.pipeline.migration.move.measure_bandwidth`, then what the last
  migration achieved in these units), so a single move of ``b`` bytes is priced ``b / bandwidth``.

The new partition is enacted iff ``gain > (1 + margin) * migration``; ``margin`` (a fraction,
e.g. 0.1 for 10 %) absorbs error in both predictions. :func:`should_follow` extends the rule to a
path of partitions taken one hop per check (diffusion's phases). Pure: no clock, no MPI; the
caller supplies the measured bandwidth.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynmo_hpc.balance.common import (
    CostsLike,
    check_parts,
    check_values,
    loads_from_prefix,
    prefix_sums,
)
from dynmo_hpc.balance.moves import Move, plan_moves


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
    """Seconds saved until the next check if the new partition is enacted (may be <= 0); for a
    path (:func:`should_follow`), saved over the ``judged_hops`` checks it takes."""
    predicted_migration_s: float
    """Seconds this migration is predicted to take (busiest rank's bytes / bandwidth)."""
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
    """Bytes sent plus bytes received by the busiest rank: what the migration time is based on."""
    judged_hops: int = 1
    """Partitions of the path the gain was judged over (1: this one alone)."""
    judged_migration_s: float = 0.0
    """Predicted migration seconds of all ``judged_hops`` hops (this one's alone for 1 hop)."""

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
            "busiest_rank_bytes": self.busiest_rank_bytes,
            "judged_hops": self.judged_hops,
            "judged_migration_s": self.judged_migration_s,
        }


def _bytes_of_layers(layer_bytes: float | CostsLike, num_layers: int) -> list[float]:
    if isinstance(layer_bytes, int | float):
        if not math.isfinite(layer_bytes) or layer_bytes < 0:
            raise ValueError(f"layer_bytes={layer_bytes!r} must be finite and >= 0")
        return [float(layer_bytes)] * num_layers
    values = check_values(layer_bytes, "layer_bytes")
    if len(values) != num_layers:
        raise ValueError(
            f"layer_bytes has {len(values)} entries but costs has {num_layers}; "
            "pass one per layer or a single number"
        )
    return values


def rank_bytes(moves: Sequence[Move], layer_bytes: Sequence[float], num_ranks: int) -> list[float]:
    """Per rank, the bytes it sends plus the bytes it receives in one migration of ``moves``.

    Why the sum, not the larger of the two: a rank's sends and receives share its one MPI
    progress loop, which also hashes what it sends and what it receives (see the module
    docstring).
    """
    traffic = [0.0] * num_ranks
    for move in moves:
        traffic[move.src] += layer_bytes[move.layer]
        traffic[move.dst] += layer_bytes[move.layer]
    return traffic


def should_rebalance(
    costs: CostsLike,
    old_parts: Sequence[int],
    new_parts: Sequence[int],
    layer_bytes: float | CostsLike,
    bandwidth_bytes_per_s: float,
    steps_until_next_check: int,
    margin: float = 0.1,
) -> Decision:
    """Whether moving from ``old_parts`` to ``new_parts`` pays off before the next check.

    Args:
        costs: measured seconds per layer per step.
        old_parts, new_parts: the partition in use and the candidate (same layers; the stage
            count may differ, e.g. after packing).
        layer_bytes: bytes that travel with a layer (weights + gradients + optimizer
            state), one number for all layers or one per layer.
        bandwidth_bytes_per_s: measured rate of one transfer between two ranks.
        steps_until_next_check: training steps over which the gain accrues.
        margin: required relative excess of gain over migration (0.1: 10 %).

    Example: 1 s/step saved over 100 steps versus 2 GB over 10 GB/s (0.2 s): enact. Two moves
    between disjoint pairs of ranks cost one move's time; a rank that sends one layer and
    receives another costs two.
    """
    values = check_values(costs)
    old = check_parts(old_parts, len(values), "old_parts")
    new = check_parts(new_parts, len(values), "new_parts")
    _check_rule(bandwidth_bytes_per_s, steps_until_next_check, margin)
    per_layer = _bytes_of_layers(layer_bytes, len(values))

    prefix = prefix_sums(values)
    old_s = max(loads_from_prefix(prefix, old))
    new_s = max(loads_from_prefix(prefix, new))
    moves = plan_moves(old, new)
    busiest = max(rank_bytes(moves, per_layer, max(len(old), len(new)) - 1))
    gain_s = (old_s - new_s) * steps_until_next_check
    migration_s = busiest / bandwidth_bytes_per_s
    enact, reason = _verdict(
        bool(moves), old_s, new_s, gain_s, migration_s, steps_until_next_check, margin
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
        bytes_moved=sum(per_layer[m.layer] for m in moves),
        busiest_rank_bytes=busiest,
        judged_migration_s=migration_s,
    )


def _check_rule(bandwidth_bytes_per_s: float, steps: int, margin: float) -> None:
    """ValueError unless the bandwidth is finite and > 0, the steps an int >= 0 and the margin a
    finite fraction >= 0."""
    if not (math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be finite and > 0")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"steps_until_next_check={steps!r} must be an int >= 0")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin={margin!r} must be a finite fraction >= 0 (0.1 means 10 %)")


def _verdict(
    moves: bool,
    old_s: float,
    new_s: float,
    gain_s: float,
    migration_s: float,
    steps: int,
    margin: float,
) -> tuple[bool, str]:
    """Enact iff something moves, the bottleneck drops and the gain beats the migration with
    the margin; the reason in words, with the numbers."""
    needed_s = (1.0 + margin) * migration_s
    if not moves:
        return False, "no change: the new partition equals the old one"
    if new_s >= old_s:
        return False, f"no gain: new bottleneck {new_s:.6g} s/step >= old {old_s:.6g} s/step"
    if gain_s > needed_s:
        return True, (
            f"enact: gain {gain_s:.6g} s over {steps} steps > "
            f"(1 + margin {margin:g}) * migration {migration_s:.6g} s = {needed_s:.6g} s"
        )
    return False, (
        f"keep: gain {gain_s:.6g} s over {steps} steps <= "
        f"(1 + margin {margin:g}) * migration {migration_s:.6g} s = {needed_s:.6g} s"
    )


def should_follow(
    costs: CostsLike,
    path: Sequence[Sequence[int]],
    layer_bytes: float | CostsLike,
    bandwidth_bytes_per_s: float,
    steps_per_hop: Sequence[int],
    margin: float = 0.1,
) -> Decision:
    """Whether to take the first hop of ``path``, a walk of partitions taken one hop per check.

    Why: a local balancer (diffusion) reaches its fixed point in phases, one per decision, and a
    phase can be a necessary step that gains nothing alone: with loads ``(3, 1, 3)``, relieving
    stage 0 leaves stage 2 at the old pace, and the next phase, relieving stage 2, is what
    lowers the bottleneck. Judging each hop by itself would stop there for good. So the first
    hop is enacted iff some prefix of the path pays for itself: for ``k`` hops, the gain
    ``sum over j < k of (B_0 - B_{j+1}) * steps_per_hop[j]`` (``B_j`` the bottleneck of
    ``path[j]``, held for ``steps_per_hop[j]`` steps once enacted) exceeds ``(1 + margin)`` times
    the ``k`` hops' migrations. The prefix with the largest margin over its migration is the one
    reported. With one hop this is exactly :func:`should_rebalance`. Costs are assumed to hold
    along the path; each later decision judges the rest of the path afresh.

    Args:
        path: ``path[0]`` is the partition in force, each next one a hop (at least one entry).
        steps_per_hop: steps ``path[j + 1]`` would run; hops beyond its length are not judged.
        Others: as for :func:`should_rebalance`.
    """
    if not path:
        raise ValueError("path is empty; it must start with the partition in force")
    for count in steps_per_hop:
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"steps_per_hop={list(steps_per_hop)!r} must hold ints >= 0")
    hops = min(len(path) - 1, len(steps_per_hop))
    first = should_rebalance(
        costs,
        path[0],
        path[min(1, hops)],
        layer_bytes,
        bandwidth_bytes_per_s,
        steps_per_hop[0] if hops else 0,
        margin,
    )
    if hops <= 1 or first.enact or first.num_moves == 0:
        return first
    prefixes = _prefix_totals(
        costs, path, first, layer_bytes, bandwidth_bytes_per_s, steps_per_hop, margin, hops
    )
    # The best prefix by net gain; on a tie the shorter one (less of the future assumed).
    k = max(range(hops), key=lambda i: (prefixes[i][0] - (1.0 + margin) * prefixes[i][1], -i)) + 1
    gain_s, migration_s = prefixes[k - 1]
    enact = gain_s > (1.0 + margin) * migration_s
    reason = _path_reason(prefixes, k, sum(steps_per_hop[:k]), first.old_bottleneck_s, margin)
    return replace(
        first,
        enact=enact,
        predicted_gain_s=gain_s,
        reason=reason,
        judged_hops=k,
        judged_migration_s=migration_s,
    )


def _prefix_totals(
    costs: CostsLike,
    path: Sequence[Sequence[int]],
    first: Decision,
    layer_bytes: float | CostsLike,
    bandwidth_bytes_per_s: float,
    steps_per_hop: Sequence[int],
    margin: float,
    hops: int,
) -> list[tuple[float, float]]:
    """For each prefix of ``hops`` hops, its total gain (against the partition in force) and
    its total migration seconds, in seconds."""
    old_s = first.old_bottleneck_s
    gain_s, migration_s = first.predicted_gain_s, first.predicted_migration_s
    prefixes = [(gain_s, migration_s)]
    for j in range(1, hops):
        hop = should_rebalance(
            costs, path[j], path[j + 1], layer_bytes, bandwidth_bytes_per_s, 0, margin
        )
        gain_s += (old_s - hop.new_bottleneck_s) * steps_per_hop[j]
        migration_s += hop.predicted_migration_s
        prefixes.append((gain_s, migration_s))
    return prefixes


def _path_reason(
    prefixes: list[tuple[float, float]], k: int, steps: int, old_s: float, margin: float
) -> str:
    """Why the path's first hop is enacted or kept, judged by its best prefix of ``k`` hops."""
    gain_s, migration_s = prefixes[k - 1]
    needed_s = (1.0 + margin) * migration_s
    if gain_s > needed_s:
        return (
            f"enact: hop 1 of {k}: gain {gain_s:.6g} s over {steps} steps > (1 + margin "
            f"{margin:g}) * migration {migration_s:.6g} s over {k} hops = {needed_s:.6g} s"
        )
    if max(gain for gain, _ in prefixes) <= 0:
        hops = len(prefixes)
        return f"no gain: none of {hops} hops lowers the bottleneck below {old_s:.6g} s/step"
    return (
        f"keep: best gain {gain_s:.6g} s over {k} hops and {steps} steps <= (1 + margin "
        f"{margin:g}) * migration {migration_s:.6g} s = {needed_s:.6g} s"
    )
