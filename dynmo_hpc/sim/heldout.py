"""Held-out prediction: one run's step time from another run's layer costs, and the machine
calibration that makes it possible without the target's own wall times.

Why: replaying a run with its own measured wall-per-CPU ratio (``--wall-per-cpu run``) predicts
only what the ratio leaves over, since most of the step is the layers' wall time it takes from
the very run it predicts. The honest test of the simulator is to predict a run it never saw:

- the *source* run X gives its load reports (each layer's thread CPU seconds per step, its
  parameters and bytes), as the trainer measured them;
- the *target* run Y gives only its settings, the ones a user chooses before running it: stages,
  microbatches, schedule, balancing algorithm, report interval, steps. Y may differ from X by
  algorithm (uniform -> optimal, diffusion, packing) or by stage count (X's per-layer costs are
  re-partitioned onto Y's stages);
- the machine calibration (:class:`~dynmo_hpc.sim.machine.MachineModel`) gives the overheads,
  the link, the cores the ranks share and the other processes' load
  (``external_wall_s_per_cpu_s``), all fitted on *calibration runs* that are neither X nor Y
  (:func:`fit_machine`).

A target run that packed (``elastic.enabled``: replayed as ``packing``) is compared after its
first pack: the measured median over the steps after its ``resize`` event against the replay's
median over the steps after the replay's own first pack (:func:`after_pack_s`); the two must
land on the same stage count. The source is a run that never packs, so its layer costs are those
of the stages it ran on, re-partitioned by the replay. Whether a pack pays depends on the restart
overhead; where the target's config leaves it to be measured, the replay takes the trainer's
estimate from the source's own start-up and state (:func:`~dynmo_hpc.sim.runlog_traces.
measured_restart_s`): never from the target's logged decision.

Y's measured wall times are read only by :func:`measured_step_s` and :func:`after_pack_s`, to be
compared against.
The invariant the tests check: changing the target's measured times changes the measured
column and nothing in the prediction.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynmo_hpc.pipeline.waiting import WAIT_YIELD_S
from dynmo_hpc.runlog import RunLog
from dynmo_hpc.sim.machine import MachineModel
from dynmo_hpc.sim.overheads import decompose, fit_overheads, replayed_algorithm
from dynmo_hpc.sim.oversubscribed_cpu import alone_costs, fit_oversubscribed_cpu
from dynmo_hpc.sim.replay import (
    PACKING,
    PackingSetup,
    ReplayResult,
    ReplaySetup,
    replay,
    sharing_ratio,
)
from dynmo_hpc.sim.runlog_traces import (
    RunTraces,
    measured_wall_s_per_cpu_s,
    packing_setup,
    traces_from_runlog,
)
from dynmo_hpc.sim.step import stage_times_s, transfer_time_s

JOB_KEYS = ("model", "schemes")
"""Config sections that make two runs the same job (the same layers, doing the same work)."""
JOB_TRAIN_KEYS = ("micro_batch_size",)
"""``train`` keys that change a layer's cost per microbatch."""
DEFAULT_BANDWIDTH_BYTES_PER_S = 100e9 / 8
"""The link when the machine file has none: ``dynmo-hpc simulate``'s default, 100 Gbit/s."""


@dataclass(frozen=True, kw_only=True)
class TargetSettings:
    """What a user chooses for the run to be predicted; nothing measured."""

    num_stages: int
    num_microbatches: int
    schedule: str
    algorithm: str
    """The replayed algorithm (``static`` is ``uniform``, :func:`replayed_algorithm`)."""
    interval: int
    num_steps: int
    margin: float
    smoothing: float
    packing: PackingSetup = field(default_factory=PackingSetup)
    """The target's ``elastic`` settings (``packing`` only; restart overhead: the config's, else
    the source's measurement, else the default; never the target's measured resizes)."""


def target_settings(
    config: dict[str, Any], name: str = "target", measured_restart_s: float | None = None
) -> TargetSettings:
    """A run's settings from its config (a run log's ``config``); ValueError names the run.

    ``measured_restart_s``: the source's measurement of a resize's pause
    (:attr:`RunTraces.measured_restart_s`), the packing decision's restart overhead when the
    config leaves it to be measured."""
    pipeline, train, balance = config["pipeline"], config["train"], config["balance"]
    algorithm = replayed_algorithm(str(balance["algorithm"]))
    elastic = config.get("elastic")
    if algorithm is not None and isinstance(elastic, dict) and elastic.get("enabled"):
        algorithm = PACKING  # the trainer's default balancer between packs, as the replay's
    if algorithm is None:
        raise ValueError(
            f"{name}: balance.algorithm={balance['algorithm']!r} has no replayed equivalent; "
            "HINT: predict a static run or one of the rebalancing algorithms"
        )
    return TargetSettings(
        num_stages=int(pipeline["num_stages"]),
        num_microbatches=int(train["num_microbatches"]),
        schedule=str(pipeline["schedule"]),
        algorithm=algorithm,
        interval=int(balance["interval"]),
        num_steps=int(train["steps"]),
        margin=float(balance["margin"]),
        smoothing=float(balance["smoothing"]),
        packing=packing_setup(elastic, measured_restart_s),
    )


def job_key(config: dict[str, Any]) -> str:
    """What makes two runs' layer costs comparable (:data:`JOB_KEYS`, :data:`JOB_TRAIN_KEYS`),
    as one string: runs with equal keys are the same job."""
    train = config.get("train", {})
    key = {k: config.get(k) for k in JOB_KEYS}
    key["train"] = {k: train.get(k) for k in JOB_TRAIN_KEYS}
    return json.dumps(key, sort_keys=True, default=str)


def check_same_job(source: dict[str, Any], target: dict[str, Any], names: tuple[str, str]) -> None:
    """ValueError unless the two configs run the same layers with the same batch: a source's
    per-layer costs say nothing about another model."""
    differing = [key for key in JOB_KEYS if source.get(key) != target.get(key)]
    differing += [
        f"train.{key}"
        for key in JOB_TRAIN_KEYS
        if source.get("train", {}).get(key) != target.get("train", {}).get(key)
    ]
    if differing:
        raise ValueError(
            f"{names[1]} is not the same job as {names[0]} (they differ in "
            f"{', '.join(differing)}); HINT: predict a run of the same job (same model, "
            "schemes and train.micro_batch_size), differing only in stages, microbatches, "
            "schedule or balance algorithm"
        )


def replay_setup(
    target: TargetSettings, machine: MachineModel, activation_bytes: float, traces: RunTraces
) -> ReplaySetup:
    """The replay of ``target``'s settings on ``machine`` (its terms; its link, else 100 Gbit/s;
    its external load, applied as it is)."""
    bandwidth = machine.bandwidth_bytes_per_s or DEFAULT_BANDWIDTH_BYTES_PER_S
    comm_s = transfer_time_s(machine.latency_s or 0.0, bandwidth, activation_bytes)
    return ReplaySetup(
        num_stages=target.num_stages,
        num_microbatches=target.num_microbatches,
        schedule=target.schedule,
        interval=target.interval,
        num_steps=target.num_steps,
        comm_s=comm_s if target.num_stages > 1 else 0.0,
        bandwidth_bytes_per_s=bandwidth,
        margin=target.margin,
        smoothing=target.smoothing,
        overheads=machine.overheads,
        cores=machine.cores,
        poll_max_s=machine.poll_max_s or 0.0,
        poll_yield_s=WAIT_YIELD_S if machine.poll_max_s else 0.0,
        packing=target.packing,
        ratios_are_external=machine.external_wall_s_per_cpu_s is not None,
        oversubscribed_wall_s_per_cpu_s=machine.oversubscribed_wall_s_per_cpu_s or 1.0,
        oversubscribed_cpu_s_per_cpu_s=machine.oversubscribed_cpu_s_per_cpu_s or 1.0,
    )


def predict(traces: RunTraces, target: TargetSettings, machine: MachineModel) -> ReplayResult:
    """``target``'s replay from the source's load reports (CPU seconds only: the source's wall
    times are not used), stretched by the machine's fitted external load."""
    k = machine.external_wall_s_per_cpu_s or machine.wall_s_per_cpu_s or 1.0
    # The target side applies the factor only with the fitted external load (replay_setup).
    external = machine.external_wall_s_per_cpu_s is not None
    alone = alone_costs(
        traces, machine.cores, machine.oversubscribed_cpu_s_per_cpu_s if external else None
    )
    reports = [replace(r, wall_s_per_cpu_s=k, step_wall_s_per_cpu_s=[]) for r in alone]
    setup = replay_setup(target, machine, traces.activation_bytes, traces)
    return replay(reports, setup, target.algorithm)


def measured_step_s(run: RunLog) -> float:
    """The run's median logged ``step_time_s`` over all its steps (report steps included)."""
    return float(statistics.median(float(x) for x in run.steps["step_time_s"]))


class PackingMismatch(ValueError):
    """A packing target whose replay packed to another stage count (or not at all): the
    prediction got the decision wrong, so there is no after-pack step to compare."""


@dataclass(frozen=True, kw_only=True)
class HeldOutRow:
    """One (source, target) pair: predicted against measured, step time and speedup."""

    source: str
    target: str
    target_settings: TargetSettings
    measured_source_s: float
    measured_target_s: float
    predicted_source_s: float
    """The source's own settings replayed from its own CPU costs (no wall times)."""
    predicted_target_s: float
    mispredicted_repeats: int = 0
    """Repeats of the pair whose prediction packed to another stage count than the target
    (:class:`PackingMismatch`): left out of the medians, and the pair counts as a miss."""
    trace: str = ""
    """The run whose load reports both predictions replay; empty: the source's own (then
    ``predicted_source_s`` replays the source's own costs)."""

    @property
    def step_error(self) -> float:
        """predicted / measured - 1 for the target's median step."""
        return self.predicted_target_s / self.measured_target_s - 1.0

    @property
    def measured_speedup(self) -> float:
        """Source step over target step: > 1 when the target runs faster."""
        return self.measured_source_s / self.measured_target_s

    @property
    def predicted_speedup(self) -> float:
        return self.predicted_source_s / self.predicted_target_s

    @property
    def speedup_error(self) -> float:
        return self.predicted_speedup / self.measured_speedup - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "trace": self.trace or self.source,
            "stages": self.target_settings.num_stages,
            "microbatches": self.target_settings.num_microbatches,
            "algorithm": self.target_settings.algorithm,
            "measured_source_s": self.measured_source_s,
            "measured_target_s": self.measured_target_s,
            "predicted_source_s": self.predicted_source_s,
            "predicted_target_s": self.predicted_target_s,
            "step_error": self.step_error,
            "measured_speedup": self.measured_speedup,
            "predicted_speedup": self.predicted_speedup,
            "speedup_error": self.speedup_error,
            "mispredicted_repeats": self.mispredicted_repeats,
        }

    def within(self, tolerance: float) -> bool:
        """Step time and speedup both within ``tolerance`` (0.1: 10 %), every repeat's
        packing decision predicted."""
        return (
            self.mispredicted_repeats == 0
            and abs(self.step_error) <= tolerance
            and abs(self.speedup_error) <= tolerance
        )


def median_row(rows: Sequence[HeldOutRow]) -> HeldOutRow:
    """One pair's row over repeats of both runs: each measured and predicted step the median
    of its repeats (repeat ``r`` of the target predicted from repeat ``r`` of the source).

    Why: a short run's median step on a shared machine moves between runs made minutes apart
    by more than the 10 % the held-out table checks (docs/simulate.md, "Held-out
    validation"); the median of a few repeats of each run is what the pair compares. Raises
    ValueError for no rows or rows of different pairs."""
    if not rows:
        raise ValueError("median_row needs at least one row")
    first = rows[0]
    if any((r.source, r.target) != (first.source, first.target) for r in rows):
        raise ValueError("median_row: the rows must all be repeats of one pair")

    def median(field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in rows))

    return replace(
        first,
        measured_source_s=median("measured_source_s"),
        measured_target_s=median("measured_target_s"),
        predicted_source_s=median("predicted_source_s"),
        predicted_target_s=median("predicted_target_s"),
    )


def after_pack_s(run: RunLog) -> tuple[int, float] | None:
    """A run that packed: the step of its first ``resize`` event (the last step on the old
    stages) and its median logged step time over the steps after it; None if it never packed."""
    resizes = run.events[run.events["kind"] == "resize"]
    if resizes.empty:
        return None
    step = int(resizes["step"].min())
    after = run.steps[run.steps["step"] > step]["step_time_s"]
    if after.empty:
        raise ValueError(f"{run.path} packed at its last step; HINT: run more steps after the pack")
    return step, float(statistics.median(float(x) for x in after))


def _predicted_after_pack_s(result: ReplayResult, target: RunLog, name: str) -> float:
    """The replay's median step after its first pack, which must reach the stage count the
    target packed to (its last load report's partition)."""
    packed_to = len(target.parts_at(target.report_steps()[-1])) - 1
    if not result.pack_steps or len(result.final_parts) - 1 != packed_to:
        raise PackingMismatch(
            f"{name} packed to {packed_to} stages, the prediction to "
            f"{len(result.final_parts) - 1}; HINT: the source's layer costs do not lead to "
            "the target's packing decision (compare their load reports)"
        )
    return float(statistics.median(result.step_times_s[result.pack_steps[0] + 1 :]))


def predict_pair(
    source: RunLog,
    target: RunLog,
    machine: MachineModel,
    names: tuple[str, str],
    trace: tuple[str, RunLog] | None = None,
) -> HeldOutRow:
    """Predict ``target`` (and ``source``, for the speedup) from ``source``'s load reports on
    ``machine``, or from ``trace``'s (a third run of the same job, named): then neither run's
    own costs enter its prediction. The measured steps are read only for the comparison
    columns."""
    check_same_job(source.config, target.config, names)
    trace_name, trace_run = trace if trace is not None else (names[0], source)
    if trace is not None:
        check_same_job(trace_run.config, source.config, (trace_name, names[0]))
    traces = traces_from_runlog(trace_run)
    settings = target_settings(target.config, names[1], traces.measured_restart_s)
    own = target_settings(source.config, names[0], traces.measured_restart_s)
    predicted = predict(traces, settings, machine)
    packed = after_pack_s(target) if settings.algorithm == PACKING else None
    measured_target_s, predicted_target_s = measured_step_s(target), predicted.median_step_time_s
    if packed is not None:
        measured_target_s = packed[1]
        predicted_target_s = _predicted_after_pack_s(predicted, target, names[1])
    return HeldOutRow(
        source=names[0],
        target=names[1],
        target_settings=settings,
        measured_source_s=measured_step_s(source),
        measured_target_s=measured_target_s,
        predicted_source_s=predict(traces, own, machine).median_step_time_s,
        predicted_target_s=predicted_target_s,
        trace="" if trace is None else trace_name,
    )


def external_ratio(run: RunLog, machine: MachineModel) -> float:
    """A run's median wall-per-CPU ratio of its layers over what its ranks sharing
    ``machine.cores`` explain: the other processes' load while it ran (>= 1 per step)."""
    traces = traces_from_runlog(run)
    report_steps = traces.report_steps
    measured = measured_wall_s_per_cpu_s(run, report_steps)
    m = traces.num_microbatches
    setup = ReplaySetup(
        num_stages=traces.num_stages,
        num_microbatches=m,
        schedule=traces.schedule,
        cores=machine.cores,
    )
    ratios: list[float] = []
    for step, report, per_step in zip(report_steps, traces.reports, measured, strict=True):
        if per_step is None:
            continue
        parts = run.parts_at(step)
        forward = stage_times_s(report.forward_s, parts, m)
        backward = stage_times_s(report.backward_s, parts, m)
        own = sharing_ratio(forward, backward, m, setup) if _shared(machine, parts) else 1.0
        ratios += [max(1.0, k / own) for k in per_step]
    if not ratios:
        raise ValueError("the run log has no stage times; HINT: calibrate on complete runs")
    return float(statistics.median(ratios))


def _shared(machine: MachineModel, parts: Sequence[int]) -> bool:
    return machine.cores is not None and machine.cores < len(parts) - 1


OVERSUBSCRIBED_MAX = 3.0
"""The largest oversubscription factor :func:`fit_oversubscribed` returns (a run 3x slower than
its time-slicing stages explain had something else wrong with it)."""


def fit_oversubscribed(
    measured_s: Sequence[float],
    predicted_s_at: Callable[[float], Sequence[float]],
    tolerance: float = 1e-4,
) -> float | None:
    """The oversubscription factor from calibration runs with more ranks than cores: the
    factor at which the median over the runs of measured median step / predicted median step
    is 1 (bisection on [1, :data:`OVERSUBSCRIBED_MAX`]); 1 when the runs are already predicted
    at or above their measured steps (nothing runs faster than the sharing simulated); None for
    no runs. ``predicted_s_at(factor)`` replays each run from its own layer costs with every
    other term of the calibration.

    Why a bisection: the factor stretches only the stages that time-slice a core
    (:func:`~dynmo_hpc.sim.replay.time_sliced`), so a predicted step is not proportional to it.
    """
    if not measured_s:
        return None

    def median_ratio(factor: float) -> float:
        predicted = list(predicted_s_at(factor))
        if len(predicted) != len(measured_s):
            raise ValueError(f"{len(measured_s)} measured steps but {len(predicted)} predicted")
        return float(statistics.median(m / p for m, p in zip(measured_s, predicted, strict=True)))

    lo, hi = 1.0, OVERSUBSCRIBED_MAX
    if median_ratio(lo) <= 1.0:
        return lo
    if median_ratio(hi) >= 1.0:
        return hi
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_ratio(mid) > 1.0 else (lo, mid)
    return (lo + hi) / 2


def fit_machine(
    runs: Sequence[tuple[str, RunLog]], base: MachineModel, notes: dict[str, Any] | None = None
) -> MachineModel:
    """The machine calibration from ``runs`` (never the runs it will predict): ``base``'s
    measured constants (optimizer per parameter, link, cores, wake-up), the per-step, per-action
    and per-report overheads fitted on the runs (:func:`~dynmo_hpc.sim.overheads.fit_overheads`),
    the median of their external load (:func:`external_ratio`), then, with those, the
    oversubscription factor of the runs with more stages than ``base.cores``
    (:func:`fit_oversubscribed`; None when no run has). The oversubscribed CPU factor
    (:func:`~dynmo_hpc.sim.oversubscribed_cpu.fit_oversubscribed_cpu`) comes first, from the
    runs of one job (:func:`job_key`) at both kinds of stage count, since the wall factor is
    what is left of the oversubscribed steps after it."""
    if not runs:
        raise ValueError("fit_machine needs at least one calibration run")
    decomps = [decompose(run, name) for name, run in runs]
    overheads = fit_overheads(decomps, base.overheads.optimizer_s_per_param)
    external = statistics.median(external_ratio(run, base) for _, run in runs)
    traces_of = {name: traces_from_runlog(run) for name, run in runs}
    shared_cpu = None
    if base.cores is not None:
        keyed = [(traces_of[name], job_key(run.config)) for name, run in runs]
        shared_cpu = fit_oversubscribed_cpu(keyed, base.cores)
    machine = replace(
        base,
        overheads=overheads,
        wall_s_per_cpu_s=None,
        external_wall_s_per_cpu_s=float(external),
        oversubscribed_wall_s_per_cpu_s=None,
        oversubscribed_cpu_s_per_cpu_s=shared_cpu,
        notes={**(notes or {}), "fitted_on": [name for name, _ in runs]},
    )
    over = [
        (traces, target_settings(run.config, name, traces.measured_restart_s), measured_step_s(run))
        for name, run in runs
        if _oversubscribed(machine, run)
        for traces in [traces_of[name]]
    ]

    def predicted_s_at(factor: float) -> list[float]:
        model = replace(machine, oversubscribed_wall_s_per_cpu_s=factor)
        return [predict(traces, own, model).median_step_time_s for traces, own, _ in over]

    factor = fit_oversubscribed([m for _, _, m in over], predicted_s_at)
    return replace(machine, oversubscribed_wall_s_per_cpu_s=factor)


def _oversubscribed(machine: MachineModel, run: RunLog) -> bool:
    stages = int(run.config["pipeline"]["num_stages"])
    return machine.cores is not None and machine.cores < stages
