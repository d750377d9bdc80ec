"""One bench run's figures, from its run log: throughput, overheads, and the ideal it is held to.

Why from the run log and not from timers in the bench: the log is what a user has after any run,
so the figures in the table can be recomputed from the files the bench leaves behind.

The ideal is the fastest a 1F1B (or GPipe) pipeline could go on the measured per-layer costs ``c``
with ``P`` stages and ``M`` microbatches, whatever the partition::

    ideal_step_s = (M + P - 1) / M * max(sum(c) / P, max(c))

``sum(c) / P`` is a perfect split of the work; no stage can be lighter than its heaviest layer;
``(M + P - 1) / M`` is the pipeline's fill and drain. The costs are the profiler's compute seconds
per layer per step, so the ideal leaves out everything that is not layer compute (activation
transfers, the optimizer step, gradient clipping's all-reduce, the load reports): efficiency below
1 on a perfectly balanced run measures those overheads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd


def ideal_step_s(costs_s: Sequence[float], num_stages: int, num_microbatches: int) -> float:
    """The ideal step time (see the module docstring) for one cost vector, in seconds."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages={num_stages} and num_microbatches={num_microbatches} must be >= 1"
        )
    values = np.asarray(costs_s, dtype=np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError("costs_s must be a non-empty list of finite seconds >= 0")
    fill = (num_microbatches + num_stages - 1) / num_microbatches
    return float(fill * max(values.sum() / num_stages, values.max()))


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    """What one run measured."""

    steps: int
    tokens: int
    """Tokens trained on, over all steps."""
    train_s: float
    """Sum of the step times: every step's compute, load report, decision and migration."""
    wall_s: float
    """From launch to exit: also rank start-up, model build and the bandwidth probe."""
    tokens_per_s: float
    """``tokens / train_s``."""
    ideal_tokens_per_s: float
    """``tokens / sum of ideal step times`` over the run (each report's costs for its steps)."""
    num_moves: int
    """Layers migrated, over all migrations."""
    num_migrations: int
    migration_s: float
    """Seconds spent migrating (slowest rank per migration, summed)."""
    final_loss: float
    losses: list[float]
    steady_tokens_per_s: float = math.nan
    """Tokens/s over the steady state alone (steps from ``train.steady_state_step``)."""
    ramp_tokens_per_s: float = math.nan
    """Tokens/s over the ramp alone (the steps before it); NaN when it has no step."""
    steady_ceilings: dict[str, float] = field(default_factory=dict)
    """Per static baseline: the pipeline-aware ceiling over its split on this run's steady-state
    load reports (:mod:`dynmo_hpc.bench.ceiling`)."""

    @property
    def efficiency(self) -> float:
        """Measured over ideal throughput (1.0: as fast as the measured layer costs allow)."""
        return self.tokens_per_s / self.ideal_tokens_per_s


def ideal_train_s(
    layer_costs: pd.DataFrame, num_steps: int, num_stages: int, num_microbatches: int
) -> float:
    """Sum over steps of the ideal step time, each step priced with the load report covering it.

    A report at step ``s`` holds the mean costs of the steps since the previous report, so it
    covers those steps; steps after the last report (none in a completed run) use the last one.
    """
    if layer_costs.empty:
        raise ValueError("the run log has no load reports: cannot compute the ideal")
    costs = layer_costs.assign(cost_s=layer_costs["forward_s"] + layer_costs["backward_s"])
    ideal_by_report = {
        int(step): ideal_step_s(
            group.sort_values("layer")["cost_s"].tolist(), num_stages, num_microbatches
        )
        for step, group in costs.groupby("step")
    }
    total_s, previous = 0.0, -1
    for step in sorted(ideal_by_report):
        last = min(step, num_steps - 1)
        total_s += max(0, last - previous) * ideal_by_report[step]
        previous = max(previous, last)
    total_s += (num_steps - 1 - previous) * ideal_by_report[max(ideal_by_report)]
    return total_s


def run_figures(
    *,
    steps: pd.DataFrame,
    layer_costs: pd.DataFrame,
    events: pd.DataFrame,
    tokens_per_step: int,
    num_stages: int,
    num_microbatches: int,
    wall_s: float,
    steady_from_step: int | None = None,
    steady_ceilings: dict[str, float] | None = None,
) -> RunFigures:
    """The figures of one run from its run log tables (see :class:`~dynmo_hpc.runlog.RunLog`);
    ``steady_from_step``: the first step of the steady state (None: half the run)."""
    ordered = steps.sort_values("step")
    num_steps = len(ordered)
    if num_steps == 0:
        raise ValueError("the run log has no steps: the run did not train")
    train_s = float(ordered["step_time_s"].sum())
    tokens = tokens_per_step * num_steps
    ideal_s = ideal_train_s(layer_costs, num_steps, num_stages, num_microbatches)
    migrations = events[events["kind"] == "migrate"]
    details = list(migrations["detail"])
    losses = [float(v) for v in ordered["loss"]]
    first = num_steps // 2 if steady_from_step is None else steady_from_step
    return RunFigures(
        steps=num_steps,
        tokens=tokens,
        train_s=train_s,
        wall_s=wall_s,
        tokens_per_s=tokens / train_s,
        ideal_tokens_per_s=tokens / ideal_s,
        num_moves=sum(int(d.get("num_moves", 0)) for d in details),
        num_migrations=len(details),
        migration_s=sum(float(d.get("seconds", 0.0)) for d in details),
        final_loss=losses[-1],
        losses=losses,
        steady_tokens_per_s=_phase_tokens_per_s(ordered, tokens_per_step, first, num_steps),
        ramp_tokens_per_s=_phase_tokens_per_s(ordered, tokens_per_step, 0, first),
        steady_ceilings=dict(steady_ceilings or {}),
    )


def _phase_tokens_per_s(ordered: pd.DataFrame, tokens_per_step: int, first: int, end: int) -> float:
    """Tokens/s over steps ``first .. end - 1`` (NaN when there is none)."""
    rows = ordered[(ordered["step"] >= first) & (ordered["step"] < end)]
    seconds = float(rows["step_time_s"].sum())
    return tokens_per_step * len(rows) / seconds if len(rows) and seconds > 0 else math.nan
