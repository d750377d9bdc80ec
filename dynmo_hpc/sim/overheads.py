"""Where a measured step's time goes, and the overhead constants fitted from that.

Why: to predict a step, the simulator needs the terms the layer costs leave out
(:mod:`dynmo_hpc.sim.machine`). Each run log already holds, per step and stage, the wall seconds
in layers (``compute_s``) and waiting on receives (``idle_s``); what is left of the step,
``step_time_s - compute_s - idle_s``, is everything else. Stage 0 runs the step's last action
under both schedules (the last backward), so its remainder is the work outside the layers that
delays the step: its own actions' overheads, then the optimizer of the slowest stage, the
clipping all-reduce and the gather (:meth:`~dynmo_hpc.sim.machine.Overheads.stage_tail_s`), and
on report steps the load report. In CPU seconds (divided by the step's measured wall-per-CPU
ratio ``k``)::

    rest_0 / k = 2 M x action_s + step_s + optimizer_s_per_param x max stage parameters

which :func:`fit_overheads` solves by least squares over several runs with different M, after
the optimizer term (measured on its own) is taken off. The runs it fits on are never the run
then predicted: ``benchmarks/calibrate_sim.py`` leaves each one out in turn.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynmo_hpc.balance import ALGORITHMS, INITIAL_ALGORITHM, STATIC
from dynmo_hpc.runlog import RunLog
from dynmo_hpc.sim.machine import Overheads
from dynmo_hpc.sim.runlog_traces import measured_wall_s_per_cpu_s


def replayed_algorithm(balance_algorithm: str) -> str | None:
    """What :func:`~dynmo_hpc.sim.replay.replay` re-enacts a run's ``balance.algorithm`` with:
    ``static`` keeps the trainer's initial split (:data:`~dynmo_hpc.balance.INITIAL_ALGORITHM`),
    a rebalancing algorithm is itself; None for a static baseline run as the trainer's balancer
    (the replay would start it at its own split, the trainer does not)."""
    if balance_algorithm == STATIC:
        return INITIAL_ALGORITHM
    entry = ALGORITHMS.get(balance_algorithm)
    return balance_algorithm if entry is not None and entry.rebalances else None


@dataclass(frozen=True, kw_only=True)
class RunDecomposition:
    """One run's measured step, split per stage (medians over steps; seconds)."""

    name: str
    num_stages: int
    num_microbatches: int
    schedule: str
    algorithm: str
    """The replayed algorithm equivalent to the run's ``balance.algorithm``."""
    step_s: float
    """Median measured step (all steps, report steps included)."""
    compute_s: list[float]
    """Per stage: wall seconds in layers."""
    layer_cpu_s: list[float]
    """Per stage: thread CPU seconds in layers (the load reports' costs)."""
    idle_s: list[float]
    """Per stage: wall seconds waiting on receives."""
    rest_s: list[float]
    """Per stage: step - compute - idle on steps without a load report."""
    report_extra_s: float
    """Stage 0's remainder on report steps minus on the others (the load report's wall time)."""
    wall_s_per_cpu_s: float
    """Median over the run's steps of the measured wall-per-CPU ratio."""
    stage_params: list[int]
    """Parameters per stage, at the first report."""
    rest_cpu_s: float
    """Stage 0's remainder on steps without a report, in CPU seconds (median of each step's
    rest / its ratio)."""
    report_cpu_s: float
    """``report_extra_s`` in CPU seconds."""


def _interval_of(steps: Sequence[int], report_steps: Sequence[int]) -> list[int]:
    """Per step, the index of the report that covers it (the first report at or after it)."""
    return [int(np.searchsorted(np.asarray(report_steps), s)) for s in steps]


def _step_ratios(run: RunLog, report_steps: list[int], name: str) -> dict[int, float]:
    """Each step's measured wall-per-CPU ratio, by step (ValueError when an interval has no
    stage times)."""
    per_step = measured_wall_s_per_cpu_s(run, report_steps)
    if any(k is None for k in per_step):
        raise ValueError(f"{name}: a report interval has no stage times")
    times = run.stage_times
    step_k: dict[int, float] = {}  # in the order measured_wall_s_per_cpu_s gives them
    previous = -1
    for report_step, ratios in zip(report_steps, per_step, strict=True):
        covered = sorted(int(s) for s in times["step"].unique() if previous < s <= report_step)
        step_k.update(zip(covered, ratios or [], strict=True))
        previous = report_step
    return step_k


def decompose(run: RunLog, name: str) -> RunDecomposition:
    """Split ``run``'s measured steps into layers, waits and the rest, stage by stage."""
    cfg_pipeline, cfg_train = run.config["pipeline"], run.config["train"]
    balance_algorithm = str(run.config["balance"]["algorithm"])
    algorithm = replayed_algorithm(balance_algorithm)
    if algorithm is None:
        raise ValueError(
            f"{name}: balance.algorithm={balance_algorithm!r} has no replayed equivalent"
        )
    report_steps = run.report_steps()
    if not report_steps:
        raise ValueError(f"{name}: no load reports")
    step_k = _step_ratios(run, report_steps, name)
    steps = run.steps.set_index("step")["step_time_s"]
    times = run.stage_times
    costs = run.layer_costs
    covering = dict(zip(steps.index, _interval_of(list(steps.index), report_steps), strict=True))
    num_stages = int(cfg_pipeline["num_stages"])
    compute, cpu, idle, rest = [], [], [], []
    first_rest: dict[int, float] = {}
    for stage in range(num_stages):
        rows = times[times["stage"] == stage].set_index("step")
        layer_cpu = []
        for step in rows.index:
            report_step = report_steps[min(covering[step], len(report_steps) - 1)]
            parts = run.parts_at(report_step)
            report = costs[costs["step"] == report_step].sort_values("layer")
            both = (report["forward_s"] + report["backward_s"]).to_numpy()
            layer_cpu.append(float(both[parts[stage] : parts[stage + 1]].sum()))
        remainder = steps.loc[rows.index] - rows["compute_s"] - rows["idle_s"]
        plain = [s for s in rows.index if s not in report_steps]
        compute.append(float(rows["compute_s"].median()))
        cpu.append(float(statistics.median(layer_cpu)))
        idle.append(float(rows["idle_s"].median()))
        rest.append(float(remainder.loc[plain].median()) if plain else math.nan)
        if stage == 0:
            first_rest = {int(s): float(v) for s, v in remainder.items()}
    plain_cpu = [v / step_k[s] for s, v in first_rest.items() if s not in report_steps]
    reported = [v / step_k[s] for s, v in first_rest.items() if s in report_steps]
    rest_cpu_s = float(statistics.median(plain_cpu)) if plain_cpu else 0.0
    report_cpu_s = float(statistics.median(reported)) - rest_cpu_s if reported else 0.0
    first = costs[costs["step"] == report_steps[0]].sort_values("layer")
    params = [int(x) for x in first["num_params"]]
    parts = run.parts_at(report_steps[0])
    k_median = float(statistics.median(step_k.values()))
    return RunDecomposition(
        name=name,
        num_stages=num_stages,
        num_microbatches=int(cfg_train["num_microbatches"]),
        schedule=str(cfg_pipeline["schedule"]),
        algorithm=algorithm,
        step_s=float(steps.median()),
        compute_s=compute,
        layer_cpu_s=cpu,
        idle_s=idle,
        rest_s=rest,
        report_extra_s=report_cpu_s * k_median,
        wall_s_per_cpu_s=k_median,
        stage_params=[sum(params[a:b]) for a, b in itertools.pairwise(parts)],
        rest_cpu_s=rest_cpu_s,
        report_cpu_s=report_cpu_s,
    )


def fit_overheads(runs: Sequence[RunDecomposition], optimizer_s_per_param: float) -> Overheads:
    """Least-squares ``action_s`` and ``step_s`` from the runs' stage-0 remainders, with the
    measured ``optimizer_s_per_param`` taken off; ``report_s`` is the median report extra.

    A negative least-squares value is not a cost: that term is set to 0 and the other refitted
    alone (with one microbatch count among the runs, ``action_s`` cannot be told apart from
    ``step_s`` and is 0).
    """
    if not runs:
        raise ValueError("fit_overheads needs at least one run")
    y = np.array(
        [r.rest_cpu_s - optimizer_s_per_param * max(r.stage_params) for r in runs], dtype=float
    )
    actions = np.array([2.0 * r.num_microbatches for r in runs])
    action_s, step_s = 0.0, float(np.mean(y))
    if len(set(actions.tolist())) > 1:
        design = np.column_stack([actions, np.ones_like(actions)])
        (action_s, step_s), *_ = np.linalg.lstsq(design, y, rcond=None)
        action_s, step_s = float(action_s), float(step_s)
        if action_s < 0:
            action_s, step_s = 0.0, float(np.mean(y))
        elif step_s < 0:
            action_s, step_s = float(actions @ y / (actions @ actions)), 0.0
    return Overheads(
        action_s=max(action_s, 0.0),
        optimizer_s_per_param=optimizer_s_per_param,
        step_s=max(step_s, 0.0),
        report_s=max(float(statistics.median(r.report_cpu_s for r in runs)), 0.0),
    )
