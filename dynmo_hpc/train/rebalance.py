"""Rank 0's balancing decision at a load report: costs in, (maybe) a new partition out.

Pure glue between the measured state (smoothed per-layer costs, bytes per layer, the partition in
force, measured bandwidth) and the pure balancer in :mod:`dynmo_hpc.balance`. No MPI here: the
trainer gathers the inputs and broadcasts the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from dynmo_hpc.balance import (
    ALGORITHMS,
    STATIC,
    BalanceState,
    Decision,
    Proposal,
    propose,
    should_follow,
    should_rebalance,
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


class LayerReport(Protocol):
    """What the decision reads from a load report: a
    :class:`~dynmo_hpc.pipeline.costs.LoadReport` (the trainer) or a
    :class:`~dynmo_hpc.sim.replay.CostReport` (the simulator)."""

    @property
    def num_params(self) -> list[int]: ...

    @property
    def layer_bytes(self) -> list[int]:
        """Per layer: bytes that migration moves (weights, gradients, optimizer state)."""
        ...


def _forced(parts: list[int], report_index: int) -> Decision:
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


def _judge(
    balance: BalanceSection,
    costs_s: list[float],
    report: LayerReport,
    proposal: Proposal,
    bandwidth_bytes_per_s: float,
    steps: list[int],
) -> Decision:
    """The decision rule on an algorithm's proposal: a path (``propose_path``) is judged hop by
    hop with :func:`should_follow`, a whole partition with :func:`should_rebalance`."""
    if ALGORITHMS[balance.algorithm].propose_path is not None:
        return should_follow(
            costs_s,
            proposal.path,
            layer_bytes=report.layer_bytes,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            steps_per_hop=steps,
            margin=balance.margin,
        )
    old, candidate = proposal.path[0], proposal.path[-1]
    return should_rebalance(
        costs_s,
        old,
        candidate,
        layer_bytes=report.layer_bytes,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        steps_until_next_check=steps[0],
        margin=balance.margin,
    )


def decide(
    balance: BalanceSection,
    report: LayerReport,
    *,
    costs_s: list[float],
    parts: list[int],
    bandwidth_bytes_per_s: float,
    report_index: int,
    steps_left: int,
) -> Decision:
    """Plan a new partition with ``balance.algorithm`` and enact it only if it pays.

    ``report``: the load report (parameter counts and bytes per layer); ``costs_s``: its costs
    smoothed over the reports so far (:class:`~dynmo_hpc.pipeline.costs.CostTracker`), what the
    algorithm balances. ``steps_left``: training steps after this report. The new partition runs
    until the next decision or the end of training, whichever is first, so that is what its gain
    is counted over (none left: nothing can pay). ``Decision.parts_to_enact`` is the partition
    to migrate to, or None to keep ``parts``. What the algorithm is told and how its proposal is
    judged come from its :data:`~dynmo_hpc.balance.ALGORITHMS` entry.
    """
    algorithm = balance.algorithm
    if algorithm == STATIC:
        return _keep(parts, algorithm, f"balance.algorithm={STATIC}")
    if len(parts) - 1 == 1:
        return _keep(parts, algorithm, "one stage: nothing to rebalance")
    steps = hop_steps(balance.interval, steps_left)
    if not steps:
        return _keep(parts, algorithm, "no steps left: a migration could not pay back")
    if balance.force_moves:
        return _forced(parts, report_index)
    state = BalanceState(
        parts=list(parts),
        num_params=report.num_params,
        layer_bytes=report.layer_bytes,
        capacity_bytes=balance.capacity_bytes,
        report_index=report_index,
    )
    proposal = propose(algorithm, costs_s, state)
    if not proposal.path:
        return _keep(parts, algorithm, proposal.keep_reason)
    decision = _judge(balance, costs_s, report, proposal, bandwidth_bytes_per_s, steps)
    return dataclasses.replace(decision, algorithm=algorithm)
