"""Rank 0's balancing decision at a load report: costs in, (maybe) a new partition out.

Pure glue between the measured state (smoothed per-layer costs, bytes per layer, the partition in
force, measured bandwidth) and the pure balancer in :mod:`dynmo_hpc.balance`. No MPI here: the
trainer gathers the inputs and broadcasts the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .balance import partition, should_rebalance
from .config import BalanceSection


@dataclass(frozen=True)
class RebalancePlan:
    """The outcome of one decision; ``new_parts`` is None when nothing should move."""

    new_parts: list[int] | None
    detail: dict[str, Any] = field(default_factory=dict)


def forced_partition(parts: list[int], report_index: int) -> list[int]:
    """A different valid partition (testing migration): move one interior boundary by one.

    Cycles through the boundaries and alternates direction, so repeated calls exercise moves in
    both directions between every pair of neighbouring stages.
    """
    num_stages = len(parts) - 1
    if num_stages < 2:
        return list(parts)
    for attempt in range(2 * (num_stages - 1)):
        k = (report_index + attempt) % (num_stages - 1) + 1
        step = 1 if (report_index // (num_stages - 1) + attempt) % 2 == 0 else -1
        for delta in (step, -step):
            candidate = list(parts)
            candidate[k] += delta
            if candidate[k - 1] < candidate[k] < candidate[k + 1]:
                return candidate
    return list(parts)


def decide(
    balance: BalanceSection,
    *,
    costs_s: list[float],
    num_params: list[int],
    layer_bytes: list[int],
    parts: list[int],
    bandwidth_bytes_per_s: float,
    report_index: int,
) -> RebalancePlan:
    """Plan a new partition with ``balance.algorithm`` and keep it only if it pays."""
    if balance.algorithm == "static":
        return RebalancePlan(None, {"reason": "balance.algorithm=static"})
    num_stages = len(parts) - 1
    if balance.force_moves:
        new = forced_partition(parts, report_index)
        return RebalancePlan(
            new if new != parts else None,
            {"algorithm": "forced", "reason": "balance.force_moves=true", "new_parts": new},
        )
    options: dict[str, Any] = {}
    if balance.algorithm in ("optimal", "diffusion"):
        options["current"] = parts
    if balance.algorithm == "parameters":
        options["params"] = num_params
    if balance.algorithm == "optimal" and balance.capacity_bytes is not None:
        options["memory"] = layer_bytes
        options["capacity"] = balance.capacity_bytes
    candidate = partition(costs_s, num_stages, balance.algorithm, **options)
    decision = should_rebalance(
        costs_s,
        parts,
        candidate,
        bytes_per_layer=layer_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        steps_until_next_check=balance.interval,
        margin=balance.margin,
    )
    detail = {
        "algorithm": balance.algorithm,
        "old_parts": parts,
        "new_parts": candidate,
        "enact": decision.enact,
        "reason": decision.reason,
        "predicted_gain_s": decision.predicted_gain_s,
        "predicted_migration_s": decision.predicted_migration_s,
        "old_bottleneck_s": decision.old_bottleneck_s,
        "new_bottleneck_s": decision.new_bottleneck_s,
        "bytes_to_move": decision.bytes_moved,
    }
    return RebalancePlan(candidate if decision.enact else None, detail)
