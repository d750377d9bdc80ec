"""The bench's files: ``results.h5`` (every run and every row) and ``results.png`` (the chart).

Why HDF5 as well as the Markdown table: the table is for reading, the file is for re-analysis
(every repeat's figures, not only the medians). Both files are written to a temporary name and
renamed, so an interrupted bench never leaves a half-written result under the real name.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dynmo_hpc.atomic_io import atomic_write_bytes
from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.bench.ab_summary import ABRow, ABRunFigures, best_baselines
from dynmo_hpc.bench.algorithms import PlannedRun
from dynmo_hpc.bench.measure import RunFigures
from dynmo_hpc.bench.summary import AlgorithmRow, algorithm_label

RUN_COLUMNS = (
    "tokens_per_s",
    "ideal_tokens_per_s",
    "train_s",
    "wall_s",
    "num_moves",
    "num_migrations",
    "migration_s",
    "final_loss",
)


def write_results_h5(
    path: Path,
    runs: Sequence[tuple[PlannedRun, RunFigures]],
    rows: Mapping[str, Mapping[str, AlgorithmRow]],
    attrs: Mapping[str, str | int | float],
) -> None:
    """``/runs`` (one entry per run, in the order they ran) and ``/rows`` (medians, min, max)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            group = f.create_group("runs")
            text = h5py.string_dtype()
            group.create_dataset("scheme", data=[r.scheme for r, _ in runs], dtype=text)
            # "policy": the field's name in results.h5 files already written (the algorithm).
            group.create_dataset("policy", data=[r.algorithm for r, _ in runs], dtype=text)
            group.create_dataset("repeat", data=np.array([r.repeat for r, _ in runs]))
            for column in RUN_COLUMNS:
                values = [float(getattr(fig, column)) for _, fig in runs]
                group.create_dataset(column, data=np.array(values, dtype=np.float64))
            losses = f.create_group("losses")
            for planned, fig in runs:
                losses.create_dataset(planned.name, data=np.array(fig.losses, dtype=np.float64))
            table = f.create_group("rows")
            flat = [row for by_algorithm in rows.values() for row in by_algorithm.values()]
            table.create_dataset("scheme", data=[r.scheme for r in flat], dtype=text)
            table.create_dataset("policy", data=[r.algorithm for r in flat], dtype=text)
            for field in ("tokens_per_s", "train_s", "wall_s", "efficiency", "migration_s"):
                for stat in ("median", "low", "high"):
                    values = [getattr(getattr(r, field), stat) for r in flat]
                    table.create_dataset(f"{field}_{stat}", data=np.array(values, dtype=np.float64))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_chart(path: Path, rows: Mapping[str, Mapping[str, AlgorithmRow]]) -> None:
    """A grouped bar chart: tokens/s per scheme, one bar per algorithm, min-max as error bars."""
    schemes = list(rows)
    algorithms = [p for p in ALGORITHMS if any(p in by_algorithm for by_algorithm in rows.values())]
    figure = Figure(figsize=(max(6.0, 1.4 * len(schemes) + 2.0), 4.0))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(algorithms))
    for k, algorithm in enumerate(algorithms):
        xs, medians, errors_low, errors_high = [], [], [], []
        for i, scheme in enumerate(schemes):
            row = rows[scheme].get(algorithm)
            if row is None:
                continue
            xs.append(i + (k - (len(algorithms) - 1) / 2) * width)
            medians.append(row.tokens_per_s.median)
            errors_low.append(row.tokens_per_s.median - row.tokens_per_s.low)
            errors_high.append(row.tokens_per_s.high - row.tokens_per_s.median)
        ax.bar(
            xs,
            medians,
            width,
            yerr=[errors_low, errors_high],
            capsize=2,
            label=algorithm_label(algorithm),
        )
    _finish_chart(
        figure,
        ax,
        path,
        schemes,
        "tokens/s (median, min-max)",
        "dynmo-hpc bench: throughput per scheme and algorithm",
    )


def write_ab_results_h5(
    path: Path,
    runs: Sequence[tuple[str, ABRunFigures]],
    rows: Sequence[ABRow],
    attrs: Mapping[str, str | int | float],
) -> None:
    """``/runs/<name>``: each A/B run's steps (step, arm, step time, wall/CPU ratio, kept) and
    losses; ``/rows``: one entry per table row (gain, its spread, ceiling, capture, kept;
    ``runs_of``: the static baseline whose runs a shared split reports, else empty); ``/best``:
    one entry per headline line, the balancer against the best static baseline
    (:func:`_best_h5`)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            for key, value in attrs.items():
                f.attrs[key] = value
            for name, fig in runs:
                group = f.create_group(f"runs/{name}")
                for column in ("step", "ab_arm", "step_time_s", "wall_s_per_cpu_s", "kept"):
                    group.create_dataset(column, data=fig.marked[column].to_numpy())
                group.create_dataset("loss", data=np.array(fig.losses, dtype=np.float64))
            _ab_rows_h5(f.create_group("rows"), rows)
            _best_h5(f.create_group("best"), rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _ab_rows_h5(table: h5py.Group, rows: Sequence[ABRow]) -> None:
    text = h5py.string_dtype()
    for column in ("scheme", "static", "balancer", "phase", "runs_of"):
        table.create_dataset(column, data=[getattr(r, column) for r in rows], dtype=text)
    nan = float("nan")
    columns: dict[str, list[float]] = {
        "gain": [], "gain_q25": [], "gain_q75": [], "ceiling": [], "capture": [],
        "static_step_s": [], "dynmo_step_s": [], "kept_static": [], "kept_dynmo": [],
    }  # fmt: skip
    for r in rows:
        c = r.comparison
        low, high = c.spread if c else (nan, nan)
        values = {
            "gain": c.gain if c else nan,
            "gain_q25": low,
            "gain_q75": high,
            "ceiling": nan if r.ceiling is None else r.ceiling,
            "capture": nan if r.capture is None else r.capture,
            "static_step_s": c.static_step_s if c else nan,
            "dynmo_step_s": c.dynmo_step_s if c else nan,
            "kept_static": float(c.kept[0]) if c else 0.0,
            "kept_dynmo": float(c.kept[1]) if c else 0.0,
        }
        for key, value in values.items():
            columns[key].append(value)
    for key, values in columns.items():
        table.create_dataset(key, data=np.array(values, dtype=np.float64))


def _best_h5(table: h5py.Group, rows: Sequence[ABRow]) -> None:
    """Per (scheme, phase, balancer), as the headline: ``scheme``, ``phase``, ``balancer``,
    ``first_step`` and ``end_step`` (the phase's steps), ``static`` (the best static baseline;
    empty where none has a comparison), ``tied`` (the baselines tied with it, comma-separated),
    ``static_tokens_per_s`` and ``dynmo_tokens_per_s`` (its A/B runs' arms), ``gain``,
    ``gain_q25``, ``gain_q75``, ``ceiling`` and ``capture`` over it (NaN where unknown), and
    ``tokens_per_s/<static baseline>``: each static baseline's arm A in its own runs against
    the balancer (NaN: none in that phase)."""
    text = h5py.string_dtype()
    best = best_baselines(rows)
    keys = list(best)
    for k, column in enumerate(("scheme", "phase")):
        table.create_dataset(column, data=[key[k] for key in keys], dtype=text)
    table.create_dataset("balancer", data=[key[3] for key in keys], dtype=text)
    table.create_dataset("first_step", data=np.array([key[2][0] for key in keys], dtype=np.int64))
    table.create_dataset("end_step", data=np.array([key[2][1] for key in keys], dtype=np.int64))
    chosen = [best[key] for key in keys]
    table.create_dataset("static", data=[b.static if b else "" for b in chosen], dtype=text)
    table.create_dataset("tied", data=[",".join(b.tied) if b else "" for b in chosen], dtype=text)
    nan = float("nan")

    def figure(value: float | None) -> float:
        return nan if value is None else float(value)

    columns: dict[str, list[float]] = {
        "static_tokens_per_s": [], "dynmo_tokens_per_s": [], "gain": [], "gain_q25": [],
        "gain_q75": [], "ceiling": [], "capture": [],
    }  # fmt: skip
    for b in chosen:
        c = b.row.comparison if b else None
        low, high = c.spread if c else (nan, nan)
        values = {
            "static_tokens_per_s": figure(b.row.static_tokens_per_s if b else None),
            "dynmo_tokens_per_s": figure(b.row.dynmo_tokens_per_s if b else None),
            "gain": c.gain if c else nan,
            "gain_q25": low,
            "gain_q75": high,
            "ceiling": figure(b.row.ceiling if b else None),
            "capture": figure(b.row.capture if b else None),
        }
        for key, value in values.items():
            columns[key].append(value)
    for key, values in columns.items():
        table.create_dataset(key, data=np.array(values, dtype=np.float64))
    speeds = table.create_group("tokens_per_s")
    for static in dict.fromkeys(r.static for r in rows):
        values = [figure(b.static_tokens_per_s.get(static)) if b else nan for b in chosen]
        speeds.create_dataset(static, data=np.array(values, dtype=np.float64))


def write_ab_chart(path: Path, rows: Sequence[ABRow]) -> None:
    """Steady-state gain per scheme, one bar per (static split, balancer), the IQR as error
    bars and the ceiling as a tick above each bar; a static baseline that reports another's
    runs (the same split) has no bars of its own."""
    steady = [r for r in rows if r.phase == "steady" and not r.runs_of]  # no shared split twice
    schemes = list(dict.fromkeys(r.scheme for r in steady))
    pairs = list(dict.fromkeys((r.static, r.balancer) for r in steady))
    figure = Figure(figsize=(max(6.0, 1.4 * len(schemes) + 2.0), 4.0))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(pairs))
    for k, pair in enumerate(pairs):
        xs, gains, low, high, ceil_x, ceilings = [], [], [], [], [], []
        for i, scheme in enumerate(schemes):
            row = next(
                (r for r in steady if r.scheme == scheme and (r.static, r.balancer) == pair), None
            )
            if row is None:
                continue
            x = i + (k - (len(pairs) - 1) / 2) * width
            if row.comparison is not None:
                q25, q75 = row.comparison.spread
                xs.append(x)
                gains.append(row.comparison.gain)
                low.append(max(0.0, row.comparison.gain - q25))
                high.append(max(0.0, q75 - row.comparison.gain))
            if row.ceiling is not None:
                ceil_x.append(x)
                ceilings.append(row.ceiling)
        label = f"{algorithm_label(pair[1])} / {algorithm_label(pair[0])}"
        bars = ax.bar(xs, gains, width, yerr=[low, high], capsize=2, label=label)
        ax.scatter(
            ceil_x,
            ceilings,
            marker="_",
            s=200,
            color=bars.patches[0].get_facecolor() if bars.patches else None,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    _finish_chart(
        figure,
        ax,
        path,
        schemes,
        "steady-state gain (IQR); tick: ceiling",
        "dynmo-hpc bench --ab: balancer over static split, same run",
    )


def _finish_chart(
    figure: Figure, ax: Any, path: Path, schemes: list[str], ylabel: str, title: str
) -> None:
    """Label a per-scheme bar chart and write it as a PNG, atomically."""
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
