"""``dynmo-hpc report RUN.h5``: a text summary and PNG figures from one run log.

Why from the file alone: the report must work on a finished run, a running one and a crashed one,
on any machine, without the job config or the code that ran. Numbers come from
:mod:`dynmo_hpc.runlog.metrics`, so the text and the figures cannot disagree. Figures are built on
``matplotlib.figure.Figure`` with the Agg canvas, never pyplot, so no global state or display.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dynmo_hpc.runlog import RunLog, load, metrics, schema

log = logging.getLogger(__name__)

DEFAULT_WINDOW_STEPS = 20
"""Steps on each side of an event over which its effect is measured (medians)."""

EVENT_GID = "event"
"""``gid`` of the vertical event markers, so they can be told from data lines."""


@dataclass(frozen=True)
class ReportResult:
    """What :func:`write_report` wrote."""

    summary: str
    """The text summary (also in ``summary_path``)."""
    out_dir: Path
    """The directory holding everything below."""
    summary_path: Path
    """``<out_dir>/summary.txt``."""
    png_paths: dict[str, Path]
    """Figure name -> PNG path, in the order of :data:`FIGURES`."""


# -- text --------------------------------------------------------------------------------------


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _change(before: float, after: float) -> str:
    if math.isnan(before) or math.isnan(after) or before == 0:
        return ""
    return f" ({(after - before) / before:+.1%})"


def _header(run: RunLog, steps: pd.DataFrame) -> list[str]:
    a = run.attrs
    meta = {k: v for k, v in a.items() if k not in schema.ROOT_ATTRS}
    last = f"step {int(steps['step'].iloc[-1])}" if len(steps) else "no steps"
    status = run.end_status
    lines = [
        f"Run log {run.path}",
        f"  dynmo_hpc {a.get('package_version')}, schema {a.get('schema_version')}, "
        f"started {a.get('start_time_utc')} on {a.get('hostname')} (pid {a.get('pid')})",
    ]
    if meta:
        shown = {k: str(v) if len(str(v)) <= 60 else str(v)[:57] + "..." for k, v in meta.items()}
        lines.append("  " + ", ".join(f"{k}: {v}" for k, v in sorted(shown.items())))
    if status is None:
        lines.append(
            f"  status: NOT CLOSED (crashed, killed or still running); rows up to the last "
            f"flush ({last})"
        )
    else:
        lines.append(f"  status: closed ({status}) at {last}")
    return lines


def _throughput(steps: pd.DataFrame, imb: pd.DataFrame) -> list[str]:
    if steps.empty:
        return ["Steps: none logged"]
    windows = metrics.throughput_windows(steps, imb)
    lines = [
        f"Steps: {len(steps)} ({int(steps['step'].iloc[0])}..{int(steps['step'].iloc[-1])}) "
        f"over {steps['wall_s'].iloc[-1]:.1f} s; loss {steps['loss'].iloc[0]:.4g} -> "
        f"{steps['loss'].iloc[-1]:.4g}",
        f"Throughput over time: median {steps['tokens_per_s'].median():.0f} tokens/s",
        f"  {'steps':>13} {'wall_s':>9} {'tokens/s':>10} {'imbalance':>9} {'loss':>9} "
        f"{'stages':>6} {'ranks':>5} {'nodes':>5}",
    ]
    for w in windows.itertuples(index=False):
        lines.append(
            f"  {f'{w.first_step}-{w.last_step}':>13} {w.wall_s:9.1f} {w.tokens_per_s:10.0f} "
            f"{_fmt(w.imbalance, '9.3f'):>9} {w.loss:9.4g} {w.num_stages:6d} {w.num_ranks:5d} "
            f"{w.num_nodes:5d}"
        )
    return lines


def _validation(run: RunLog) -> list[str]:
    """The first and last validation losses (``eval`` table, non-empty)."""
    first, last = run.eval.iloc[0], run.eval.iloc[-1]
    return [
        f"Validation: {len(run.eval)} passes; loss {first['loss']:.4g} (step "
        f"{int(first['step'])}) -> {last['loss']:.4g} (step {int(last['step'])})"
    ]


def _imbalance(imb: pd.DataFrame, run: RunLog, window_steps: int) -> list[str]:
    if imb.empty:
        return ["Imbalance: no stage times logged"]
    worst = imb.loc[imb["imbalance"].idxmax()]
    lines = [
        "Imbalance (max / mean stage compute time per step): "
        f"median {imb['imbalance'].median():.3f}; first {imb['imbalance'].iloc[0]:.3f} "
        f"(step {int(imb['step'].iloc[0])}); last {imb['imbalance'].iloc[-1]:.3f} "
        f"(step {int(imb['step'].iloc[-1])}); worst {worst['imbalance']:.3f} "
        f"(step {int(worst['step'])})",
        f"Stage times (median over the last {window_steps} steps with stage times):",
    ]
    stage_times = metrics.per_stage(metrics.last_logged(run.stage_times))
    recent = stage_times[stage_times["step"].isin(imb["step"].tail(window_steps))]
    for stage, group in recent.groupby("stage"):
        lines.append(
            f"  stage {stage}: compute {group['compute_s'].median():.4f} s, "
            f"idle {group['idle_s'].median():.4f} s"
        )
    return lines


def _partitions(run: RunLog) -> list[str]:
    steps, _ = metrics.layer_stage_map(run.partitions)
    if not len(steps):
        return ["Load reports: none logged"]
    lines = [f"Load reports: {len(steps)} (steps {steps[0]}..{steps[-1]}); partition in force:"]
    previous: list[int] | None = None
    for step in steps:
        parts = run.parts_at(int(step))
        if parts != previous:
            lines.append(f"  from step {step}: parts {parts}")
        previous = parts
    return lines


def _restarts(run: RunLog) -> list[str]:
    """One line per resume: where it continued from, how long the restore took, what was redone."""
    restarts = run.restarts
    if restarts.empty:
        return [f"Restarts: none ({len(run.steps)} steps in one launch)"]
    lines = [f"Restarts: {len(restarts)} (the run log holds {len(restarts) + 1} segments)"]
    for r in restarts.itertuples(index=False):
        restore = "" if r.restore_s is None else f" in {r.restore_s:.2f} s"
        stages = "" if r.num_stages is None else f" on {r.num_stages} stages"
        source = f" from {r.checkpoint}" if r.checkpoint else ""
        lines.append(
            f"  segment {r.segment}: resumed after step {r.step}{source}{restore}{stages}; "
            f"{r.superseded_rows} redone step rows marked superseded"
        )
    return lines


def _resizes(run: RunLog, steps: pd.DataFrame) -> list[str]:
    """Every pack with its phases and predicted vs measured throughput; resources used."""
    hours = metrics.resource_hours(steps)
    lines = []
    resizes = run.events[run.events["kind"] == "resize"]
    results = run.events[run.events["kind"] == "pack_result"]
    if resizes.empty:
        lines.append("Resizes: none")
    else:
        lines.append(f"Resizes: {len(resizes)}")
    for _, event in resizes.iterrows():
        d = event["detail"]
        after = results[results["step"] > event["step"]]
        measured = after["detail"].iloc[0]["measured_tokens_per_s"] if len(after) else None
        size = f"{d['from_stages']} -> {d['to_stages']} stages"
        if d.get("from_replicas", 1) != 1 or d.get("to_replicas", 1) != 1:
            size = (
                f"{d['from_replicas']} x {d['from_stages']} -> {d['to_replicas']} x "
                f"{d['to_stages']} (replicas x stages)"
            )
        lines.append(
            f"  after step {event['step'] + 1}: {size}, "
            f"{d.get('from_nodes')} -> {d.get('to_nodes')} nodes, {d['total_s']:.2f} s "
            f"(checkpoint {d['checkpoint_s']:.2f}, step exit {d['step_exit_s']:.2f}, shrink "
            f"{d['shrink_s']:.2f}, relaunch {d['relaunch_s']:.2f}, restore {d['restore_s']:.2f})"
        )
        lines.append(
            f"      tokens/s before {_fmt(d.get('measured_tokens_per_s_before'), '.0f')} measured; "
            f"after {_fmt(d.get('predicted_tokens_per_s_after'), '.0f')} predicted, "
            f"{_fmt(measured, '.0f')} measured"
        )
    lines.append(
        f"Resources: {hours['node_hours']:.4f} node-hours and {hours['rank_hours']:.4f} "
        f"rank-hours used, against {hours['first_node_hours']:.4f} and "
        f"{hours['first_rank_hours']:.4f} holding the first allocation throughout"
    )
    return lines


def _events(run: RunLog, steps: pd.DataFrame, imb: pd.DataFrame, window_steps: int) -> list[str]:
    if run.events.empty:
        return ["Events: none"]
    effects = metrics.event_effects(steps, imb, run.events, window_steps=window_steps)
    lines = [
        f"Events ({len(effects)}); effect = medians over up to {window_steps} steps "
        "up to the event -> after it:"
    ]
    for e in effects.itertuples(index=False):
        detail = json.dumps(e.detail, sort_keys=True)
        if len(detail) > 160:
            detail = detail[:157] + "..."
        if e.kind == schema.END_EVENT_KIND:  # the writer closing: nothing to measure
            lines.append(f"  step {e.step} {e.kind}: {detail}")
            continue
        change = _change(e.tokens_per_s_before, e.tokens_per_s_after)
        lines.append(
            f"  step {e.step} {e.kind}: tokens/s {_fmt(e.tokens_per_s_before, '.0f')} -> "
            f"{_fmt(e.tokens_per_s_after, '.0f')}{change}"
            f"; imbalance {_fmt(e.imbalance_before, '.3f')} -> {_fmt(e.imbalance_after, '.3f')}"
            f"; ranks {_fmt(e.num_ranks_before, '.0f')} -> {_fmt(e.num_ranks_after, '.0f')}"
            f"; nodes {_fmt(e.num_nodes_before, '.0f')} -> {_fmt(e.num_nodes_after, '.0f')}"
        )
        lines.append(f"      detail {detail}")
    return lines


def summarize(run: RunLog, *, window_steps: int = DEFAULT_WINDOW_STEPS) -> str:
    """The text summary: header, throughput, validation, imbalance, partitions, restarts,
    events + effects."""
    steps = metrics.last_logged(run.steps)
    imb = metrics.imbalance(run.stage_times)
    sections = [
        _header(run, steps),
        _throughput(steps, imb),
        *([_validation(run)] if not run.eval.empty else []),
        _imbalance(imb, run, window_steps),
        _partitions(run),
        _restarts(run),
        _resizes(run, steps),
        _events(run, steps, imb, window_steps),
    ]
    return "\n".join("\n".join(section) for section in sections) + "\n"


# -- figures -----------------------------------------------------------------------------------


def _figure(title: str, ylabel: str, xlabel: str = "step") -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig, ax


def _mark_events(ax: Any, events: pd.DataFrame) -> None:
    shown = events[events["kind"] != schema.END_EVENT_KIND] if len(events) else events
    for event in shown.itertuples(index=False):
        ax.axvline(event.step, color="0.5", linestyle="--", linewidth=0.8, gid=EVENT_GID)
        if len(shown) <= 20:
            ax.annotate(
                event.kind,
                (event.step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="0.4",
            )


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes)


def plot_stage_compute(run: RunLog) -> Figure:
    """One line per stage: its compute seconds at each step (gaps where the stage did not exist)."""
    fig, ax = _figure("Stage compute time per step", "compute time (s)")
    stage_times = metrics.per_stage(metrics.last_logged(run.stage_times))
    if stage_times.empty:
        _no_data(ax, "stage times")
        return fig
    table = stage_times.pivot(index="step", columns="stage", values="compute_s")
    for stage in table.columns:
        ax.plot(table.index, table[stage], label=f"stage {stage}", linewidth=1)
    _mark_events(ax, run.events)
    ax.legend(fontsize=7, ncols=max(1, len(table.columns) // 8))
    return fig


def plot_layer_stage_map(run: RunLog) -> Figure:
    """Heatmap: x = load report step, y = global layer, colour = the stage that holds the layer."""
    fig, ax = _figure("Layer-to-stage map at each load report", "global layer", "load report step")
    report_steps, owner = metrics.layer_stage_map(run.partitions)
    if not len(report_steps):
        _no_data(ax, "load reports")
        return fig
    x = report_steps.astype(float)
    gaps = np.diff(x) if len(x) > 1 else np.array([1.0])
    x_edges = np.concatenate([[x[0] - gaps[0] / 2], x[:-1] + gaps / 2, [x[-1] + gaps[-1] / 2]])
    y_edges = np.arange(owner.shape[0] + 1) - 0.5
    num_stages = int(np.nanmax(owner)) + 1
    cmap = matplotlib.colormaps["tab10" if num_stages <= 10 else "viridis"].resampled(num_stages)
    mesh = ax.pcolormesh(
        x_edges,
        y_edges,
        np.ma.masked_invalid(owner),
        cmap=cmap,
        vmin=-0.5,
        vmax=num_stages - 0.5,
    )
    fig.colorbar(mesh, ax=ax, label="stage", ticks=range(num_stages))
    ax.set_ylim(owner.shape[0] - 0.5, -0.5)  # layer 0 at the top, like a pipeline drawing
    return fig


def plot_imbalance(run: RunLog) -> Figure:
    """Max / mean stage compute time per step; 1.0 is a perfect balance."""
    fig, ax = _figure("Imbalance (max / mean stage compute time)", "imbalance")
    imb = metrics.imbalance(run.stage_times)
    if imb.empty:
        _no_data(ax, "stage times")
        return fig
    ax.axhline(1.0, color="0.7", linewidth=0.8, gid="reference")
    ax.plot(imb["step"], imb["imbalance"], label="imbalance", linewidth=1)
    _mark_events(ax, run.events)
    return fig


def plot_tokens_per_s(run: RunLog) -> Figure:
    """Tokens per second at each step."""
    fig, ax = _figure("Throughput", "tokens/s")
    steps = metrics.last_logged(run.steps)
    if steps.empty:
        _no_data(ax, "steps")
        return fig
    ax.plot(steps["step"], steps["tokens_per_s"], label="tokens/s", linewidth=1)
    _mark_events(ax, run.events)
    ax.set_ylim(bottom=0)
    return fig


def plot_loss(run: RunLog) -> Figure:
    """Training loss at each step, and the validation loss (``eval`` table) beside it."""
    fig, ax = _figure("Loss", "cross-entropy (nats)")
    steps = metrics.last_logged(run.steps)
    if steps.empty:
        _no_data(ax, "steps")
        return fig
    ax.plot(steps["step"], steps["loss"], label="training", linewidth=1)
    if not run.eval.empty:
        ax.plot(run.eval["step"], run.eval["loss"], "o-", label="validation", linewidth=1.5)
    _mark_events(ax, run.events)
    ax.legend(fontsize=8)
    return fig


def plot_resources(run: RunLog) -> Figure:
    """Ranks and nodes the job held at each step (a change of either shows as a step)."""
    fig, ax = _figure("Resources held", "count")
    steps = metrics.last_logged(run.steps)
    if steps.empty:
        _no_data(ax, "steps")
        return fig
    styles = (
        ("num_ranks", "ranks", {"linewidth": 3.0, "alpha": 0.6}),
        ("num_nodes", "nodes", {"linewidth": 1.5}),
        ("num_stages", "stages", {"linewidth": 1.2, "linestyle": ":"}),
    )
    for column, label, style in styles:
        ax.plot(steps["step"], steps[column], label=label, drawstyle="steps-post", **style)
    _mark_events(ax, run.events)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    return fig


def plot_nodes_and_throughput(run: RunLog) -> Figure:
    """Nodes and ranks held over wall time, beside tokens/s: what packing gave back, and what
    it cost in throughput."""
    fig, ax = _figure("Resources held and throughput", "held", "wall time (s)")
    steps = metrics.last_logged(run.steps)
    if steps.empty:
        _no_data(ax, "steps")
        return fig
    ax.xaxis.set_major_locator(MaxNLocator())
    ax.plot(steps["wall_s"], steps["num_nodes"], label="nodes", drawstyle="steps-post", lw=2)
    ax.plot(steps["wall_s"], steps["num_ranks"], label="ranks", drawstyle="steps-post", ls="--")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    right = ax.twinx()
    right.plot(steps["wall_s"], steps["tokens_per_s"], color="tab:green", lw=0.8, label="tokens/s")
    right.set_ylabel("tokens/s")
    right.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8, loc="lower left")
    return fig


FIGURES = {
    "stage_compute": plot_stage_compute,
    "layer_stage_map": plot_layer_stage_map,
    "imbalance": plot_imbalance,
    "tokens_per_s": plot_tokens_per_s,
    "loss": plot_loss,
    "resources": plot_resources,
    "nodes_throughput": plot_nodes_and_throughput,
}
"""Figure name (PNG file stem) -> function drawing it from a :class:`RunLog`."""


def write_report(
    path: str | Path,
    out_dir: str | Path | None = None,
    *,
    window_steps: int = DEFAULT_WINDOW_STEPS,
    dpi: int = 110,
) -> ReportResult:
    """Load ``path`` and write ``summary.txt`` and one PNG per figure into ``out_dir``.

    ``out_dir`` defaults to ``<directory of path>/report``.
    """
    run = load(path)
    out = Path(out_dir) if out_dir is not None else Path(path).parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run, window_steps=window_steps)
    summary_path = out / "summary.txt"
    summary_path.write_text(summary)
    png_paths: dict[str, Path] = {}
    for name, draw in FIGURES.items():
        png_paths[name] = out / f"{name}.png"
        draw(run).savefig(png_paths[name], dpi=dpi)
    log.info("report for %s written to %s", path, out)
    return ReportResult(
        summary=summary, out_dir=out, summary_path=summary_path, png_paths=png_paths
    )
