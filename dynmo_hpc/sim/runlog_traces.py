"""What a replay needs from a run log: the load reports' layer costs and the run's pipeline.

Why separate from :mod:`dynmo_hpc.sim.replay`: the replay is pure numbers; this module knows the
run log's tables (``docs/runlog.md``) and config, and turns them into
:class:`~dynmo_hpc.sim.replay.CostReport` values, refusing a log that has none.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from dynmo_hpc.balance.restart_overhead import estimated_restart_s
from dynmo_hpc.errors import RunLogError
from dynmo_hpc.runlog import RunLog
from dynmo_hpc.sim.replay import CostReport, PackingSetup

ACTIVATION_BYTES_PER_VALUE = 4
"""float32: the trainer sends activations in the model's dtype, float32."""


@dataclass(frozen=True, kw_only=True)
class RunTraces:
    """A run's cost history and the settings it ran with."""

    reports: list[CostReport]
    report_steps: list[int]
    report_parts: list[list[int]]
    """The partition each report's costs were measured on (which layers shared a rank)."""
    num_stages: int
    num_microbatches: int
    schedule: str
    interval: int
    margin: float
    smoothing: float
    tokens_per_microbatch: int
    """``train.micro_batch_size * model.seq_len``."""
    activation_bytes: int
    """One microbatch's activations between stages: batch x sequence x width x 4 bytes."""
    packing: PackingSetup
    """The run's ``elastic`` settings, for the simulator's ``packing`` (its default restart
    overhead where the run measured its own)."""
    measured_restart_s: float | None
    """What the run measured of a resize's pause (:func:`measured_restart_s`), or None."""
    step_wall_s_per_cpu_s: list[list[float] | None]
    """Per report, per step of its interval (in order): the step's wall seconds in layers
    (``stage_times.compute_s``, all stages) over the report's thread CPU seconds per step; None
    where the log has no stage times for those steps. See :func:`measured_wall_s_per_cpu_s`."""


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    section = config.get(name)
    if not isinstance(section, dict):
        raise RunLogError(
            f"the run log's config has no {name!r} section; "
            "HINT: pass a run.h5 written by `dynmo-hpc run`"
        )
    return section


def measured_wall_s_per_cpu_s(run: RunLog, report_steps: list[int]) -> list[list[float] | None]:
    """Per load report and per step it covers, how much slower than its CPU clock the run's
    layers ran, measured.

    Why from the run itself: on a machine whose cores are shared (more ranks than cores, or
    other jobs), the ratio changes from run to run and, with other users' load, from one second
    to the next; nothing measured before the run can know it. The run log holds both clocks for
    the same work: each stage's wall seconds in its layers per step (``compute_s``) and each
    layer's thread CPU seconds (the report, a mean over its interval). Both cover only the
    layers, not the step's waits or overheads, which the simulator predicts. Report ``r`` covers
    the steps after report ``r - 1`` up to and including its own; a report whose steps have no
    stage times (or no CPU cost) gets None.
    """
    times = run.stage_times
    costs = run.layer_costs
    out: list[list[float] | None] = []
    previous = -1
    for step in report_steps:
        rows = times[(times["step"] > previous) & (times["step"] <= step)]
        report = costs[costs["step"] == step]
        cpu_per_step_s = float((report["forward_s"] + report["backward_s"]).sum())
        wall_per_step_s = rows.groupby("step")["compute_s"].sum().sort_index()
        ratios = [float(w) / cpu_per_step_s for w in wall_per_step_s] if cpu_per_step_s > 0 else []
        usable = bool(ratios) and all(math.isfinite(k) and k > 0 for k in ratios)
        out.append(ratios if usable else None)
        previous = step
    return out


def traces_from_runlog(run: RunLog) -> RunTraces:
    """The load reports of ``run`` (authoritative rows only) with the run's settings."""
    costs = run.layer_costs
    if costs.empty:
        raise RunLogError(
            f"{run.path} has no load reports (layer costs); HINT: simulate a run that lasted "
            "at least balance.interval steps, or pass --costs"
        )
    reports: list[CostReport] = []
    steps = sorted(int(s) for s in costs["step"].unique())
    for step in steps:
        rows = costs[costs["step"] == step].sort_values("layer")
        forward = [float(x) for x in rows["forward_s"]]
        backward = [float(x) for x in rows["backward_s"]]
        if not all(math.isfinite(x) and x >= 0 for x in forward + backward):
            raise RunLogError(
                f"{run.path}: the load report at step {step} has a negative or non-finite "
                "layer cost; HINT: the file is damaged; rerun the job"
            )
        layer_bytes = rows["param_bytes"] + rows["grad_bytes"] + rows["optim_bytes"]
        reports.append(
            CostReport(
                forward_s=forward,
                backward_s=backward,
                num_params=[int(x) for x in rows["num_params"]],
                layer_bytes=[int(x) for x in layer_bytes],
            )
        )
    restart_s = measured_restart_s(run, steps, reports)
    model, train = _section(run.config, "model"), _section(run.config, "train")
    pipeline, balance = _section(run.config, "pipeline"), _section(run.config, "balance")
    micro_batch, seq_len = int(train["micro_batch_size"]), int(model["seq_len"])
    return RunTraces(
        reports=reports,
        report_steps=steps,
        report_parts=[list(run.parts_at(step)) for step in steps],
        num_stages=int(pipeline["num_stages"]),
        num_microbatches=int(train["num_microbatches"]),
        schedule=str(pipeline["schedule"]),
        interval=int(balance["interval"]),
        margin=float(balance["margin"]),
        smoothing=float(balance["smoothing"]),
        tokens_per_microbatch=micro_batch * seq_len,
        activation_bytes=micro_batch * seq_len * int(model["d_model"]) * ACTIVATION_BYTES_PER_VALUE,
        packing=packing_setup(run.config.get("elastic"), restart_s),
        measured_restart_s=restart_s,
        step_wall_s_per_cpu_s=measured_wall_s_per_cpu_s(run, steps),
    )


def _detail_values(events: Any, kind: str, key: str) -> list[float]:
    """``key`` of every ``kind`` event's detail in ``events`` (a run log's events table or
    rows of it), in log order; events without it skipped."""
    rows = events[events["kind"] == kind]
    return [float(d[key]) for d in rows["detail"] if isinstance(d, dict) and key in d]


def measured_restart_s(
    run: RunLog, report_steps: list[int], reports: list[CostReport]
) -> float | None:
    """A resize's pause as the run's own measurements put it, or None when they cannot.

    The median of the run's resizes if it resized; else the trainer's estimate before its
    first resize (:func:`dynmo_hpc.balance.restart_overhead.estimated_restart_s`) from the run's
    first launch's start-up (its ``launch`` event) and its first load report's checkpoint time: the
    seconds of the last checkpoint written by then, else the report's state bytes at the
    assumed disk speed. Why at the first report: that is what a packing run of the job knows at
    its first packing decision, so a run that never packed predicts that decision with the same
    numbers.
    None for a log without a ``launch`` event (written before the event existed, or by a
    launcher that recorded no start time).
    """
    resizes_s = _detail_values(run.events, "resize", "total_s")
    if resizes_s:
        return float(statistics.median(resizes_s))
    startups_s = _detail_values(run.events, "launch", "startup_s")
    if not startups_s:
        return None
    first_report_step = report_steps[0] if report_steps else -1
    early = run.events[run.events["step"] <= first_report_step]
    checkpoints_s = _detail_values(early, "checkpoint", "seconds")
    state_bytes = float(sum(reports[0].layer_bytes)) if reports else 0.0
    return estimated_restart_s(
        startups_s[0], checkpoints_s[-1] if checkpoints_s else None, state_bytes
    )


def packing_setup(elastic: Any, restart_s: float | None) -> PackingSetup:
    """A run's ``elastic`` section as a :class:`PackingSetup` (defaults where absent).

    The restart overhead is the section's ``restart_overhead_s``; if that is null (measure
    it), ``restart_s`` (:func:`measured_restart_s`: of this run, or of another run of the same
    job predicting it); if that is None too, the default.
    """
    if not isinstance(elastic, dict):
        elastic = {}
    default = PackingSetup()
    overhead = elastic.get("restart_overhead_s")
    if overhead is None:
        overhead = restart_s
    return PackingSetup(
        interval=int(elastic.get("interval", default.interval)),
        pack_policy=str(elastic.get("policy", default.pack_policy)),
        max_slowdown=float(elastic.get("max_slowdown", default.max_slowdown)),
        min_stages=int(elastic.get("min_stages", default.min_stages)),
        restart_overhead_s=default.restart_overhead_s if overhead is None else float(overhead),
    )
