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

The pack policy (``elastic.policy``; not a balancing algorithm) picks among them:

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
    pack_policy: str
    """``elastic.policy`` the candidate was chosen with (``policy`` in the run-log event)."""
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
            "policy": self.pack_policy,
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


@dataclass(frozen=True, kw_only=True)
class PackRequest:
    """What a packing decision needs besides the costs and the partition in force."""

    num_microbatches: int
    """Microbatches per step (the step's shape)."""
    tokens_per_step: float
    """Tokens per step; only ratios of it matter to the decision."""
    ranks_per_node: int
    """Ranks the allocation places on a node (1 locally)."""
    steps_left: int
    """Training steps after this decision."""
    restart_overhead_s: float
    """Measured (or estimated) seconds a resize stops training."""
    pack_policy: str = "throughput"
    """``elastic.policy``: how a candidate is chosen (:data:`PACK_POLICIES`)."""
    max_slowdown: float = 0.1
    """``elastic.max_slowdown``: the throughput a ``throughput`` pack may lose, as a fraction."""
    min_stages: int = 1
    """``elastic.min_stages``: never pack below this."""
    memory_bytes: CostsLike | None = None
    """Per layer: bytes it holds on its stage (with ``capacity_bytes``, both or none)."""
    capacity_bytes: float | None = None
    """Per stage: bytes it may hold."""
    comm_s: float = 0.0
    """Seconds per activation or gradient message between stages."""
    num_cpu_slots: int | None = None
    """CPU cores the ranks share when fewer than the stages (None: one each)."""
    measured_step_s: float | None = None
    """The measured step time now, to calibrate the model (None: uncalibrated)."""

    def check(self) -> None:
        """Raise ValueError on a setting no decision can use."""
        if self.pack_policy not in PACK_POLICIES:
            raise ValueError(
                f"policy={self.pack_policy!r} is not one of {', '.join(PACK_POLICIES)}"
            )
        if self.ranks_per_node < 1 or self.min_stages < 1 or self.steps_left < 0:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node}, min_stages={self.min_stages} must be "
                f">= 1 and steps_left={self.steps_left} >= 0"
            )
        if not (math.isfinite(self.max_slowdown) and 0 <= self.max_slowdown < 1):
            raise ValueError(f"max_slowdown={self.max_slowdown!r} must be in [0, 1)")
        if not (math.isfinite(self.restart_overhead_s) and self.restart_overhead_s >= 0):
            raise ValueError(
                f"restart_overhead_s={self.restart_overhead_s!r} must be finite and >= 0"
            )


@dataclass(frozen=True)
class _StepModel:
    """The closed-form step model on ``values``, calibrated against the measured step."""

    values: list[float]
    request: PackRequest
    calibration: float = 1.0

    def predict_s(self, parts: list[int]) -> float:
        """Uncalibrated seconds per step of ``parts``."""
        r = self.request
        return predict_step_time_s(
            self.values, parts, r.num_microbatches, comm_s=r.comm_s, num_cpu_slots=r.num_cpu_slots
        )

    def candidate(self, num_stages: int, parts: list[int], fits: bool) -> PackCandidate:
        """``parts`` on ``num_stages`` as a candidate (infinitely slow if it does not fit)."""
        nodes = nodes_for(num_stages, self.request.ranks_per_node)
        step_s = self.predict_s(parts) * self.calibration if fits else math.inf
        tps = self.request.tokens_per_step / step_s if fits and step_s > 0 else 0.0
        return PackCandidate(
            num_stages=num_stages,
            num_nodes=nodes,
            parts=parts if fits else [],
            fits_memory=fits,
            step_time_s=step_s,
            tokens_per_s=tps,
            tokens_per_node_hour=tps * 3600.0 / nodes,
        )


def _calibrated_model(values: list[float], parts: list[int], request: PackRequest) -> _StepModel:
    """The step model, scaled so that it predicts the measured step of ``parts`` exactly."""
    model = _StepModel(values, request)
    model_now_s = model.predict_s(parts)
    measured = request.measured_step_s
    if measured is not None and measured > 0 and model_now_s > 0:
        return _StepModel(values, request, measured / model_now_s)
    return model


def _smaller_candidates(
    model: _StepModel, current_parts: list[int], current: PackCandidate
) -> list[PackCandidate]:
    """Every smaller stage count down to ``min_stages`` that releases a node, with its optimal
    partition under the memory capacity (one that fits nowhere is kept, marked not fitting)."""
    r = model.request
    out = []
    for n in range(current.num_stages - 1, max(r.min_stages, 1) - 1, -1):
        if nodes_for(n, r.ranks_per_node) >= current.num_nodes or n > len(model.values):
            continue
        try:
            best_parts = optimal(model.values, n, memory=r.memory_bytes, capacity=r.capacity_bytes)
        except ValueError:  # the model does not fit in memory on n stages
            out.append(model.candidate(n, list(current_parts), False))
            continue
        out.append(model.candidate(n, best_parts, True))
    return out


@dataclass(frozen=True)
class _Choice:
    """The chosen candidate (``current`` to keep) and why, before the overhead test."""

    chosen: PackCandidate
    reason: str


def _by_throughput(
    current: PackCandidate, fitting: list[PackCandidate], max_slowdown: float
) -> _Choice:
    """The fewest nodes within ``max_slowdown`` of the current throughput; the fastest of
    those."""
    num_stages = current.num_stages
    floor = (1.0 - max_slowdown) * current.tokens_per_s
    good = [c for c in fitting if c.tokens_per_s >= floor]
    if not good:
        fastest = max(fitting, key=lambda c: c.tokens_per_s)
        return _Choice(
            current,
            f"keep {num_stages} stages: the best smaller one ({fastest.num_stages} stages, "
            f"{fastest.tokens_per_s:.4g} tokens/s) is below (1 - {max_slowdown:g}) x "
            f"{current.tokens_per_s:.4g} tokens/s",
        )
    fewest = min(c.num_nodes for c in good)
    chosen = max(
        (c for c in good if c.num_nodes == fewest), key=lambda c: (c.tokens_per_s, c.num_stages)
    )
    return _Choice(
        chosen,
        f"pack {num_stages} -> {chosen.num_stages} stages ({current.num_nodes} -> "
        f"{chosen.num_nodes} nodes): predicted {chosen.tokens_per_s:.4g} tokens/s >= "
        f"(1 - {max_slowdown:g}) x {current.tokens_per_s:.4g}",
    )


def _by_node_hours(current: PackCandidate, fitting: list[PackCandidate]) -> _Choice:
    """The best tokens per node-hour, if better than the current."""
    num_stages = current.num_stages
    top = max(fitting, key=lambda c: (c.tokens_per_node_hour, -c.num_stages))
    if top.tokens_per_node_hour <= current.tokens_per_node_hour:
        return _Choice(
            current,
            f"keep {num_stages} stages: {current.tokens_per_node_hour:.4g} tokens/node-hour is "
            f"the top (next {top.num_stages} stages: {top.tokens_per_node_hour:.4g})",
        )
    return _Choice(
        top,
        f"pack {num_stages} -> {top.num_stages} stages: {top.tokens_per_node_hour:.4g} > "
        f"{current.tokens_per_node_hour:.4g} tokens per node-hour",
    )


def _choose(
    current: PackCandidate, candidates: list[PackCandidate], request: PackRequest
) -> _Choice:
    """The pack policy's pick among the candidates that fit (``current`` when none does)."""
    fitting = [c for c in candidates if c.fits_memory]
    if not fitting:
        why = "no smaller stage count releases a node" if not candidates else "none fits memory"
        return _Choice(current, f"keep {current.num_stages} stages: {why}")
    if request.pack_policy == "throughput":
        return _by_throughput(current, fitting, request.max_slowdown)
    return _by_node_hours(current, fitting)


def _pays(
    choice: _Choice,
    current: PackCandidate,
    candidates: list[PackCandidate],
    calibration: float,
    request: PackRequest,
) -> PackPlan:
    """The plan: pack onto the choice only if the node-seconds it saves over the steps left
    beat the restart overhead paid on the nodes held now."""
    chosen, reason, steps_left = choice.chosen, choice.reason, request.steps_left
    saving_s = 0.0
    if chosen is not current:
        saving_s = steps_left * (
            current.num_nodes * current.step_time_s - chosen.num_nodes * chosen.step_time_s
        )
    overhead_s = request.restart_overhead_s * current.num_nodes
    pack = chosen is not current and saving_s > overhead_s
    if chosen is not current and not pack:
        reason = (
            f"keep {current.num_stages} stages: packing to {chosen.num_stages} would save "
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
        pack_policy=request.pack_policy,
        current=current,
        chosen=chosen if pack else current,
        candidates=candidates,
        calibration=calibration,
        saving_node_s=saving_s if pack or chosen is not current else 0.0,
        overhead_node_s=overhead_s,
        reason=reason,
    )


def plan_pack(costs_s: CostsLike, parts: Sequence[int], request: PackRequest) -> PackPlan:
    """Whether to pack ``parts`` onto fewer stages (see the module docstring).

    ``costs_s``: smoothed seconds per layer per step; ``parts``: the partition in force;
    ``request``: the step's shape, the allocation, the pack policy and the measurements.

    Example: one heavy layer sets the pace; 3 stages are as fast as 4 and free a node::

        plan_pack([1, 1, 1, 6, 1, 1, 1], [0, 2, 3, 4, 7], PackRequest(num_microbatches=8,
                  tokens_per_step=1000, ranks_per_node=1, steps_left=100,
                  restart_overhead_s=5)).chosen.num_stages == 3
    """
    values = check_values(costs_s)
    current_parts = check_parts(parts, len(values))
    request.check()
    model = _calibrated_model(values, current_parts, request)
    current = model.candidate(len(current_parts) - 1, current_parts, True)
    candidates = _smaller_candidates(model, current_parts, current)
    choice = _choose(current, candidates, request)
    return _pays(choice, current, candidates, model.calibration, request)
