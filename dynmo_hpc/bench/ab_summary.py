"""A/B bench rows: per scheme, static split and balancer, the ramp and the steady state apart.

Each row pools the repeats of one (scheme, static split, balancer) A/B run
(:func:`dynmo_hpc.bench.ab.compare_arms`): the gain (median over adjacent block pairs) and its
spread (their quartiles), the pipeline-aware ceiling over the same phase with the run's measured
overheads (median over the repeats), and the capture ``(gain - 1) / (ceiling - 1)``.

The headline puts each balancer against the **best static baseline** of its scheme and phase
(:func:`best_baseline`): of the static splits it was run against, the one it gains least over,
each gain measured within its own A/B runs. Its gain, spread, ceiling and capture are that
pair's row's, so both the figure and the choice are A/B comparisons over the same minutes; the
detailed table keeps the gain over every baseline.

Pure: figures in, rows and Markdown out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dynmo_hpc.bench.ab import ArmComparison, compare_arms, phase_ceiling
from dynmo_hpc.bench.ceiling import Ceiling, capture
from dynmo_hpc.bench.summary import algorithm_label

PHASES = ("ramp", "steady")
"""The ramp (after the warm-up, before ``train.steady_state_step``) and the steady state (from
it on, and after the warm-up)."""
WARMUP_BLOCKS = 2
"""Blocks set aside at the start of every A/B run: one of each arm, whichever leads, so the
run's warm-up (first steps, the balancer's first report) costs neither arm more than the other."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ABRunFigures:
    """What one A/B run measured (from its run log)."""

    marked: pd.DataFrame
    """Its steps with ``kept``, ``migration`` and ``noisy`` (:func:`~.ab.mark_steps`)."""
    ceilings: dict[int, Ceiling]
    """Per load report: the ceiling over the static split."""
    losses: list[float]
    period_steps: int
    steady_from_step: int
    num_steps: int
    tokens_per_step: int
    num_migrations: int
    wall_s: float
    final_parts: list[int] = field(default_factory=list)

    @property
    def warmup_steps(self) -> int:
        """Steps set aside for both arms at the start (:data:`WARMUP_BLOCKS` blocks)."""
        return WARMUP_BLOCKS * self.period_steps

    def phase_bounds(self, phase: str) -> tuple[int, int]:
        """Steps ``[first, end)`` of ``phase``, the warm-up left out of both."""
        warmup = min(self.warmup_steps, self.num_steps)
        if phase == "ramp":
            return warmup, max(warmup, self.steady_from_step)
        return max(warmup, self.steady_from_step), self.num_steps


@dataclass(frozen=True, kw_only=True)
class ABRow:
    """One (scheme, static split, balancer, phase) over its repeats."""

    scheme: str
    static: str
    balancer: str
    phase: str
    steps: tuple[int, int]
    """The phase's steps ``[first, end)``."""
    repeats: int
    comparison: ArmComparison | None
    ceiling: float | None
    tokens_per_step: int
    runs_of: str = ""
    """Empty: the row's own runs. Otherwise the static baseline with the same split whose runs
    it reports (the bench ran that split once)."""

    @property
    def capture(self) -> float | None:
        if self.comparison is None or self.ceiling is None:
            return None
        return capture(self.comparison.gain, self.ceiling)

    @property
    def static_tokens_per_s(self) -> float | None:
        """Arm A's tokens/s (its median kept step); None without a comparison."""
        if self.comparison is None:
            return None
        return self.tokens_per_step / self.comparison.static_step_s

    @property
    def dynmo_tokens_per_s(self) -> float | None:
        """Arm B's tokens/s (its median kept step); None without a comparison."""
        if self.comparison is None:
            return None
        return self.tokens_per_step / self.comparison.dynmo_step_s


def ab_rows(
    scheme: str, static: str, balancer: str, runs: Sequence[ABRunFigures], *, runs_of: str = ""
) -> list[ABRow]:
    """The ramp and steady-state rows of one (scheme, static split, balancer) over its repeats;
    ``runs_of``: the static baseline whose runs (the same split) these are, when not
    ``static``'s own (:attr:`ABRow.runs_of`)."""
    if not runs:
        raise ValueError("no runs")
    rows = []
    for phase in PHASES:
        first, end = runs[0].phase_bounds(phase)
        if end <= first:
            continue
        comparison = compare_arms(
            [r.marked for r in runs],
            runs[0].period_steps,
            first,
            end,
            both_orders=phase == "ramp",
        )
        ceilings = [phase_ceiling(r.ceilings, first, end) for r in runs]
        known = [c for c in ceilings if c is not None]
        rows.append(
            ABRow(
                scheme=scheme,
                static=static,
                balancer=balancer,
                phase=phase,
                steps=(first, end),
                repeats=len(runs),
                comparison=comparison,
                ceiling=float(np.median(known)) if known else None,
                tokens_per_step=runs[0].tokens_per_step,
                runs_of=runs_of,
            )
        )
    return rows


@dataclass(frozen=True, kw_only=True)
class BestBaseline:
    """One balancer against the best static baseline of one scheme and phase."""

    scheme: str
    phase: str
    steps: tuple[int, int]
    balancer: str
    static: str
    """The best static baseline: its row (:attr:`row`) gives the gain."""
    tied: tuple[str, ...]
    """Other static baselines whose arm A ran exactly as many tokens/s (a shared split, whose
    rows are the same runs, or an exact tie)."""
    row: ABRow
    """The A/B row of (``static``, ``balancer``) over the phase."""
    static_tokens_per_s: dict[str, float | None]
    """Every static baseline run against the balancer: its arm A's tokens/s over the phase
    (None: no comparison in this phase), in table order."""

    @property
    def names(self) -> tuple[str, ...]:
        """The best baseline, then the ones tied with it."""
        return (self.static, *self.tied)


def best_baseline(rows: Sequence[ABRow]) -> BestBaseline | None:
    """The best static baseline among ``rows`` (one scheme, phase and balancer; one row per
    static baseline): the one the balancer gains least over, each gain measured within its own
    A/B runs. Why not the baseline whose own arm ran the most tokens/s: those figures come from
    different runs, minutes apart, and on a drifting machine the fastest-looking baseline may
    only have met faster minutes; a gain is a ratio within one run. A row without a comparison
    in the phase takes no part; None when no row has one. Rows with the same gain and the same
    tokens/s (a split shared by two names) are :attr:`BestBaseline.tied`; otherwise the first
    row with the lowest gain wins.

    Example: gains 1.4, 1.25 and 2.0 over three splits: the second is the best.
    """
    keys = {(r.scheme, r.phase, r.steps, r.balancer) for r in rows}
    if len(keys) > 1:
        raise ValueError(f"best_baseline takes one scheme, phase and balancer, got {sorted(keys)}")
    speeds = {r.static: r.static_tokens_per_s for r in rows}
    if len(speeds) < len(rows):
        raise ValueError("best_baseline takes one row per static baseline, got a name twice")
    measured = [(r, r.comparison.gain) for r in rows if r.comparison is not None]
    if not measured:
        return None
    best, lowest = min(measured, key=lambda pair: pair[1])
    tied = [
        r
        for r, gain in measured
        if r is not best and gain == lowest and speeds[r.static] == speeds[best.static]
    ]
    return BestBaseline(
        scheme=best.scheme,
        phase=best.phase,
        steps=best.steps,
        balancer=best.balancer,
        static=best.static,
        tied=tuple(r.static for r in tied),
        row=best,
        static_tokens_per_s=speeds,
    )


BaselineKey = tuple[str, str, tuple[int, int], str]
"""(scheme, phase, the phase's steps ``[first, end)``, balancer)."""


def best_baselines(rows: Sequence[ABRow]) -> dict[BaselineKey, BestBaseline | None]:
    """Per (scheme, phase, balancer): :func:`best_baseline` (None where no static baseline has
    a comparison in that phase); schemes and balancers in the order of ``rows``, phases in
    :data:`PHASES` order."""
    keys = list(dict.fromkeys((r.scheme, r.phase, r.steps, r.balancer) for r in rows))
    schemes = list(dict.fromkeys(k[0] for k in keys))
    balancers = list(dict.fromkeys(k[3] for k in keys))
    keys.sort(key=lambda k: (schemes.index(k[0]), PHASES.index(k[1]), balancers.index(k[3])))
    return {
        key: best_baseline([r for r in rows if (r.scheme, r.phase, r.steps, r.balancer) == key])
        for key in keys
    }


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row_line(row: ABRow) -> str:
    c = row.comparison
    static = algorithm_label(row.static)
    if row.runs_of:
        static += f" (the same split as {row.runs_of}: its runs)"
    head = (
        f"| {row.scheme} | {static} | {algorithm_label(row.balancer)} | "
        f"{row.phase} {row.steps[0]}-{row.steps[1] - 1} |"
    )
    if c is None:
        missing = (
            "no three blocks in a row with kept steps (pairs taken in both orders)"
            if row.phase == "ramp"
            else "no adjacent pair of blocks with kept steps in both arms"
        )
        return head + f" - | - | - | {_num(row.ceiling)} | - | {missing} |"
    low, high = c.spread
    tps = row.tokens_per_step
    return head + (
        f" {tps / c.static_step_s:.0f} | {tps / c.dynmo_step_s:.0f} | "
        f"{c.gain:.2f} ({low:.2f}-{high:.2f}) | {_num(row.ceiling)} | {_num(row.capture)} | "
        f"{c.kept[0]}/{c.total[0]}, {c.kept[1]}/{c.total[1]} |"
    )


HEADLINE_COLUMNS = (
    "scheme",
    "phase (steps)",
    "balancer",
    "best static baseline",
    "its tokens/s",
    "balancer tokens/s",
    "gain over best (IQR)",
    "ceiling over best",
    "capture",
)
"""The headline's first columns; one ``<static baseline> tokens/s`` column per static baseline
follows."""


def _best_line(key: BaselineKey, best: BestBaseline | None, statics: Sequence[str]) -> str:
    scheme, phase, steps, balancer = key
    head = f"| {scheme} | {phase} {steps[0]}-{steps[1] - 1} | {algorithm_label(balancer)} |"
    if best is None or best.row.comparison is None:
        cells = ["no static baseline with a comparison in this phase", *["-"] * 5]
        return head + " " + " | ".join([*cells, *["-"] * len(statics)]) + " |"
    row, c = best.row, best.row.comparison
    low, high = c.spread
    cells = [
        " = ".join(best.names),
        _num(row.static_tokens_per_s, 0),
        _num(row.dynmo_tokens_per_s, 0),
        f"{c.gain:.2f}x ({low:.2f}-{high:.2f})",
        _num(row.ceiling),
        _num(row.capture),
        *[_num(best.static_tokens_per_s.get(s), 0) for s in statics],
    ]
    return head + " " + " | ".join(cells) + " |"


def render_ab_headline(rows: Sequence[ABRow]) -> list[str]:
    """The headline table: per scheme, phase and balancer (:func:`best_baselines`), the best
    static baseline (names tied with it after ``=``) and its arm's tokens/s, the balancer's
    tokens/s and gain over it with the spread (from their own A/B runs), the ceiling over the
    best baseline's split, the capture, then each static baseline's tokens/s in its own runs
    against the balancer; a legend of the baselines' names below."""
    if not rows:
        return []
    statics = list(dict.fromkeys(r.static for r in rows))
    columns = [*HEADLINE_COLUMNS, *(f"{s} tokens/s" for s in statics)]
    lines = [
        "Headline: each balancer against the best static baseline of each scheme and phase: "
        "of the static splits it ran against, the one it gains least over (each gain within "
        "its own A/B runs; each static split's tokens/s is from its own runs). Gain = the "
        "balancer over that baseline in the same runs (median over block "
        "pairs, IQR), with the ceiling over that baseline's split and the capture of it. "
        "`a = b`: the same split, run once and reported under both names. "
        "The gains over every static baseline are in the table after this one.",
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *[_best_line(key, best, statics) for key, best in best_baselines(rows).items()],
        "",
        "Static baselines: " + "; ".join(f"{s} = {algorithm_label(s)}" for s in statics) + ".",
        "",
    ]
    return lines


def render_ab_markdown(
    rows: Sequence[ABRow],
    loss_differences: Mapping[str, float],
    *,
    command: str,
    setting: str,
    noise_factor: float,
) -> str:
    """The A/B ``results.md``: one line per row, then the largest loss difference per scheme."""
    lines = [
        "# dynmo-hpc bench --ab (A/B within one run)",
        "",
        f"Command: `{command}`",
        "",
        setting,
        "",
        "Each run alternates the static split and the balancer's plan every period of steps; "
        "both arms ran over the same minutes. tokens/s from the median kept step time of each "
        "arm (repeats pooled; the arm that leads alternates from one repeat to the next). Steps "
        "set aside: the first block of each arm (warm-up), a migrating step and the step after "
        f"it, and noisy steps (wall/CPU ratio above {noise_factor:g} x the run's median). Gain = "
        "balancer over static split: the median, over adjacent pairs of blocks (one per arm), "
        "of static block median step time / balancer block median step time, (25th-75th "
        "percentile over the same pairs); in the ramp, over three blocks in a row (pairs taken "
        "in both orders), the middle block against the geometric mean of its neighbours. "
        "Ceiling = the best contiguous partition's simulated "
        "step over the static split's, on the run's measured per-layer costs plus its measured "
        "time besides the layers (per stage, and after the schedule), fill and drain included. "
        "Capture = (gain - 1) / (ceiling - 1), '-' where the ceiling is under 1.01. Kept = "
        "kept/all steps, static arm then balancer arm.",
        "",
        *render_ab_headline(rows),
        "Every run, one line per phase (each balancer against every static baseline; a "
        "baseline with the same split as an earlier one reports that one's runs):",
        "",
        "| scheme | static split | balancer | phase (steps) | static tokens/s | "
        "balancer tokens/s | gain (IQR over pairs) | ceiling | capture | kept |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[_row_line(row) for row in rows],
        "",
        "| scheme | max loss diff between the A/B runs |",
        "| --- | --- |",
        *[f"| {s} | {d:.2g} |" for s, d in loss_differences.items()],
    ]
    return "\n".join(lines) + "\n"
