"""Rank 0's balancing decision at a load report: costs in, (maybe) a new partition out.

Pure glue between the measured state (smoothed per-layer costs, bytes per layer, the partition in
force, measured bandwidth) and the pure balancer in :mod:`dynmo_hpc.balance`. No MPI here: the
trainer gathers the inputs and broadcasts the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynmo_hpc.balance import (
    Decision,
    diffusion_trace,
    partition,
    should_follow,
    should_rebalance,
    stage_loads,
)
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


def hop_steps(interval: int, steps_left: int) -> list[int]:
    """Steps each partition enacted at this and the following decisions would run: one check
    interval each, the last cut short by the end of training (empty when no step is left)."""
    return [min(interval, steps_left - k) for k in range(0, max(0, steps_left), interval)]


def _keep(parts: list[int], algorithm: str, reason: str) -> Decision:
    return Decision(
        enact=False,
        old_parts=list(parts),
        new_parts=list(parts),
        algorithm=algorithm,
        predicted_gain_s=0.0,
        predicted_migration_s=0.0,
        reason=reason,
    )


def _diffusion(
    balance: BalanceSection,
    costs_s: list[float],
    layer_bytes: list[int],
    parts: list[int],
    bandwidth_bytes_per_s: float,
    report_index: int,
    steps: list[int],
) -> Decision:
    """One diffusion phase, judged as the first hop of the path to diffusion's fixed point.

    The parity alternates with the report index (each trace round starts with it, and skips a
    phase that moves nothing), so successive decisions walk exactly this path, one phase at a
    time: every layer moves at most one stage per migration.
    """
    memory: dict[str, Any] = {}
    if balance.capacity_bytes is not None:
        memory = {"memory": layer_bytes, "capacity": balance.capacity_bytes}
        loads = stage_loads(layer_bytes, parts)
        stage = max(range(len(loads)), key=loads.__getitem__)
        if loads[stage] > balance.capacity_bytes:
            return _keep(
                parts,
                "diffusion",
                f"stage {stage} holds {loads[stage]:.6g} bytes > balance.capacity_bytes="
                f"{balance.capacity_bytes:.6g}: diffusion never breaks the capacity, nor repairs "
                "it (balance.algorithm=optimal does)",
            )
    path = diffusion_trace(
        costs_s, len(parts) - 1, current=parts, first_phase=report_index % 2, **memory
    )
    return should_follow(
        costs_s,
        path,
        bytes_per_layer=layer_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        steps_per_hop=steps,
        margin=balance.margin,
    )


def decide(
    balance: BalanceSection,
    *,
    costs_s: list[float],
    num_params: list[int],
    layer_bytes: list[int],
    parts: list[int],
    bandwidth_bytes_per_s: float,
    report_index: int,
    steps_left: int,
) -> Decision:
    """Plan a new partition with ``balance.algorithm`` and enact it only if it pays.

    ``steps_left``: training steps after this report. The new partition runs until the next
    decision or the end of training, whichever is first, so that is what its gain is counted
    over (none left: nothing can pay). ``Decision.parts_to_enact`` is the partition to migrate
    to, or None to keep ``parts``.
    """
    num_stages = len(parts) - 1
    if balance.algorithm == "static" or num_stages == 1:
        return _keep(
            parts,
            balance.algorithm,
            "balance.algorithm=static"
            if balance.algorithm == "static"
            else "one stage: nothing to rebalance",
        )
    steps = hop_steps(balance.interval, steps_left)
    if not steps:
        return _keep(parts, balance.algorithm, "no steps left: a migration could not pay back")
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
    if balance.algorithm == "diffusion":
        decision = _diffusion(
            balance, costs_s, layer_bytes, parts, bandwidth_bytes_per_s, report_index, steps
        )
        return dataclasses.replace(decision, algorithm=balance.algorithm)
    options: dict[str, Any] = {}
    if balance.algorithm == "optimal":
        options["current"] = parts
        if balance.capacity_bytes is not None:
            options["memory"] = layer_bytes
            options["capacity"] = balance.capacity_bytes
    if balance.algorithm == "parameters":
        options["params"] = num_params
    candidate = partition(costs_s, num_stages, balance.algorithm, **options)
    decision = should_rebalance(
        costs_s,
        parts,
        candidate,
        bytes_per_layer=layer_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        steps_until_next_check=steps[0],
        margin=balance.margin,
    )
    return dataclasses.replace(decision, algorithm=balance.algorithm)
