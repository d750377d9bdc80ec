"""The packing decision: run the same model on fewer stages, or fewer data-parallel replicas,
when that costs (almost) no throughput (or buys tokens per node-hour), and hand the freed nodes
back.

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
measured step time, and that ratio calibrates every prediction (``calibration``), so modelling
error common to all stage counts cancels.

With ``R`` replicas (``PackRequest.num_replicas``) the measured costs are one replica's, for its
``M / R`` microbatches; times ``R`` they are the whole global batch on one pipeline, the unit
every size is priced in. A size of ``R'`` replicas x ``P'`` stages then takes

    step_s = (M / R' + P' - 1) * (max stage load / M + 2 * comm_s) + allreduce_s(R', P')

(the core limit becomes ``total load / min(R' P', num_cpu_slots)``): each replica trains
``M / R'`` microbatches, so fewer replicas mean more microbatches per pipeline (roughly
``R / R'`` times the compute part) but a smaller share of fill-and-drain bubble and a smaller
all-reduce. ``allreduce_s`` is the measured exposed all-reduce now (the slowest rank's: the part
not overlapped with the backward, what the step pays), scaled by the
ring all-reduce's bytes per rank ``2 (R' - 1) / R'`` against ``2 (R - 1) / R`` (none at one
replica) and, when the layers' state bytes are known, by the heaviest stage's bytes on the
candidate's partition against the current one's (fewer stages: each rank reduces more layers).

What a pack is compared with (so that it is credited only with what packing does):

- ``rebalanced``: the best partition at the current stage count (``balance.optimal``). A
  rebalance could reach it without a restart, so a pack's gain and its saving are measured
  from it, never from the partition in force.
- ``reference_tokens_per_s``: the bound's reference, the higher of the best predicted tokens/s
  at the job's original size (``original_replicas`` x ``original_stages``) on the current costs
  and
  ``rebalanced``'s (and a floor the caller may give, ``PackRequest.reference_tokens_per_s``).
  It does not fall with the stage count, so repeated decisions on constant costs cannot walk
  down one stage at a time: the bound is always against the original size. It is predicted
  under the same calibration as the candidates, so a noisy measurement scales both alike and
  the comparison is the model's alone.
- ``correction``: measured / predicted tokens/s after the previous pack (``pack_result``),
  capped at 1. The calibration absorbs the model's error at the current size; the correction
  is its error across a change of size, so it divides every smaller candidate's predicted
  speed. Capped at 1 so that a lucky measurement never licenses a pack the model does not.

Every smaller size is tried with its optimal partition under the memory capacity: as many
replicas or fewer (a count dividing ``M``, so that the global batch stays and the microbatches
re-split) times as many stages or fewer, except the current size (:func:`smaller_sizes`). Fewer
replicas at the same stage count keep the partition (its optimum does not depend on ``R'``).
A layer's memory is its fixed bytes (weights, gradients, optimizer state) plus its activation
bytes per microbatch times the microbatches in flight on stage 0 of the candidate (1F1B: stage
``s`` of ``P`` holds at most ``P - s``, so ``min(M / R', P)``; GPipe: ``M / R'``): safe wherever
the layer lands. A candidate must

- release at least one whole node (its ``R' x P'`` ranks at ``ranks_per_node`` ranks each;
  locally every rank is its own "node", i.e. ``ranks_per_node = 1``), never part of one;
- fit every stage in memory (``capacity_bytes`` per stage);
- not go below ``min_stages`` stages or ``min_replicas`` replicas;
- keep its predicted tokens/s (corrected) at least ``(1 - max_slowdown) x reference``, under
  either policy.

The pack policy (``elastic.policy``; not a balancing algorithm) picks among them:

- ``throughput``: the fewest nodes; among those, the fastest ("consolidate without
  sacrificing throughput");
- ``node_hours``: the best predicted tokens per node-hour, if better than ``rebalanced``'s.

Then it pays only if the node-seconds saved over the steps left, against ``rebalanced``, beat
the restart overhead (checkpoint, step exit, shrink, relaunch, restore), paid while holding the
current nodes:

    steps_left * (nodes_now * step_rebalanced - nodes_new * step_new)
        > restart_overhead_s * nodes_now

When the plan does not pack, the caller's rebalancing rule decides at the same report; when it
packs, the pack replaces the rebalance (the layers move through the pack's checkpoint): one
decision per report.

Pure: no clock, no MPI; the caller supplies measurements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dynmo_hpc.balance.common import CostsLike, check_parts, check_values, stage_loads
from dynmo_hpc.balance.optimal import optimal
from dynmo_hpc.balance.step_model import (
    layer_memory_at,
    microbatches_in_flight,
    nodes_for,
    predict_step_time_s,
    ring_allreduce_factor,
    smaller_sizes,
)

# Re-exported: the model's formulas lived here before balance/step_model.py.
__all__ = [
    "layer_memory_at",
    "microbatches_in_flight",
    "nodes_for",
    "predict_step_time_s",
    "ring_allreduce_factor",
    "smaller_sizes",
]

PackPolicy = Literal["throughput", "node_hours"]
PACK_POLICIES: tuple[str, ...] = ("throughput", "node_hours")


@dataclass(frozen=True, kw_only=True)
class PackCandidate:
    """One size (replicas x stages): its best partition and what it is predicted to do."""

    num_stages: int
    num_nodes: int
    num_replicas: int = 1
    """Data-parallel replicas of the pipeline (all on ``parts``)."""
    parts: list[int] = field(default_factory=list)
    """Its optimal partition (empty when nothing fits in memory)."""
    fits_memory: bool
    step_time_s: float
    """Predicted seconds per step: calibrated against the measured current step and, for a
    smaller stage count, divided by the correction."""
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
    """The partition in force."""
    rebalanced: PackCandidate
    """The best partition at the current stage count: what a pack is compared with."""
    chosen: PackCandidate
    """The candidate to pack onto (``current`` when ``pack`` is False)."""
    candidates: list[PackCandidate]
    """Every smaller size (fewer replicas, fewer stages, or both) that would release a node,
    best partition each."""
    calibration: float
    """Measured / predicted step time of the partition in force (1.0 when not measured)."""
    correction: float
    """Measured / predicted tokens/s of the previous pack (capped at 1; 1.0 when none)."""
    reference_tokens_per_s: float
    """The slowdown bound's reference (see the module docstring)."""
    saving_node_s: float
    """Node-seconds ``chosen`` saves over the steps left against ``rebalanced`` (0 when it is
    ``current``)."""
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
            "from_replicas": self.current.num_replicas,
            "to_replicas": self.chosen.num_replicas,
            "from_nodes": self.current.num_nodes,
            "to_nodes": self.chosen.num_nodes,
            "from_parts": self.current.parts,
            "parts": self.chosen.parts,
            "predicted_tokens_per_s_before": self.current.tokens_per_s,
            "predicted_tokens_per_s_rebalanced": self.rebalanced.tokens_per_s,
            "rebalanced_parts": self.rebalanced.parts,
            "predicted_tokens_per_s_after": self.chosen.tokens_per_s,
            "reference_tokens_per_s": self.reference_tokens_per_s,
            "calibration": self.calibration,
            "correction": self.correction,
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
    """``elastic.max_slowdown``: the throughput a pack may lose against the reference."""
    min_stages: int = 1
    """``elastic.min_stages``: never pack below this."""
    min_replicas: int = 1
    """``elastic.min_replicas``: never pack below this many replicas."""
    memory_bytes: CostsLike | None = None
    """Per layer: fixed bytes it holds on its stage (with ``capacity_bytes``)."""
    activation_bytes: CostsLike | None = None
    """Per layer: activation bytes per microbatch in flight (with ``memory_bytes``)."""
    schedule: str = "1f1b"
    """``pipeline.schedule``: microbatches a stage holds (:func:`microbatches_in_flight`)."""
    capacity_bytes: float | None = None
    """Per stage: bytes it may hold."""
    comm_s: float = 0.0
    """Seconds per activation or gradient message between stages."""
    num_cpu_slots: int | None = None
    """CPU cores the ranks share when fewer than the stages (None: one each)."""
    measured_step_s: float | None = None
    """The measured step time now, to calibrate the model (None: uncalibrated)."""
    original_stages: int | None = None
    """The job's stage count before any pack (None: the current one)."""
    reference_tokens_per_s: float | None = None
    """A floor for the reference (None: the original size's prediction alone)."""
    correction: float = 1.0
    """Measured / predicted tokens/s of the previous pack (``pack_result``); capped at 1."""
    num_replicas: int = 1
    """``pipeline.replicas`` now: the costs are one replica's (``num_microbatches /
    num_replicas`` microbatches per step), combined over replicas by the load report."""
    original_replicas: int | None = None
    """The job's replica count before any pack (None: the current one)."""
    allreduce_s: float = 0.0
    """Measured seconds per step of the exposed gradient all-reduce now (the slowest rank's)."""

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
        if not (math.isfinite(self.correction) and self.correction > 0):
            raise ValueError(f"correction={self.correction!r} must be finite and > 0")
        ref = self.reference_tokens_per_s
        if ref is not None and not (math.isfinite(ref) and ref >= 0):
            raise ValueError(f"reference_tokens_per_s={ref!r} must be finite and >= 0")
        if self.original_stages is not None and self.original_stages < 1:
            raise ValueError(f"original_stages={self.original_stages} must be >= 1")
        self._check_replicas()

    def _check_replicas(self) -> None:
        """Raise ValueError on a replica count or all-reduce time no decision can use."""
        for name, value in (
            ("num_replicas", self.num_replicas),
            ("original_replicas", self.original_replicas or 1),
        ):
            if value < 1 or self.num_microbatches % value:
                raise ValueError(
                    f"{name}={value} must be >= 1 and divide num_microbatches="
                    f"{self.num_microbatches}"
                )
        if not (math.isfinite(self.allreduce_s) and self.allreduce_s >= 0):
            raise ValueError(f"allreduce_s={self.allreduce_s!r} must be finite and >= 0")

    def stage_memory(
        self, num_layers: int, num_stages: int, num_replicas: int = 1
    ) -> list[float] | None:
        """Per layer: bytes it holds on a pipeline of ``num_stages`` in each of
        ``num_replicas`` replicas (each runs ``num_microbatches / num_replicas``), None when
        memory is not modelled."""
        if self.memory_bytes is None and self.activation_bytes is None:
            return None
        fixed = check_values(self.memory_bytes) if self.memory_bytes is not None else None
        act = check_values(self.activation_bytes) if self.activation_bytes is not None else None
        per_replica = self.num_microbatches // num_replicas
        in_flight = microbatches_in_flight(num_stages, per_replica, self.schedule)
        return layer_memory_at(fixed or [0.0] * num_layers, act, in_flight)


@dataclass(frozen=True)
class _StepModel:
    """The closed-form step model on ``values`` (per layer, the whole global batch on one
    pipeline: one replica's measured costs times the replicas now), calibrated against the
    measured step."""

    values: list[float]
    request: PackRequest
    current_parts: list[int]
    calibration: float = 1.0

    def allreduce_s(self, parts: list[int], num_replicas: int) -> float:
        """The measured all-reduce scaled to ``num_replicas`` (ring factor) and to the
        heaviest stage's state bytes on ``parts`` (when the layers' bytes are known)."""
        r = self.request
        if num_replicas == 1 or r.num_replicas == 1 or r.allreduce_s == 0:
            return 0.0
        scale = ring_allreduce_factor(num_replicas) / ring_allreduce_factor(r.num_replicas)
        if r.memory_bytes is not None:
            fixed = check_values(r.memory_bytes)
            now = max(stage_loads(fixed, self.current_parts))
            if now > 0:
                scale *= max(stage_loads(fixed, parts)) / now
        return r.allreduce_s * scale

    def predict_s(self, parts: list[int], num_replicas: int) -> float:
        """Uncalibrated seconds per step of ``parts`` on ``num_replicas`` replicas."""
        r = self.request
        return predict_step_time_s(
            self.values,
            parts,
            r.num_microbatches,
            comm_s=r.comm_s,
            num_cpu_slots=r.num_cpu_slots,
            num_replicas=num_replicas,
            allreduce_s=self.allreduce_s(parts, num_replicas),
        )

    def candidate(
        self,
        size: tuple[int, int],
        parts: list[int],
        fits: bool,
        correction: float = 1.0,
    ) -> PackCandidate:
        """``parts`` at ``size`` (replicas, stages) as a candidate (infinitely slow if it does
        not fit); ``correction`` divides its predicted speed (a smaller size's)."""
        num_replicas, num_stages = size
        nodes = nodes_for(num_replicas * num_stages, self.request.ranks_per_node)
        step_s = math.inf
        if fits:
            step_s = self.predict_s(parts, num_replicas) * self.calibration / correction
        tps = self.request.tokens_per_step / step_s if fits and step_s > 0 else 0.0
        return PackCandidate(
            num_stages=num_stages,
            num_replicas=num_replicas,
            num_nodes=nodes,
            parts=parts if fits else [],
            fits_memory=fits,
            step_time_s=step_s,
            tokens_per_s=tps,
            tokens_per_node_hour=tps * 3600.0 / nodes,
        )

    def best(self, size: tuple[int, int], correction: float = 1.0) -> PackCandidate | None:
        """The optimal partition at ``size`` (replicas, stages) under the memory capacity as a
        candidate, or None when the model does not fit in memory on that many stages."""
        r = self.request
        num_replicas, num_stages = size
        memory = r.stage_memory(len(self.values), num_stages, num_replicas)
        try:
            parts = optimal(self.values, num_stages, memory=memory, capacity=r.capacity_bytes)
        except ValueError:
            return None
        return self.candidate(size, parts, True, correction)


def _calibrated_model(values: list[float], parts: list[int], request: PackRequest) -> _StepModel:
    """The step model, scaled so that it predicts the measured step of ``parts`` exactly."""
    whole_batch = [v * request.num_replicas for v in values]
    model = _StepModel(whole_batch, request, parts)
    model_now_s = model.predict_s(parts, request.num_replicas)
    measured = request.measured_step_s
    if measured is not None and measured > 0 and model_now_s > 0:
        return _StepModel(whole_batch, request, parts, measured / model_now_s)
    return model


def _smaller_candidates(
    model: _StepModel, current_parts: list[int], current: PackCandidate, correction: float
) -> list[PackCandidate]:
    """Every smaller size that releases a node (:func:`smaller_sizes`), with its optimal
    partition under the memory capacity (one that fits nowhere is kept, marked not fitting)."""
    out = []
    r = model.request
    sizes = smaller_sizes(
        current.num_replicas,
        current.num_stages,
        num_microbatches=r.num_microbatches,
        min_stages=r.min_stages,
        min_replicas=r.min_replicas,
        ranks_per_node=r.ranks_per_node,
        num_layers=len(model.values),
    )
    for size in sizes:
        best = model.best(size, correction)
        out.append(best if best is not None else model.candidate(size, list(current_parts), False))
    return out


def _reference_tokens_per_s(model: _StepModel, rebalanced: PackCandidate) -> float:
    """The bound's reference: the best of the original size now, the caller's floor and the
    rebalanced current size (see the module docstring)."""
    r = model.request
    original = (
        r.original_replicas or rebalanced.num_replicas,
        r.original_stages or rebalanced.num_stages,
    )
    now = (rebalanced.num_replicas, rebalanced.num_stages)
    at_original = rebalanced.tokens_per_s
    if original != now and original[1] <= len(model.values):
        best = model.best(original)
        at_original = best.tokens_per_s if best is not None else 0.0
    return max(at_original, rebalanced.tokens_per_s, r.reference_tokens_per_s or 0.0)


def size_label(candidate: PackCandidate) -> str:
    """``"3 stages"`` for one replica, ``"2 replicas x 2 stages"`` otherwise (reasons)."""
    if candidate.num_replicas == 1:
        return f"{candidate.num_stages} stages"
    return f"{candidate.num_replicas} replicas x {candidate.num_stages} stages"


@dataclass(frozen=True)
class _Choice:
    """The chosen candidate (``rebalanced`` to keep) and why, before the overhead test."""

    chosen: PackCandidate
    reason: str


def _within_bound(
    rebalanced: PackCandidate, fitting: list[PackCandidate], request: PackRequest, reference: float
) -> tuple[list[PackCandidate], str]:
    """The fitting candidates within ``max_slowdown`` of the reference; the reason to keep
    when there is none."""
    floor = (1.0 - request.max_slowdown) * reference
    good = [c for c in fitting if c.tokens_per_s >= floor]
    if good:
        return good, ""
    fastest = max(fitting, key=lambda c: c.tokens_per_s)
    return [], (
        f"keep {size_label(rebalanced)}: the best smaller one ({size_label(fastest)}, "
        f"{fastest.tokens_per_s:.4g} tokens/s) is below (1 - {request.max_slowdown:g})"
        f" x reference {reference:.4g} tokens/s (rebalanced now: "
        f"{rebalanced.tokens_per_s:.4g})"
    )


def _by_throughput(
    rebalanced: PackCandidate, good: list[PackCandidate], ms: float, reference: float
) -> _Choice:
    """The fewest nodes among ``good`` (all within the bound); the fastest of those."""
    fewest = min(c.num_nodes for c in good)
    chosen = max(
        (c for c in good if c.num_nodes == fewest),
        key=lambda c: (c.tokens_per_s, c.num_stages, c.num_replicas),
    )
    return _Choice(
        chosen,
        f"pack {size_label(rebalanced)} -> {size_label(chosen)} ({rebalanced.num_nodes} "
        f"-> {chosen.num_nodes} nodes): predicted {chosen.tokens_per_s:.4g} tokens/s >= "
        f"(1 - {ms:g}) x reference {reference:.4g} (rebalanced now: "
        f"{rebalanced.tokens_per_s:.4g})",
    )


def _by_node_hours(rebalanced: PackCandidate, good: list[PackCandidate]) -> _Choice:
    """The best tokens per node-hour among ``good``, if better than the rebalanced now."""
    now = size_label(rebalanced)
    top = max(good, key=lambda c: (c.tokens_per_node_hour, -c.num_stages, -c.num_replicas))
    if top.tokens_per_node_hour <= rebalanced.tokens_per_node_hour:
        return _Choice(
            rebalanced,
            f"keep {now}: {rebalanced.tokens_per_node_hour:.4g} tokens/node-hour "
            f"rebalanced is the top (next {size_label(top)}: "
            f"{top.tokens_per_node_hour:.4g})",
        )
    return _Choice(
        top,
        f"pack {now} -> {size_label(top)}: {top.tokens_per_node_hour:.4g} > "
        f"{rebalanced.tokens_per_node_hour:.4g} tokens per node-hour (rebalanced), within the "
        "slowdown bound",
    )


def _choose(
    rebalanced: PackCandidate,
    candidates: list[PackCandidate],
    request: PackRequest,
    reference: float,
) -> _Choice:
    """The pack policy's pick among the candidates that fit and keep within the slowdown bound
    (``rebalanced`` when none does)."""
    fitting = [c for c in candidates if c.fits_memory]
    if not fitting:
        why = "no smaller size releases a node" if not candidates else "none fits memory"
        return _Choice(rebalanced, f"keep {size_label(rebalanced)}: {why}")
    good, why = _within_bound(rebalanced, fitting, request, reference)
    if not good:
        return _Choice(rebalanced, why)
    if request.pack_policy == "throughput":
        return _by_throughput(rebalanced, good, request.max_slowdown, reference)
    return _by_node_hours(rebalanced, good)


@dataclass(frozen=True)
class _Baseline:
    """What the decision compares against: the partition in force and its best rebalance."""

    current: PackCandidate
    rebalanced: PackCandidate
    calibration: float
    correction: float
    reference: float


def _pays(
    choice: _Choice, base: _Baseline, candidates: list[PackCandidate], request: PackRequest
) -> PackPlan:
    """The plan: pack onto the choice only if the node-seconds it saves over the steps left,
    against the rebalanced current size, beat the restart overhead on the nodes held now."""
    current, rebalanced = base.current, base.rebalanced
    chosen, reason, steps_left = choice.chosen, choice.reason, request.steps_left
    moved = chosen is not rebalanced
    saving_s = 0.0
    if moved:
        saving_s = steps_left * (
            rebalanced.num_nodes * rebalanced.step_time_s - chosen.num_nodes * chosen.step_time_s
        )
    overhead_s = request.restart_overhead_s * current.num_nodes
    pack = moved and saving_s > overhead_s
    if moved and not pack:
        reason = (
            f"keep {size_label(current)}: packing to {size_label(chosen)} would save "
            f"{saving_s:.4g} node-s over {steps_left} steps (against the rebalanced partition)"
            f" <= restart overhead {overhead_s:.4g} node-s"
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
        rebalanced=rebalanced,
        chosen=chosen if pack else current,
        candidates=candidates,
        calibration=base.calibration,
        correction=base.correction,
        reference_tokens_per_s=base.reference,
        saving_node_s=saving_s,
        overhead_node_s=overhead_s,
        reason=reason,
    )


def plan_pack(costs_s: CostsLike, parts: Sequence[int], request: PackRequest) -> PackPlan:
    """Whether to pack ``parts`` onto fewer replicas or fewer stages (see the module
    docstring).

    ``costs_s``: smoothed seconds per layer per step of one replica (the load report's
    combination over replicas); ``parts``: the partition in force;
    ``request``: the step's shape, the allocation, the pack policy, the measurements and what
    earlier decisions carried (original size, reference, correction).

    Example: one heavy layer sets the pace; 3 stages are as fast as 4 and free a node::

        plan_pack([1, 1, 1, 6, 1, 1, 1], [0, 2, 3, 4, 7], PackRequest(num_microbatches=8,
                  tokens_per_step=1000, ranks_per_node=1, steps_left=100,
                  restart_overhead_s=5)).chosen.num_stages == 3
    """
    values = check_values(costs_s)
    current_parts = check_parts(parts, len(values))
    request.check()
    model = _calibrated_model(values, current_parts, request)
    size_now = (request.num_replicas, len(current_parts) - 1)
    current = model.candidate(size_now, current_parts, True)
    best_now = model.best(size_now)
    rebalanced = current
    if best_now is not None and best_now.step_time_s < current.step_time_s:
        rebalanced = best_now
    correction = min(1.0, request.correction)
    candidates = _smaller_candidates(model, current_parts, current, correction)
    reference = _reference_tokens_per_s(model, rebalanced)
    choice = _choose(rebalanced, candidates, request, reference)
    base = _Baseline(current, rebalanced, model.calibration, correction, reference)
    return _pays(choice, base, candidates, request)
