"""Repeats into one row per (scheme, algorithm), the same-model check, and the results table.

Why medians with min and max: on a shared machine one slow repeat is noise, not a property of an
algorithm. The median resists it, and the min-max range says how far to trust a difference: a
speedup inside the spread of repeats is no speedup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.balance.registry import rebalancing, static_baselines
from dynmo_hpc.bench.ceiling import capture
from dynmo_hpc.bench.measure import RunFigures
from dynmo_hpc.errors import DynmoError


def algorithm_label(algorithm: str) -> str:
    """An algorithm's name in the tables: its registry label, except that ``uniform`` reads
    "static uniform (Megatron-style)" unless the registry has a ``megatron`` entry of its own
    (then each keeps its own label)."""
    if algorithm == "uniform" and "megatron" not in ALGORITHMS:
        return "static uniform (Megatron-style)"
    return ALGORITHMS[algorithm].label


class BenchError(DynmoError):
    """A bench run failed; the message names the run and its directory."""


class LossMismatchError(DynmoError):
    """Two algorithms trained different models: a bench comparing them would compare nothing."""


@dataclass(frozen=True, kw_only=True)
class Spread:
    """Median, min and max over repeats."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        array = np.asarray(values, dtype=np.float64)
        return cls(median=float(np.median(array)), low=float(array.min()), high=float(array.max()))


@dataclass(frozen=True, kw_only=True)
class AlgorithmRow:
    """One (scheme, algorithm) over its repeats."""

    scheme: str
    algorithm: str
    repeats: int
    tokens_per_s: Spread
    train_s: Spread
    wall_s: Spread
    efficiency: Spread
    num_moves: Spread
    migration_s: Spread
    final_loss: float
    steady_tokens_per_s: Spread | None = None
    """Tokens/s over the steady state alone (None when a run has no steady-state step)."""
    ramp_tokens_per_s: Spread | None = None
    steady_ceilings: dict[str, float] = field(default_factory=dict)
    """Per static baseline: the median over repeats of the runs' steady-state ceilings."""


def _finite_spread(values: Sequence[float]) -> Spread | None:
    kept = [v for v in values if math.isfinite(v)]
    return Spread.of(kept) if kept else None


def summarize(scheme: str, algorithm: str, runs: Sequence[RunFigures]) -> AlgorithmRow:
    """One row from the repeats of one (scheme, algorithm)."""
    return AlgorithmRow(
        scheme=scheme,
        algorithm=algorithm,
        repeats=len(runs),
        tokens_per_s=Spread.of([r.tokens_per_s for r in runs]),
        train_s=Spread.of([r.train_s for r in runs]),
        wall_s=Spread.of([r.wall_s for r in runs]),
        efficiency=Spread.of([r.efficiency for r in runs]),
        num_moves=Spread.of([float(r.num_moves) for r in runs]),
        migration_s=Spread.of([r.migration_s for r in runs]),
        final_loss=float(np.median([r.final_loss for r in runs])),
        steady_tokens_per_s=_finite_spread([r.steady_tokens_per_s for r in runs]),
        ramp_tokens_per_s=_finite_spread([r.ramp_tokens_per_s for r in runs]),
        steady_ceilings={
            name: float(
                np.median([r.steady_ceilings[name] for r in runs if name in r.steady_ceilings])
            )
            for name in {n for r in runs for n in r.steady_ceilings}
        },
    )


def max_loss_difference(losses_by_algorithm: Mapping[str, Sequence[float]]) -> float:
    """Largest relative difference, over steps, between any algorithm's loss and the first's."""
    items = list(losses_by_algorithm.items())
    if len(items) < 2:
        return 0.0
    _, reference = items[0]
    worst = 0.0
    for algorithm, losses in items[1:]:
        if len(losses) != len(reference):
            raise LossMismatchError(
                f"algorithm {algorithm} logged {len(losses)} steps but {items[0][0]} logged "
                f"{len(reference)}: the runs did not train the same steps"
            )
        for a, b in zip(reference, losses, strict=True):
            if not (math.isfinite(a) and math.isfinite(b)):
                raise LossMismatchError(f"algorithm {algorithm}: a non-finite loss ({a}, {b})")
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    return worst


def check_same_losses(
    scheme: str, repeat: int, losses_by_algorithm: Mapping[str, Sequence[float]], rel_tol: float
) -> float:
    """Raise :class:`LossMismatchError` unless every algorithm's per-step losses agree within
    ``rel_tol``; returns the largest relative difference.

    Every algorithm trains the same layers on the same data in the same order; only which rank
    computes a layer differs. So the losses must agree to rounding, and a bigger difference means
    an algorithm changed the math (a lost optimizer state, a layer out of order), not the speed.
    """
    worst = max_loss_difference(losses_by_algorithm)
    if worst > rel_tol:
        raise LossMismatchError(
            f"{scheme}, repeat {repeat}: the algorithms' losses differ by {worst:.3g} (relative), "
            f"over the tolerance {rel_tol:g}: {', '.join(losses_by_algorithm)} did not train the "
            "same model; look at the runs' run.h5 'steps' tables to find the first step that "
            "differs"
        )
    return worst


def speedup(rows: Mapping[str, AlgorithmRow], fast: str, slow: str) -> Spread | None:
    """Throughput of ``fast`` over ``slow``: median over median, and the pessimistic and
    optimistic ends (min over max, max over min)."""
    if fast not in rows or slow not in rows:
        return None
    a, b = rows[fast].tokens_per_s, rows[slow].tokens_per_s
    return Spread(median=a.median / b.median, low=a.low / b.high, high=a.high / b.low)


def steady_speedup(rows: Mapping[str, AlgorithmRow], fast: str, slow: str) -> Spread | None:
    """:func:`speedup` over the steady state's tokens/s."""
    if fast not in rows or slow not in rows:
        return None
    a, b = rows[fast].steady_tokens_per_s, rows[slow].steady_tokens_per_s
    if a is None or b is None:
        return None
    return Spread(median=a.median / b.median, low=a.low / b.high, high=a.high / b.low)


def _steady_lines(rows: Mapping[str, Mapping[str, AlgorithmRow]]) -> list[str]:
    """The steady-state table: per scheme and (balancer, static split), the speedup, the
    ceiling over the static split (median over all of the scheme's runs) and the capture."""
    lines = [
        "",
        "Steady state (from each job's train.steady_state_step): speedup in tokens/s, median "
        "(min/max - max/min); ceiling = the best contiguous partition's simulated step over the "
        "static split's on the runs' steady-state costs (median over the scheme's runs); "
        "capture = (median speedup - 1) / (ceiling - 1).",
        "",
        "| scheme | balancer | static split | ramp speedup | steady speedup | ceiling | capture |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scheme, by_algorithm in rows.items():
        for d in rebalancing():
            for s in static_baselines():
                steady = steady_speedup(by_algorithm, d, s)
                if steady is None:
                    continue
                ceilings = [
                    r.steady_ceilings[s] for r in by_algorithm.values() if s in r.steady_ceilings
                ]
                ceiling = float(np.median(ceilings)) if ceilings else None
                got = None if ceiling is None else capture(steady.median, ceiling)
                ramp = _ramp_speedup(by_algorithm, d, s)
                lines.append(
                    f"| {scheme} | {algorithm_label(d)} | {algorithm_label(s)} | "
                    f"{'-' if ramp is None else f'{ramp:.2f}'} | {_fmt(steady, 2)} | "
                    f"{'-' if ceiling is None else f'{ceiling:.2f}'} | "
                    f"{'-' if got is None else f'{got:.2f}'} |"
                )
    return lines


def _ramp_speedup(rows: Mapping[str, AlgorithmRow], fast: str, slow: str) -> float | None:
    a, b = rows[fast].ramp_tokens_per_s, rows[slow].ramp_tokens_per_s
    return None if a is None or b is None else a.median / b.median


def _fmt(spread: Spread, digits: int = 0, scale: float = 1.0) -> str:
    med, low, high = spread.median * scale, spread.low * scale, spread.high * scale
    return f"{med:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def render_markdown(
    rows: Mapping[str, Mapping[str, AlgorithmRow]],
    loss_differences: Mapping[str, float],
    *,
    command: str,
    setting: str,
) -> str:
    """The ``results.md`` text: one table of algorithms, one of speedups (each rebalancing
    algorithm over each static baseline)."""
    dynamic, static = rebalancing(), static_baselines()
    lines = [
        "# dynmo-hpc bench",
        "",
        f"Command: `{command}`",
        "",
        setting,
        "",
        "Median over repeats, (min-max) in brackets. tokens/s = tokens / sum of step times, each "
        "step timed with its load report, decision and migration. Efficiency = tokens/s over the "
        "ideal from the run's own measured layer costs, (M + P - 1) / M x max(total / P, heaviest "
        "layer).",
        "",
        "| scheme | algorithm | tokens/s | train s | wall s | efficiency | moves | migration s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scheme, by_algorithm in rows.items():
        for algorithm, row in by_algorithm.items():
            lines.append(
                f"| {scheme} | {algorithm_label(algorithm)} | {_fmt(row.tokens_per_s)} | "
                f"{_fmt(row.train_s, 1)} | {_fmt(row.wall_s, 1)} | {_fmt(row.efficiency, 2)} | "
                f"{_fmt(row.num_moves)} | {_fmt(row.migration_s, 3)} |"
            )
    lines += [
        "",
        "Speedup in tokens/s: median / median (pessimistic min/max - optimistic max/min).",
        "",
        "| scheme | "
        + " | ".join(f"{d} / {s}" for d in dynamic for s in static)
        + " | max loss diff |",
        "| --- | " + " | ".join("---" for _ in dynamic for _ in static) + " | --- |",
    ]
    for scheme, by_algorithm in rows.items():
        cells = []
        for d in dynamic:
            for s in static:
                ratio = speedup(by_algorithm, d, s)
                cells.append("-" if ratio is None else _fmt(ratio, 2))
        lines.append(
            f"| {scheme} | {' | '.join(cells)} | {loss_differences.get(scheme, 0.0):.2g} |"
        )
    lines += _steady_lines(rows)
    return "\n".join(lines) + "\n"
