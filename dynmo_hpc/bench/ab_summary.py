"""A/B bench rows: per scheme, static split and balancer, the ramp and the steady state apart.

Each row pools the repeats of one (scheme, static split, balancer) A/B run
(:func:`dynmo_hpc.bench.ab.compare_arms`): the gain (median over adjacent block pairs) and its
spread (their quartiles), the pipeline-aware ceiling over the same phase with the run's measured
overheads (median over the repeats), and the capture ``(gain - 1) / (ceiling - 1)``.

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

    @property
    def capture(self) -> float | None:
        if self.comparison is None or self.ceiling is None:
            return None
        return capture(self.comparison.gain, self.ceiling)


def ab_rows(scheme: str, static: str, balancer: str, runs: Sequence[ABRunFigures]) -> list[ABRow]:
    """The ramp and steady-state rows of one (scheme, static split, balancer) over its repeats."""
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
            )
        )
    return rows


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row_line(row: ABRow) -> str:
    c = row.comparison
    head = (
        f"| {row.scheme} | {algorithm_label(row.static)} | {algorithm_label(row.balancer)} | "
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


def _headline_cells(rows: Sequence[ABRow], reference: str, algorithms: Sequence[str]) -> str:
    """One (scheme, phase)'s cells: per algorithm its tokens/s, a balancer's with its gain over
    ``reference`` (spread) and capture; then the ceiling over ``reference``."""
    cells = []
    for name in algorithms:
        as_static = [r for r in rows if r.static == name and r.comparison is not None]
        against = [r for r in rows if (r.static, r.balancer) == (reference, name)]
        if against and against[0].comparison is not None:
            row, c = against[0], against[0].comparison
            low, high = c.spread
            cells.append(
                f"{row.tokens_per_step / c.dynmo_step_s:.0f}: {c.gain:.2f}x "
                f"({low:.2f}-{high:.2f}), capture {_num(row.capture)}"
            )
        elif as_static:
            speeds = [
                r.tokens_per_step / r.comparison.static_step_s for r in as_static if r.comparison
            ]
            cells.append(f"{float(np.median(speeds)):.0f}")
        else:
            cells.append("-")
    ceilings = [r.ceiling for r in rows if r.static == reference and r.ceiling is not None]
    cells.append(_num(float(np.median(ceilings)) if ceilings else None))
    return " | ".join(cells)


def render_ab_headline(rows: Sequence[ABRow]) -> list[str]:
    """The headline table: per scheme and phase, each algorithm's tokens/s, every balancer as
    arm B against the first static split (the reference, arm A of its runs) with its gain,
    spread and capture, and the ceiling over the reference. A static split other than the
    reference shows its own arm's tokens/s (from its own runs, other minutes of the machine)."""
    if not rows:
        return []
    reference = rows[0].static
    statics = list(dict.fromkeys(r.static for r in rows))
    balancers = list(dict.fromkeys(r.balancer for r in rows))
    algorithms = [*statics, *balancers]
    lines = [
        f"Headline: tokens/s per algorithm; each balancer as arm B against "
        f"{algorithm_label(reference)} (arm A of the same run): its tokens/s, gain over it "
        "(IQR over block pairs) and capture of the ceiling over it.",
        "",
        "| scheme | phase (steps) | "
        + " | ".join(algorithm_label(a) for a in algorithms)
        + f" | ceiling over {reference} |",
        "| --- | --- | " + " | ".join("---" for _ in algorithms) + " | --- |",
    ]
    keys = list(dict.fromkeys((r.scheme, r.phase, r.steps) for r in rows))
    for scheme, phase, steps in keys:
        chosen = [r for r in rows if (r.scheme, r.phase, r.steps) == (scheme, phase, steps)]
        lines.append(
            f"| {scheme} | {phase} {steps[0]}-{steps[1] - 1} | "
            f"{_headline_cells(chosen, reference, algorithms)} |"
        )
    return [*lines, ""]


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
        "Every run, one line per phase:",
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
