"""What limits a row of the at-scale table: the achieved speedup against that row's own ceiling.

Why: a scheme's trajectory on ``P`` stages allows only so much gain. Quoting the paper's "up to"
figure beside ours and calling every shortfall "the input" hides whether the trajectory has no
more imbalance to give (then the balancer is at its ceiling and nothing would do better), whether
the ceiling is capped by the layers' size or the pipeline's fill and drain, or whether the
balancer leaves gain on the table (migrations, deciding on past costs). This module computes, for
one stage count, the chain

    achieved = imbalance x granularity x pipeline x decisions x migrations

over the steady state, every factor a ratio of summed seconds (so slow steps weigh by their
seconds, as in a run):

- **achieved**: the best static baseline's steady-state seconds over the best DynMo balancer's
  (migrations included); "best" is the least steady-state time among :data:`STATIC_BASELINES` and
  :data:`BALANCERS` replays.
- **ceiling** = imbalance x granularity x pipeline: the static split's simulated step over the
  best partition's, each priced by the replay's own step model (:func:`replay.step_time_s`:
  fill, drain, transfers), per steady step with the costs of the report in force. The best
  partition is the fastest of the static split, the min-max contiguous split of those costs,
  and every partition a replay ran at that step (so no replay beats the ceiling but by its
  migrations' absence).
- **imbalance**: the static split's heaviest stage over the mean stage (layer compute only): the
  gain a perfect split of divisible work would give.
- **granularity** = mean stage / the min-max split's heaviest stage (<= 1): what whole layers
  cost (no contiguous split of whole layers reaches the mean; a layer heavier than a mean stage
  caps every split).
- **pipeline** = ceiling / (imbalance x granularity): what fill, drain and transfers take.
- **decisions** = achieved without migrations / ceiling: the partitions the balancer ran, chosen
  at the previous report on smoothed costs (min-max of layer compute, which is not always the
  fastest pipeline) and enacted only when the gain beat its margin (diffusion: one phase a
  report), against the best partition for the costs in force.
- **migrations** = achieved / achieved without the steady state's migration seconds.

Invariant: the product of the factors is the achieved speedup (up to rounding). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynmo_hpc.balance import optimal, stage_loads
from dynmo_hpc.balance.registry import rebalancing, static_baselines
from dynmo_hpc.sim.replay import CostReport, ReplayResult, ReplaySetup, step_time_s

STATIC_BASELINES = static_baselines()
"""The static baselines a row's best is chosen from (``uniform``, ``megatron``, ``parameters``)."""
BALANCERS = rebalancing()
"""DynMo's balancers a row's best is chosen from."""
AT_CEILING = 0.02
"""Achieved within this fraction of the ceiling counts as at the ceiling."""
NO_ROOM = 0.01
"""A ceiling below ``1 + NO_ROOM`` leaves nothing to gain."""
NOTABLE = 0.05
"""A factor that takes more than this fraction is named as a limit."""


@dataclass(frozen=True, kw_only=True)
class RowLimits:
    """One stage count's steady-state speedup and the factors it is the product of."""

    best_static: str
    best_balancer: str
    achieved: float
    """Best static's steady-state seconds / best balancer's (migrations included)."""
    achieved_max: float
    """Largest per-step ratio of the same two over the steady state (the "up to" figure)."""
    imbalance: float
    granularity: float
    pipeline: float
    decisions: float
    migrations: float

    @property
    def ceiling(self) -> float:
        """The pipeline-aware ceiling over the best static split."""
        return self.imbalance * self.granularity * self.pipeline

    @property
    def capture(self) -> float | None:
        """``(achieved - 1) / (ceiling - 1)``; None when the ceiling leaves no room."""
        if self.ceiling < 1.0 + NO_ROOM:
            return None
        return (self.achieved - 1.0) / (self.ceiling - 1.0)


def _steady(num_steps: int, steady_from: int) -> range:
    return range(min(max(0, steady_from), num_steps - 1), num_steps)


def _report_of(step: int, interval: int, num_reports: int) -> int:
    return min(step // interval, num_reports - 1)


def _best(results: Mapping[str, ReplayResult], names: Sequence[str], steps: range) -> str:
    present = [n for n in names if n in results]
    if not present:
        raise ValueError(f"no replay of any of {', '.join(names)}; HINT: replay at least one")
    return min(present, key=lambda n: sum(results[n].step_times_s[i] for i in steps))


def row_limits(
    reports: Sequence[CostReport],
    setup: ReplaySetup,
    results: Mapping[str, ReplayResult],
    steady_from_step: int,
) -> RowLimits:
    """The :class:`RowLimits` of ``results`` (replays of ``reports`` on ``setup``, by algorithm:
    at least one static baseline and one balancer) over the steady state from
    ``steady_from_step`` (clamped into the run)."""
    lengths = {len(r.step_times_s) for r in results.values()}
    if len(lengths) != 1 or not reports:
        raise ValueError("every replay must have the same number of steps, and >= 1 report")
    steps = _steady(lengths.pop(), steady_from_step)
    static, balancer = _best(results, STATIC_BASELINES, steps), _best(results, BALANCERS, steps)
    static_s = [results[static].step_times_s[i] for i in steps]
    balancer_s = [results[balancer].step_times_s[i] for i in steps]
    moved_s = sum(s for step, s in results[balancer].migration_steps if step in steps)
    parts = results[static].final_parts
    cache: dict[tuple[int, tuple[int, ...]], float] = {}

    def step_s(r: int, candidate: Sequence[int]) -> float:
        key = (r, tuple(candidate))
        if key not in cache:
            cache[key] = step_time_s(reports[r], list(candidate), setup)
        return cache[key]

    sums = {"max": 0.0, "mean": 0.0, "best_max": 0.0, "static_step": 0.0, "best_step": 0.0}
    loads: dict[int, tuple[float, float, float, list[int]]] = {}
    for step in steps:
        r = _report_of(step, setup.interval, len(reports))
        if r not in loads:
            loads[r] = _stage_loads(reports[r], parts)
        heaviest, mean, best_heaviest, best_parts = loads[r]
        ran = [x.step_parts[step] for x in results.values() if step < len(x.step_parts)]
        candidates = [best_parts, *(p for p in ran if len(p) == len(parts))]
        static_step = step_s(r, parts)
        sums["max"] += heaviest
        sums["mean"] += mean
        sums["best_max"] += best_heaviest
        sums["static_step"] += static_step
        sums["best_step"] += min(static_step, *(step_s(r, c) for c in candidates))
    achieved = sum(static_s) / sum(balancer_s)
    unmoved = sum(static_s) / max(sum(balancer_s) - moved_s, 1e-300)
    imbalance = sums["max"] / sums["mean"]
    granularity = sums["mean"] / sums["best_max"]
    ceiling = sums["static_step"] / sums["best_step"]
    return RowLimits(
        best_static=static,
        best_balancer=balancer,
        achieved=achieved,
        achieved_max=max(b / a for b, a in zip(static_s, balancer_s, strict=True)),
        imbalance=imbalance,
        granularity=granularity,
        pipeline=ceiling / (imbalance * granularity),
        decisions=unmoved / ceiling,
        migrations=achieved / unmoved,
    )


def _stage_loads(report: CostReport, parts: list[int]) -> tuple[float, float, float, list[int]]:
    """One report's compute-only terms: the static split's heaviest stage, the mean stage, the
    min-max contiguous split's heaviest stage, and that split."""
    costs = [f + b for f, b in zip(report.forward_s, report.backward_s, strict=True)]
    num_stages = len(parts) - 1
    best_parts = optimal(costs, num_stages)
    heaviest = max(stage_loads(costs, parts))
    best_heaviest = min(heaviest, max(stage_loads(costs, best_parts)))
    return heaviest, sum(costs) / num_stages, best_heaviest, best_parts


def what_limits(limits: RowLimits) -> str:
    """The row's limit in words, from its factors (see the module docstring)."""
    lim = limits
    pair = f"{lim.achieved:.2f} of {lim.ceiling:.2f}"
    losses = [("partitions chosen on past costs", lim.decisions), ("migrations", lim.migrations)]
    named = [f"{name} {1 - f:.0%}" for name, f in sorted(losses, key=lambda x: x[1]) if f < 0.995]
    if lim.ceiling < 1.0 + NO_ROOM:
        text = (
            f"nothing to gain: the {lim.best_static} split is within {NO_ROOM:.0%} of the best "
            f"partition (ceiling {lim.ceiling:.2f})"
        )
        if lim.achieved < 1.0 - NO_ROOM:
            text += f"; ours {1 - lim.achieved:.0%} slower: " + ", ".join(named)
        return text
    if lim.achieved >= lim.ceiling * (1.0 - AT_CEILING):
        capped = _ceiling_caps(lim)
        if not capped:
            return f"at the ceiling ({pair}): the trajectory's imbalance is all there is"
        return (
            f"at the ceiling ({pair}): no partition does better; of the trajectory's imbalance "
            f"({lim.imbalance:.2f}x), {capped}"
        )
    gap = 1.0 - lim.achieved / lim.ceiling
    return f"below the ceiling by {gap:.0%} ({pair}): " + (", ".join(named) or "rounding")


def _ceiling_caps(lim: RowLimits) -> str:
    """What caps the ceiling below the imbalance, when anything does by > :data:`NOTABLE`."""
    caps = [
        (lim.granularity, "whole layers take {:.0%}"),
        (lim.pipeline, "fill, drain and transfers take {:.0%}"),
    ]
    return ", ".join(t.format(1 - f) for f, t in caps if f < 1.0 - NOTABLE)


def paper_difference(limits: RowLimits, paper: float | None) -> str:
    """The first factor of the chain that stands below the paper's "up to" figure (``paper``;
    None: no figure): the named difference between this row and the paper."""
    lim = limits
    if paper is None:
        return "-"
    if lim.achieved_max >= paper:
        return f"ours reaches it ({lim.achieved_max:.2f})"
    if lim.imbalance < paper:
        return (
            f"the trajectory: the {lim.best_static} split's heaviest stage is "
            f"{lim.imbalance:.2f}x the mean; {paper:.2f}x needs >= {paper:.2f}x"
        )
    if lim.imbalance * lim.granularity < paper:
        capped = lim.imbalance * lim.granularity
        return f"whole layers: the best split's heaviest stage caps it at {capped:.2f}x"
    if lim.ceiling < paper:
        return f"the pipeline: fill, drain and transfers cap it at {lim.ceiling:.2f}x"
    return f"the balancer: the ceiling {lim.ceiling:.2f}x allows it"
