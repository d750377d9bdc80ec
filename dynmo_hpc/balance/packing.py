"""The packing decision: run the same model on fewer stages when that costs (almost) no
throughput, and hand the freed nodes back.

Why a model of step time and not just the bottleneck: with fewer stages the pipeline's
fill-and-drain bubble shrinks, so a smaller pipeline can be as fast as a larger one whose
heaviest stage is a layer that no partition can split. A 1F1B (or GPipe) step of ``M``
microbatches on ``P`` stages takes about

    step_s = (M + P - 1) * (max stage load / M + 2 * comm_s)        (comm_s = 0 when P = 1)

where a stage's load is the sum of its layers' measured cost per step, and ``comm_s`` is one
activation (forward) or gradient (backward) message per microbatch. Where the ranks share fewer
CPU cores than there are stages (``num_cpu_slots``; local runs on a small machine), the step
cannot be shorter than ``total load / min(P, num_cpu_slots)`` either: the cores, not the
stages, are then the limit. The prediction for the partition in force is compared with the
measured step time, and that ratio calibrates every candidate (``calibration``), so modelling
error common to all stage counts cancels.

Every smaller stage count is tried with its optimal partition (``balance.optimal`` under the
memory capacity). A candidate must

- release at least one whole node (``ranks_per_node`` ranks each; locally every rank is its
  own "node", i.e. ``ranks_per_node = 1``), never part of one;
- fit every stage in memory (per-layer bytes against ``capacity_bytes``);
- not go below ``min_stages``.

The policy picks among them:

- ``throughput``: the fewest nodes whose predicted tokens/s is at least ``1 - max_slowdown``
  of the current prediction; among those, the fastest ("consolidate without sacrificing
  throughput");
- ``node_hours``: the best predicted tokens per node-hour, if better than the current.

Then it pays only if the node-seconds saved over the steps left beat the restart overhead
(checkpoint, step exit, shrink, relaunch, restore), paid while holding the current nodes:

    steps_left * (nodes_now * step_now - nodes_new * step_new) > restart_overhead_s * nodes_now

Pure: no clock, no MPI; the caller supplies measurements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dynmo_hpc.balance.common import CostsLike, check_parts, check_values, stage_loads
from dynmo_hpc.balance.optimal import optimal

PackPolicy = Literal["throughput", "node_hours"]
PACK_POLICIES: tuple[str, ...] = ("throughput", "node_hours")


def predict_step_time_s(
    costs_s: CostsLike,
    parts: Sequence[int],
    num_microbatches: int,
    *,
    comm_s: float = 0.0,
    num_cpu_slots: int | None = None,
) -> float:
    """Predicted seconds per step of ``parts`` (see the module docstring for the model).

    Example: 4 layers of 1 s on 2 stages, 4 microbatches, no communication:
    ``(4 + 2 - 1) * (2 / 4) == 2.5``.
    """
    values = check_values(costs_s)
    checked = check_parts(parts, len(values))
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    num_stages = len(checked) - 1
    slots = (M := num_microbatches) + num_stages - 1
    per_microbatch_s = max(stage_loads(values, checked)) / M
    if num_stages > 1:
        per_microbatch_s += 2.0 * comm_s
    step_s = slots * per_microbatch_s
    if num_cpu_slots is not None:
        step_s = max(step_s, sum(values) / min(num_stages, max(1, num_cpu_slots)))
    return step_s


def nodes_for(num_stages: int, ranks_per_node: int) -> int:
    """Nodes a job of ``num_stages`` ranks holds at ``ranks_per_node`` ranks per node."""
    return -(-num_stages // ranks_per_node)


@dataclass(frozen=True, kw_only=True)
class PackCandidate:
    """One stage count: its best partition and what it is predicted to do."""

    num_stages: int
    num_nodes: int
    parts: list[int] = field(default_factory=list)
    """Its optimal partition (empty when nothing fits in memory)."""
    fits_memory: bool
    step_time_s: float
    """Predicted seconds per step, calibrated against the measured current step."""
    tokens_per_s: float
    tokens_per_node_hour: float


@dataclass(frozen=True, kw_only=True)
class PackPlan:
    """What the packing decision concluded, with the numbers behind it."""

    pack: bool
    """True: checkpoint, shrink to ``chosen`` and resume."""
    policy: str
    current: PackCandidate
    chosen: PackCandidate
    """The candidate to pack onto (``current`` when ``pack`` is False)."""
    candidates: list[PackCandidate]
    """Every smaller stage count that would release a node, best partition each."""
    calibration: float
    """Measured / predicted step time of the partition in force (1.0 when not measured)."""
    saving_node_s: float
    """Node-seconds saved over the steps left by ``chosen`` (0 when it is ``current``)."""
    overhead_node_s: float
    """Node-seconds the resize costs: restart overhead x nodes held now."""
    reason: str

    def to_event(self) -> dict[str, Any]:
        """The run-log detail of a ``pack`` event."""
        return {
            "pack": self.pack,
            "policy": self.policy,
            "from_stages": self.current.num_stages,
            "to_stages": self.chosen.num_stages,
            "from_nodes": self.current.num_nodes,
            "to_nodes": self.chosen.num_nodes,
            "parts": self.chosen.parts,
            "predicted_tokens_per_s_before": self.current.tokens_per_s,
            "predicted_tokens_per_s_after": self.chosen.tokens_per_s,
            "calibration": self.calibration,
            "saving_node_s": self.saving_node_s,
            "overhead_node_s": self.overhead_node_s,
            "candidates": [asdict(c) for c in self.candidates],
            "reason": self.reason,
        }


def plan_pack(
    costs_s: CostsLike,
    parts: Sequence[int],
    *,
    num_microbatches: int,
    tokens_per_step: float,
    ranks_per_node: int,
    steps_left: int,
    restart_overhead_s: float,
    policy: str = "throughput",
    max_slowdown: float = 0.1,
    min_stages: int = 1,
    memory_bytes: CostsLike | None = None,
    capacity_bytes: float | None = None,
    comm_s: float = 0.0,
    num_cpu_slots: int | None = None,
    measured_step_s: float | None = None,
) -> PackPlan:
    """Whether to pack ``parts`` onto fewer stages (see the module docstring).

    Args:
        costs_s: smoothed seconds per layer per step.
        parts: the partition in force.
        num_microbatches, tokens_per_step: the step's shape.
        ranks_per_node: ranks the allocation places on a node (1 locally).
        steps_left: training steps after this decision.
        restart_overhead_s: measured (or estimated) seconds a resize stops training.
        policy, max_slowdown, min_stages: ``elastic.*``.
        memory_bytes, capacity_bytes: per-layer bytes and the per-stage capacity (both or none).
        comm_s: seconds per activation or gradient message between stages.
        num_cpu_slots: CPU cores the ranks share when fewer than the stages (None: one each).
        measured_step_s: the measured step time now, to calibrate the model.

    Example: one heavy layer sets the pace; 3 stages are as fast as 4 and free a node::

        plan_pack([1, 1, 1, 6, 1, 1, 1], [0, 2, 3, 4, 7], num_microbatches=8,
                  tokens_per_step=1000, ranks_per_node=1, steps_left=100,
                  restart_overhead_s=5).chosen.num_stages == 3
    """
    values = check_values(costs_s)
    current_parts = check_parts(parts, len(values))
    num_stages = len(current_parts) - 1
    if policy not in PACK_POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {', '.join(PACK_POLICIES)}")
    if ranks_per_node < 1 or min_stages < 1 or steps_left < 0:
        raise ValueError(
            f"ranks_per_node={ranks_per_node}, min_stages={min_stages} must be >= 1 and "
            f"steps_left={steps_left} >= 0"
        )
    if not (math.isfinite(max_slowdown) and 0 <= max_slowdown < 1):
        raise ValueError(f"max_slowdown={max_slowdown!r} must be in [0, 1)")
    if not (math.isfinite(restart_overhead_s) and restart_overhead_s >= 0):
        raise ValueError(f"restart_overhead_s={restart_overhead_s!r} must be finite and >= 0")

    def predict(candidate_parts: list[int]) -> float:
        return predict_step_time_s(
            values, candidate_parts, num_microbatches, comm_s=comm_s, num_cpu_slots=num_cpu_slots
        )

    model_now_s = predict(current_parts)
    calibration = 1.0
    if measured_step_s is not None and measured_step_s > 0 and model_now_s > 0:
        calibration = measured_step_s / model_now_s

    def candidate(n: int, candidate_parts: list[int], fits: bool) -> PackCandidate:
        nodes = nodes_for(n, ranks_per_node)
        step_s = predict(candidate_parts) * calibration if fits else math.inf
        tps = tokens_per_step / step_s if fits and step_s > 0 else 0.0
        return PackCandidate(
            num_stages=n,
            num_nodes=nodes,
            parts=candidate_parts if fits else [],
            fits_memory=fits,
            step_time_s=step_s,
            tokens_per_s=tps,
            tokens_per_node_hour=tps * 3600.0 / nodes,
        )

    current = candidate(num_stages, current_parts, True)
    candidates = []
    for n in range(num_stages - 1, max(min_stages, 1) - 1, -1):
        if nodes_for(n, ranks_per_node) >= current.num_nodes or n > len(values):
            continue
        try:
            best_parts = optimal(values, n, memory=memory_bytes, capacity=capacity_bytes)
        except ValueError:  # the model does not fit in memory on n stages
            candidates.append(candidate(n, list(current_parts), False))
            continue
        candidates.append(candidate(n, best_parts, True))
    fitting = [c for c in candidates if c.fits_memory]

    def plan(chosen: PackCandidate, reason: str) -> PackPlan:
        saving_s = 0.0
        if chosen is not current:
            saving_s = steps_left * (
                current.num_nodes * current.step_time_s - chosen.num_nodes * chosen.step_time_s
            )
        overhead_s = restart_overhead_s * current.num_nodes
        pack = chosen is not current and saving_s > overhead_s
        if chosen is not current and not pack:
            reason = (
                f"keep {num_stages} stages: packing to {chosen.num_stages} would save "
                f"{saving_s:.4g} node-s over {steps_left} steps <= restart overhead "
                f"{overhead_s:.4g} node-s"
            )
        elif pack:
            reason += (
                f"; saves {saving_s:.4g} node-s over {steps_left} steps > restart overhead "
                f"{overhead_s:.4g} node-s"
            )
        return PackPlan(
            pack=pack,
            policy=policy,
            current=current,
            chosen=chosen if pack else current,
            candidates=candidates,
            calibration=calibration,
            saving_node_s=saving_s if pack or chosen is not current else 0.0,
            overhead_node_s=overhead_s,
            reason=reason,
        )

    if not fitting:
        why = "no smaller stage count releases a node" if not candidates else "none fits memory"
        return plan(current, f"keep {num_stages} stages: {why}")
    if policy == "throughput":
        floor = (1.0 - max_slowdown) * current.tokens_per_s
        good = [c for c in fitting if c.tokens_per_s >= floor]
        if not good:
            fastest = max(fitting, key=lambda c: c.tokens_per_s)
            return plan(
                current,
                f"keep {num_stages} stages: the best smaller one ({fastest.num_stages} stages, "
                f"{fastest.tokens_per_s:.4g} tokens/s) is below (1 - {max_slowdown:g}) x "
                f"{current.tokens_per_s:.4g} tokens/s",
            )
        fewest = min(c.num_nodes for c in good)
        chosen = max(
            (c for c in good if c.num_nodes == fewest), key=lambda c: (c.tokens_per_s, c.num_stages)
        )
        return plan(
            chosen,
            f"pack {num_stages} -> {chosen.num_stages} stages ({current.num_nodes} -> "
            f"{chosen.num_nodes} nodes): predicted {chosen.tokens_per_s:.4g} tokens/s >= "
            f"(1 - {max_slowdown:g}) x {current.tokens_per_s:.4g}",
        )
    top = max(fitting, key=lambda c: (c.tokens_per_node_hour, -c.num_stages))
    if top.tokens_per_node_hour <= current.tokens_per_node_hour:
        return plan(
            current,
            f"keep {num_stages} stages: {current.tokens_per_node_hour:.4g} tokens/node-hour is "
            f"the top (next {top.num_stages} stages: {top.tokens_per_node_hour:.4g})",
        )
    return plan(
        top,
        f"pack {num_stages} -> {top.num_stages} stages: {top.tokens_per_node_hour:.4g} > "
        f"{current.tokens_per_node_hour:.4g} tokens per node-hour",
    )
