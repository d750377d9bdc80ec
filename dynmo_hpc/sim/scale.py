"""A run's scheme trajectory on a larger model: per-layer costs per report, speedups at scale.

Why: a run on this machine has 16 small blocks; the question the paper answers is what a
dynamic scheme does to a large model on 8 to 64 stages. What carries over from the small run is
the *scheme's state* per layer and step (neurons and heads kept, tokens kept, attention
density, frozen prefix, expert loads: the run log's ``layer_states`` table), not its seconds.
This module maps that state by relative depth onto the larger model's blocks, prices every
layer with the per-layer cost model (:func:`dynmo_hpc.sim.cost_model.layer_times_s` on a
machine's :class:`~dynmo_hpc.sim.machine.LayerRates`) and replays each report under each
balancing algorithm (:func:`dynmo_hpc.sim.replay.replay`), then compares step times with the
static baselines (``uniform``, ``megatron``, ``parameters``) and says what limits the best
balancer's gain over the best of them (:mod:`dynmo_hpc.sim.scale_limits`).

Invariants: the embedding keeps the run's embedding state and the head the run's head state;
block ``j`` of ``B`` takes block ``floor(j N / B)`` of the run's ``N`` (``depth``: a prefix
stays a prefix, a depth trend keeps its shape, and an early-exit head stays on one block, the
last of those its block stretches over) or ``j mod N`` (``periodic``: MoD's every other block
keeps its parity). Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dynmo_hpc.sim.cost_model import LayerShape, SchemeState, layer_cost, layer_times_s
from dynmo_hpc.sim.machine import LayerRates
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, replay
from dynmo_hpc.sim.scale_limits import BALANCERS, STATIC_BASELINES, RowLimits, row_limits

MAPPINGS = ("depth", "periodic")
"""How the run's blocks are laid over the larger model's (see the module docstring)."""
BASELINES = STATIC_BASELINES
"""The static splits speedups are quoted against: Megatron-LM's even blocks (``megatron``), its
variant with the embedding and loss counted as layers (``uniform``), DeepSpeed's
(``parameters``)."""
BYTES_PER_PARAM_TRAINED = 16
"""Bytes a parameter migrates with: fp32 value, gradient and AdamW's two moments."""
MIN_FRACTION = 1e-6
"""A kept fraction of 0 (every token exited) is priced as this: the cost model needs > 0."""


@dataclass(frozen=True)
class Trajectory:
    """Per load report, the state of each of the run's layers (embedding, blocks, head)."""

    steps: list[int]
    """The report steps, ascending."""
    states: list[list[SchemeState]]
    """``states[r][i]``: layer ``i`` over report ``r``'s interval."""

    def check(self) -> None:
        """ValueError unless there is a report, every report covers the same >= 3 layers."""
        if not self.states or len(self.states) != len(self.steps):
            raise ValueError("a trajectory needs one state list per report, and >= 1 report")
        if len({len(s) for s in self.states}) != 1 or len(self.states[0]) < 3:
            raise ValueError("every report must cover the same layers: embedding, blocks, head")


def source_blocks(num_source: int, num_target: int, mapping: str) -> list[int]:
    """For each of ``num_target`` blocks (0-based), the run's block (0-based) it copies.

    Example: ``source_blocks(4, 8, "depth") == [0, 0, 1, 1, 2, 2, 3, 3]``;
    ``source_blocks(4, 8, "periodic") == [0, 1, 2, 3, 0, 1, 2, 3]``.
    """
    if mapping not in MAPPINGS:
        raise ValueError(f"mapping={mapping!r}; HINT: choose one of {', '.join(MAPPINGS)}")
    if num_source < 1 or num_target < 1:
        raise ValueError(f"block counts {num_source}, {num_target} must be >= 1")
    if mapping == "periodic":
        return [j % num_source for j in range(num_target)]
    return [j * num_source // num_target for j in range(num_target)]


def map_states(
    states: Sequence[SchemeState], num_target_blocks: int, mapping: str = "depth"
) -> list[SchemeState]:
    """The run's per-layer ``states`` (embedding, N blocks, head) laid over ``num_target_blocks``
    blocks; embedding and head keep their own."""
    blocks = list(states[1:-1])
    picked = source_blocks(len(blocks), num_target_blocks, mapping)
    mapped = [blocks[i] for i in picked]
    if mapping == "depth":
        # An exit head stays one head, on the last of the blocks its block stretches over:
        # the exits keep their count and relative depths.
        for j, i in enumerate(picked):
            if mapped[j].exit_head and j + 1 < len(picked) and picked[j + 1] == i:
                mapped[j] = replace(mapped[j], exit_head=False)
    return [states[0], *mapped, states[-1]]


def layer_params(shape: LayerShape, state: SchemeState) -> int:
    """Parameters of the layer as the scheme left it (what ``parameters`` splits by)."""
    c, v = shape.d_model, shape.vocab_size
    if shape.kind == "embedding":
        return v * c + shape.seq_len * c
    if shape.kind == "head":
        return 2 * c + c * v
    width = round(state.heads_kept * c)
    d_ff = round(state.neurons_kept * shape.d_ff)
    mlp = 2 * c * d_ff + d_ff + c
    experts = len(state.expert_loads) if state.expert_loads is not None else 0
    ff = experts * mlp + c * experts if experts else mlp
    exit_head = 2 * c + c * v if state.exit_head else 0
    return 4 * c + 4 * c * width + 3 * width + c + ff + exit_head


def price_report(
    shapes: Sequence[LayerShape],
    states: Sequence[SchemeState],
    rates: LayerRates,
    num_microbatches: int,
) -> CostReport:
    """One load report of the larger model: per layer, seconds per step (``num_microbatches``
    passes), parameters and migration bytes, from its shape and state."""
    if len(shapes) != len(states):
        raise ValueError(f"{len(shapes)} layer shapes but {len(states)} states")
    forward, backward, params = [], [], []
    for shape, state in zip(shapes, states, strict=True):
        f_s, b_s = layer_times_s(layer_cost(shape, state), rates)
        forward.append(f_s * num_microbatches)
        backward.append(b_s * num_microbatches)
        params.append(layer_params(shape, state))
    return CostReport(
        forward_s=forward,
        backward_s=backward,
        num_params=params,
        layer_bytes=[p * BYTES_PER_PARAM_TRAINED for p in params],
    )


def clamp_state(state: SchemeState) -> SchemeState:
    """``state`` with kept fractions of 0 raised to :data:`MIN_FRACTION` (see there)."""
    names = ("neurons_kept", "heads_kept", "tokens_kept", "attention_density")
    fixed = {n: max(MIN_FRACTION, getattr(state, n)) for n in names}
    if state.kv_tokens_kept is not None:
        fixed["kv_tokens_kept"] = max(MIN_FRACTION, state.kv_tokens_kept)
    return replace(state, **fixed)


@dataclass(frozen=True)
class Speedup:
    """An algorithm's speedup over a baseline on one replay."""

    median: float
    """Baseline's median step time / the algorithm's, over the whole run."""
    steady_max: float
    """Largest per-step ratio (baseline step / algorithm step) over the steady state."""


@dataclass(frozen=True)
class StageResult:
    """One stage count: each algorithm's median step time and its speedups over the baselines."""

    num_stages: int
    num_microbatches: int
    median_step_s: dict[str, float]
    speedups: dict[str, dict[str, Speedup]]
    """``speedups[algorithm][baseline]``."""
    limits: RowLimits | None
    """The best balancer's steady-state gain over the best static baseline, its ceiling and what
    limits it (:mod:`dynmo_hpc.sim.scale_limits`); None when no balancer was replayed."""
    block_spread: float
    """At the last report: the heaviest block over the mean block (:func:`block_spread`)."""


def speedup(base_s: Sequence[float], algo_s: Sequence[float], steady_from: int) -> Speedup:
    """:class:`Speedup` of per-step times ``algo_s`` against ``base_s`` (same steps);
    ``steady_from``: the first steady step (clamped into the run)."""
    if len(base_s) != len(algo_s) or not base_s:
        raise ValueError("the two replays must have the same, non-zero number of steps")
    start = min(max(0, steady_from), len(base_s) - 1)
    ratios = [b / a for b, a in zip(base_s[start:], algo_s[start:], strict=True) if a > 0]
    return Speedup(
        median=statistics.median(base_s) / statistics.median(algo_s),
        steady_max=max(ratios) if ratios else math.nan,
    )


def simulate_stages(
    reports: Sequence[CostReport],
    setup: ReplaySetup,
    algorithms: Sequence[str],
    steady_from_step: int,
) -> StageResult:
    """Replay ``reports`` under each of ``algorithms`` (the baselines always included) on
    ``setup`` and compare with :data:`BASELINES`."""
    names = list(dict.fromkeys([*BASELINES, *algorithms]))
    results = {a: replay(reports, setup, a) for a in names}
    speedups = {
        a: {
            b: speedup(results[b].step_times_s, results[a].step_times_s, steady_from_step)
            for b in BASELINES
        }
        for a in names
    }
    return StageResult(
        num_stages=setup.num_stages,
        num_microbatches=setup.num_microbatches,
        median_step_s={a: r.median_step_time_s for a, r in results.items()},
        speedups=speedups,
        limits=(
            row_limits(reports, setup, results, steady_from_step)
            if any(a in BALANCERS for a in names)
            else None
        ),
        block_spread=block_spread(reports[-1]),
    )


def block_spread(report: CostReport) -> float:
    """Heaviest block over the mean block (forward + backward) in ``report``: how uneven the
    scheme leaves the blocks (1.0: all alike)."""
    costs = [f + b for f, b in zip(report.forward_s[1:-1], report.backward_s[1:-1], strict=True)]
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0


def scale_reports(
    trajectory: Trajectory,
    shapes: Sequence[LayerShape],
    rates: LayerRates,
    num_microbatches: int,
    *,
    mapping: str = "depth",
    expert_d_ff: int | None = None,
    padded: bool = False,
) -> list[CostReport]:
    """Each report of ``trajectory`` mapped onto the model of ``shapes`` (embedding, blocks,
    head) and priced: the :class:`CostReport` list :func:`simulate_stages` replays.

    ``expert_d_ff``: each expert's width in a block the run's state makes an MoE block (None:
    the block's ``d_ff``); ``padded``: every expert runs the busiest one's load."""
    trajectory.check()
    blocks = len(shapes) - 2
    if blocks < 1:
        raise ValueError("the larger model needs at least one block")
    out = []
    for states in trajectory.states:
        mapped = [clamp_state(s) for s in map_states(states, blocks, mapping)]
        layer_shapes = list(shapes)
        for i, state in enumerate(mapped):
            if state.expert_loads is not None:
                mapped[i] = replace(state, padded=padded)
                if expert_d_ff is not None:
                    layer_shapes[i] = replace(shapes[i], d_ff=expert_d_ff)
        out.append(price_report(layer_shapes, mapped, rates, num_microbatches))
    return out
