"""Rank 0's balancing decision at a load report: costs in, (maybe) a new partition out.

Pure glue between the measured state (smoothed per-layer costs, bytes per layer, the partition in
force, measured bandwidth) and the pure balancer in :mod:`dynmo_hpc.balance`. No MPI here: the
trainer gathers the inputs and broadcasts the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynmo_hpc.balance import Decision, partition, should_rebalance
from dynmo_hpc.config import BalanceSection


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
) -> Decision:
    """Plan a new partition with ``balance.algorithm`` and enact it only if it pays.

    ``Decision.parts_to_enact`` is the partition to migrate to, or None to keep ``parts``.
    """
    num_stages = len(parts) - 1
    if balance.algorithm == "static" or num_stages == 1:
        return Decision(
            enact=False,
            old_parts=list(parts),
            new_parts=list(parts),
            algorithm=balance.algorithm,
            predicted_gain_s=0.0,
            predicted_migration_s=0.0,
            reason="balance.algorithm=static"
            if balance.algorithm == "static"
            else "one stage: nothing to rebalance",
        )
    if balance.force_moves:
        new = forced_partition(parts, report_index)
        return Decision(
            enact=new != parts,
            old_parts=list(parts),
            new_parts=new,
            algorithm="forced",
            predicted_gain_s=0.0,
            predicted_migration_s=0.0,
            reason="balance.force_moves=true",
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
    return dataclasses.replace(decision, algorithm=balance.algorithm)
