"""Replay a training run's measured layer costs under a balancing algorithm, step by step.

Why: a run log records what one algorithm did with one partition. To ask what Megatron's uniform
split, DeepSpeed's parameter split or DynMo's dynamic balancers would have done with the *same*
cost history, the history is replayed: each step's time comes from the event-level simulation
(:mod:`dynmo_hpc.sim.step`) of the partition in force, and the rebalancing algorithms decide at
each load report with the trainer's own rule (:func:`dynmo_hpc.train.rebalance.decide`: the
balancer proposes, :func:`dynmo_hpc.balance.should_rebalance` enacts only if the predicted gain
until the next report or the end of the run beats the migration time; diffusion moves one phase
per report).

The timeline: load report ``r`` holds the costs measured over steps ``r * interval`` to
``(r + 1) * interval - 1``; those steps are simulated with them. At the end of that interval the
report is smoothed into the running average (``balance.smoothing``, with the trainer's
:class:`~dynmo_hpc.pipeline.costs.CostTracker`) and a rebalancing algorithm decides; an enacted
partition runs from the next step, and the report step pays the migration (busiest rank's bytes
sent plus received / bandwidth), as the trainer's logged step time includes the load report and
migration that follow its schedule. Steps past the last report keep its costs.

Calibrated terms (:mod:`dynmo_hpc.sim.machine`, all 0 by default): a report's CPU-second costs
and the setup's CPU overheads are stretched by the report's wall-per-CPU ratio (one for the
interval, or one per step of it; with a fitted external load, times the oversubscription factor
for the stages that time-slice a core, :func:`time_sliced`); each action pays ``action_s``,
each stage ``step_s + optimizer_s_per_param x its parameters`` after the schedule, and the last
step of each interval (the one that reports, as in the trainer) its ``report_s``.

Pure: no clock, no I/O; the caller supplies the traces and may pass a progress callback.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynmo_hpc.balance import ALGORITHMS, INITIAL_ALGORITHM, BalanceState, partition
from dynmo_hpc.balance.common import check_values
from dynmo_hpc.balance.packing import PACK_POLICIES, PackRequest, nodes_for, plan_pack
from dynmo_hpc.config import BalanceSection
from dynmo_hpc.pipeline.costs import CostTracker
from dynmo_hpc.sim.machine import Overheads
from dynmo_hpc.sim.shared_cores import home_cores
from dynmo_hpc.sim.step import simulate_step, stage_times_s
from dynmo_hpc.train.rebalance import decide

PACKING = "packing"
"""Not an algorithm: ``optimal`` plus elastic packing. Every ``PackingSetup.interval`` reports,
the trainer's packing decision (:func:`dynmo_hpc.balance.packing.plan_pack`) may move the model
onto fewer stages."""


def replay_algorithms() -> tuple[str, ...]:
    """What :func:`replay` accepts: every :data:`~dynmo_hpc.balance.ALGORITHMS` entry, in table
    order, then :data:`PACKING`."""
    return (*ALGORITHMS, PACKING)


@dataclass(frozen=True, kw_only=True)
class CostReport:
    """One load report: per layer, seconds per step and what the layer weighs."""

    forward_s: list[float]
    backward_s: list[float]
    num_params: list[int]
    """Parameter counts (the ``parameters`` algorithm's input)."""
    layer_bytes: list[int]
    """Bytes that travel when the layer migrates (weights, gradients, optimizer state)."""
    wall_s_per_cpu_s: float = 1.0
    """Wall seconds per CPU second while these costs were measured: the layer costs are thread
    CPU time, the step is wall time, and ranks that share cores with other processes run
    slower than their CPU clocks (:func:`dynmo_hpc.sim.runlog_traces.measured_wall_s_per_cpu_s`).
    """
    step_wall_s_per_cpu_s: list[float] = field(default_factory=list)
    """Optionally, the ratio of each step of the interval, in order (the load of a shared
    machine changes within an interval); steps beyond the list use ``wall_s_per_cpu_s``."""

    def check(self) -> None:
        """Raise ValueError unless all four lists have one finite, non-negative value a layer
        and every wall-per-CPU ratio is finite and > 0."""
        for k in (self.wall_s_per_cpu_s, *self.step_wall_s_per_cpu_s):
            if not (math.isfinite(k) and k > 0):
                raise ValueError(f"wall_s_per_cpu_s={k!r} must be finite and > 0")
        n = len(check_values(self.forward_s, "forward_s"))
        for name in ("backward_s", "num_params", "layer_bytes"):
            values = check_values(getattr(self, name), name)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries; forward_s has {n}")


@dataclass(frozen=True, kw_only=True)
class PackingSetup:
    """The ``elastic`` settings :data:`PACKING` decides with (``docs/elastic.md``)."""

    interval: int = 2
    """Load reports between packing decisions (``elastic.interval``)."""
    pack_policy: str = "throughput"
    """``elastic.policy``: how the packing decision picks a stage count."""
    max_slowdown: float = 0.1
    min_stages: int = 1
    restart_overhead_s: float = 10.0
    """Seconds a resize stops training; charged to the report step that decides it. The
    default is what one local resize measured (docs/benchmarks.md#elastic-packing)."""
    ranks_per_node: int = 1
    """Ranks per node: a pack must free whole nodes (1: every rank is its own node)."""

    def check(self) -> None:
        if self.interval < 1 or self.min_stages < 1 or self.ranks_per_node < 1:
            raise ValueError(
                f"packing interval={self.interval}, min_stages={self.min_stages} and "
                f"ranks_per_node={self.ranks_per_node} must be >= 1"
            )
        if not (math.isfinite(self.restart_overhead_s) and self.restart_overhead_s >= 0):
            raise ValueError(
                f"restart_overhead_s={self.restart_overhead_s!r} must be finite and >= 0"
            )
        if self.pack_policy not in PACK_POLICIES:
            raise ValueError(f"packing policy={self.pack_policy!r} is not one of {PACK_POLICIES}")
        if not (math.isfinite(self.max_slowdown) and 0 <= self.max_slowdown < 1):
            raise ValueError(f"max_slowdown={self.max_slowdown!r} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class ReplaySetup:
    """The pipeline and the balancing rule the reports are replayed on."""

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    interval: int = 5
    """Steps per load report (``balance.interval``)."""
    num_steps: int | None = None
    """Steps to replay; None: ``interval`` per report."""
    comm_s: float = 0.0
    """Seconds per activation transfer between neighbouring stages."""
    bandwidth_bytes_per_s: float = 12.5e9
    """Point-to-point bandwidth migrations are priced with."""
    margin: float = 0.1
    smoothing: float = 0.5
    overheads: Overheads = field(default_factory=Overheads)
    """CPU seconds outside the layers (:class:`~dynmo_hpc.sim.machine.Overheads`); 0: none."""
    cores: float | None = None
    """Cores the ranks share (:mod:`dynmo_hpc.sim.shared_cores`); None: a core per stage."""
    poll_max_s: float = 0.0
    """A waiting rank's longest sleep between tests (:func:`dynmo_hpc.sim.wakeup.noticed_s`)."""
    poll_yield_s: float = 0.0
    """How long a wait yields its core before it sleeps, in a step whose stages each have a core
    of their own (``runtime.wait_mode=auto``: :data:`dynmo_hpc.pipeline.waiting.WAIT_YIELD_S`)."""
    packing: PackingSetup = field(default_factory=PackingSetup)
    """What :data:`PACKING` decides with."""
    ratios_are_external: bool = False
    """The reports' wall-per-CPU ratios are other processes' load alone (a machine
    calibration's ``external_wall_s_per_cpu_s``), used as they are. False: they are a run's
    measured ratios, which contain its own ranks' sharing of ``cores``; with ``cores`` fewer
    than the stages that part is taken off (:func:`external_wall_s_per_cpu_s`)."""
    oversubscribed_wall_s_per_cpu_s: float = 1.0
    """With ``ratios_are_external``: the factor every CPU second of a time-slicing stage costs
    on top of the simulated sharing (a machine calibration's ``oversubscribed_wall_s_per_cpu_s``),
    in a step whose partition has more stages than ``cores``: the stages whose home core holds
    another stage too (:func:`time_sliced`). A stage alone on its core, and every stage of a
    step on at most ``cores`` stages (after a pack, say), does not pay it. Ignored for measured
    ratios, which contain it. 1: none."""
    oversubscribed_cpu_s_per_cpu_s: float = 1.0
    """With ``ratios_are_external``: in a step whose partition has more stages than ``cores``,
    how many times its CPU seconds with a core per rank every layer costs (a machine
    calibration's ``oversubscribed_cpu_s_per_cpu_s``); the reports' costs must then be costs
    with a core per rank (:func:`dynmo_hpc.sim.oversubscribed_cpu.alone_costs`). 1: none."""

    def check(self) -> None:
        """Raise ValueError (or ConfigError) on a setting no run could have."""
        self.overheads.check()
        for name in ("num_stages", "num_microbatches", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a whole number >= 1")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps!r} must be >= 1")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be finite and > 0"
            )
        if not (math.isfinite(self.comm_s) and self.comm_s >= 0):
            raise ValueError(f"comm_s={self.comm_s!r} must be finite and >= 0")
        for name in ("poll_max_s", "poll_yield_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be finite and >= 0")
        if self.cores is not None and not (math.isfinite(self.cores) and self.cores > 0):
            raise ValueError(f"cores={self.cores!r} must be finite and > 0")
        for name in ("oversubscribed_wall_s_per_cpu_s", "oversubscribed_cpu_s_per_cpu_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be finite and > 0")
        self.balance("optimal").validate()
        self.packing.check()

    def balance(self, algorithm: str) -> BalanceSection:
        """The ``balance`` section a run with ``algorithm`` would have had."""
        return BalanceSection(
            algorithm=algorithm,
            interval=self.interval,
            margin=self.margin,
            smoothing=self.smoothing,
        )


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """One algorithm's replayed run."""

    algorithm: str
    """What was replayed: an algorithm or :data:`PACKING`."""
    step_times_s: list[float] = field(default_factory=list)
    """Per step, simulated seconds, a migration decided at its load report included."""
    migrations: int = 0
    """Partitions enacted (rebalancing algorithms only)."""
    migration_s: float = 0.0
    """Seconds spent migrating, over the whole run."""
    migration_steps: list[tuple[int, float]] = field(default_factory=list)
    """Per migration: the (0-based) report step it was charged to and its seconds."""
    step_parts: list[list[int]] = field(default_factory=list)
    """Per step, the partition it ran on."""
    packs: int = 0
    """Resizes onto fewer stages (``packing`` only)."""
    pack_steps: list[int] = field(default_factory=list)
    """The (0-based) report step of each pack, the last step on the old stages."""
    node_s: float = 0.0
    """Node-seconds held: each step's seconds x the nodes its stages occupy."""
    final_parts: list[int] = field(default_factory=list)

    @property
    def median_step_time_s(self) -> float:
        return float(statistics.median(self.step_times_s))

    def tokens_per_s(self, tokens_per_step: float) -> float:
        """Tokens over the whole replay / its total time (migrations included)."""
        return tokens_per_step * len(self.step_times_s) / sum(self.step_times_s)


def _initial_parts(algorithm: str, report: CostReport, num_stages: int) -> list[int]:
    """A static baseline's split as its tool computes it; a rebalancing algorithm (and
    :data:`PACKING`) starts where the trainer does without ``pipeline.partition``: the split of
    :data:`~dynmo_hpc.balance.INITIAL_ALGORITHM`."""
    costs = [f + b for f, b in zip(report.forward_s, report.backward_s, strict=True)]
    start = partition(costs, num_stages, INITIAL_ALGORITHM)
    entry = ALGORITHMS.get(algorithm)
    if entry is None or entry.rebalances:
        return start
    state = BalanceState(parts=start, num_params=report.num_params, layer_bytes=report.layer_bytes)
    return partition(costs, num_stages, algorithm, **entry.trainer_options(state))


def _step_times_s(
    report: CostReport, parts: list[int], setup: ReplaySetup, ratios: Iterable[float]
) -> dict[float, float]:
    """One step on ``parts`` with ``report``'s costs, in wall seconds, per wall-per-CPU ratio
    in ``ratios`` (the stage times and the ranks' own sharing are worked out once for all)."""
    m, extra = setup.num_microbatches, setup.overheads
    params = [sum(report.num_params[a:b]) for a, b in itertools.pairwise(parts)]
    forward = stage_times_s(report.forward_s, parts, m)
    backward = stage_times_s(report.backward_s, parts, m)
    cores = setup.cores if setup.cores is not None and setup.cores < len(forward) else None
    own = 1.0 if cores is None else sharing_ratio(forward, backward, m, setup)
    sliced = [1.0] * len(forward)
    if cores is not None and setup.ratios_are_external:
        over = setup.oversubscribed_wall_s_per_cpu_s
        cpu = setup.oversubscribed_cpu_s_per_cpu_s
        sliced = [cpu * over if s else cpu for s in time_sliced(forward, backward, m, cores)]
    out = {}
    for ratio in set(ratios):
        k = ratio if cores is None or setup.ratios_are_external else max(1.0, ratio / own)
        out[ratio] = simulate_step(
            [k * f * x for f, x in zip(sliced, forward, strict=True)],
            [k * f * x for f, x in zip(sliced, backward, strict=True)],
            m,
            setup.schedule,
            comm_s=setup.comm_s,
            action_overhead_s=k * extra.action_s,
            stage_overhead_s=[
                k * f * extra.stage_tail_s(n) for f, n in zip(sliced, params, strict=True)
            ],
            cores=cores,
            poll_max_s=setup.poll_max_s,
            poll_yield_s=setup.poll_yield_s,
        ).step_time_s
    return out


def step_time_s(report: CostReport, parts: list[int], setup: ReplaySetup) -> float:
    """One step on ``parts`` with ``report``'s costs at its typical load, as :func:`replay`
    prices a step (a migration or a report's overhead aside)."""
    k = report.wall_s_per_cpu_s
    return _step_times_s(report, parts, setup, [k])[k]


def time_sliced(
    forward_s: Sequence[float], backward_s: Sequence[float], num_microbatches: int, cores: float
) -> list[bool]:
    """Per stage, whether it time-slices a core with another stage: its home core
    (:func:`~dynmo_hpc.sim.shared_cores.home_cores`, placed on the stages' CPU seconds per step)
    holds another stage too; every stage when ``cores`` is fractional (pooled). Only these pay
    ``oversubscribed_wall_s_per_cpu_s``: a rank alone on its core is not switched out."""
    pairs = zip(forward_s, backward_s, strict=True)
    loads = np.array([num_microbatches * (f + b) for f, b in pairs])
    home = home_cores(loads, cores)
    if home is None:
        return [True] * len(loads)
    per_core = np.bincount(home, minlength=int(cores))
    return [bool(per_core[h] > 1) for h in home]


def sharing_ratio(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    setup: ReplaySetup,
) -> float:
    """Wall seconds per CPU second of the layers when the stages share ``setup.cores`` and
    nothing else runs: the simulated ratio of the same layers (no overheads) at full speed."""
    shared = simulate_step(
        forward_s,
        backward_s,
        num_microbatches,
        setup.schedule,
        comm_s=setup.comm_s,
        cores=setup.cores,
    )
    cpu_s = num_microbatches * (sum(forward_s) + sum(backward_s))
    return sum(shared.busy_s) / cpu_s if cpu_s > 0 else 1.0


def external_wall_s_per_cpu_s(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    setup: ReplaySetup,
    measured: float,
) -> float:
    """The part of a measured wall-per-CPU ratio that the run's own ranks sharing
    ``setup.cores`` do not explain: the load of other processes.

    A run's measured ratio (layer wall seconds over layer CPU seconds) includes the slowdown of
    its ranks sharing the cores with each other, which the shared-cores simulation reproduces
    itself; applied on top, it would count that twice. So it is divided by
    :func:`sharing_ratio`. Never below 1: no load makes the
    ranks faster than sharing the cores perfectly (a measured ratio below the simulated one is
    noise).
    """
    return max(1.0, measured / sharing_ratio(forward_s, backward_s, num_microbatches, setup))


@dataclass
class _Timeline:
    """A replay in progress: the partition in force and what the steps so far cost."""

    parts: list[int]
    num_steps: int
    step_times_s: list[float] = field(default_factory=list)
    migrations: int = 0
    migration_s: float = 0.0
    migration_steps: list[tuple[int, float]] = field(default_factory=list)
    step_parts: list[list[int]] = field(default_factory=list)
    packs: int = 0
    pack_steps: list[int] = field(default_factory=list)
    node_s: float = 0.0

    @property
    def steps_left(self) -> int:
        return self.num_steps - len(self.step_times_s)

    def charge_report_step(self, seconds: float) -> None:
        """Add ``seconds`` to the last step: the report step, whose logged time includes the
        load report and the migration or resize it decided, as in the trainer."""
        self.step_times_s[-1] += seconds

    def result(self, algorithm: str) -> ReplayResult:
        return ReplayResult(
            algorithm=algorithm,
            step_times_s=self.step_times_s,
            migrations=self.migrations,
            migration_s=self.migration_s,
            migration_steps=list(self.migration_steps),
            step_parts=self.step_parts,
            packs=self.packs,
            pack_steps=list(self.pack_steps),
            node_s=self.node_s,
            final_parts=list(self.parts),
        )


def _check_replay(reports: Sequence[CostReport], setup: ReplaySetup, algorithm: str) -> None:
    """Raise ValueError on an unknown algorithm, no reports, or reports no run could log."""
    choices = replay_algorithms()
    if algorithm not in choices:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(choices)}")
    if not reports:
        raise ValueError("no load reports to replay; the run needs at least one")
    setup.check()
    for report in reports:
        report.check()
    if len({len(r.forward_s) for r in reports}) != 1:
        raise ValueError("every load report must cover the same layers")


def _run_interval(
    timeline: _Timeline, report: CostReport, measured: bool, setup: ReplaySetup
) -> None:
    """Simulate the steps of one report interval on the partition in force. Past the last
    report (``measured`` False) its costs repeat, at its typical (median) load."""
    steps = min(setup.interval, timeline.steps_left)
    per_step = report.step_wall_s_per_cpu_s if measured else []
    ratios = [per_step[j] if j < len(per_step) else report.wall_s_per_cpu_s for j in range(steps)]
    simulated = _step_times_s(report, timeline.parts, setup, ratios)
    timeline.step_times_s.extend(simulated[k] for k in ratios)
    timeline.step_parts.extend([timeline.parts] * steps)
    num_nodes = nodes_for(len(timeline.parts) - 1, setup.packing.ranks_per_node)
    timeline.node_s += sum(simulated[k] for k in ratios) * num_nodes
    # The interval's last step is a report step (the trainer also reports after the last).
    timeline.charge_report_step(ratios[-1] * setup.overheads.report_s)


def _rebalance(
    timeline: _Timeline,
    balance: BalanceSection,
    report: CostReport,
    costs_s: list[float],
    report_index: int,
    setup: ReplaySetup,
) -> None:
    """The trainer's decision at this report (:func:`~dynmo_hpc.train.rebalance.decide`);
    an enacted partition runs from the next step, its predicted migration charged to this one."""
    decision = decide(
        balance,
        report,
        costs_s=costs_s,
        parts=timeline.parts,
        bandwidth_bytes_per_s=setup.bandwidth_bytes_per_s,
        report_index=report_index,
        steps_left=timeline.steps_left,
    )
    if decision.parts_to_enact is not None:
        timeline.parts = decision.parts_to_enact
        timeline.migrations += 1
        timeline.charge_report_step(decision.predicted_migration_s)
        timeline.migration_s += decision.predicted_migration_s
        step = len(timeline.step_times_s) - 1
        timeline.migration_steps.append((step, decision.predicted_migration_s))


def _pack(
    timeline: _Timeline, report: CostReport, costs_s: list[float], setup: ReplaySetup
) -> bool:
    """The trainer's packing decision at this report; a pack runs from the next step, the
    restart overhead charged to this one. Whether it packed."""
    pack = _plan_pack(costs_s, timeline.parts, report, setup, timeline.steps_left)
    if pack is None:
        return False
    timeline.parts = pack
    timeline.packs += 1
    timeline.pack_steps.append(len(timeline.step_times_s) - 1)
    timeline.charge_report_step(setup.packing.restart_overhead_s)
    return True


def replay(
    reports: Sequence[CostReport],
    setup: ReplaySetup,
    algorithm: str,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``reports`` under ``algorithm`` (one of :func:`replay_algorithms`).

    Each interval is simulated on the partition in force; then, as in the trainer, the report
    is smoothed (:class:`~dynmo_hpc.pipeline.costs.CostTracker`) and, while steps are left, a
    rebalancing algorithm decides (:func:`~dynmo_hpc.train.rebalance.decide`) and
    :data:`PACKING` may pack (:func:`~dynmo_hpc.balance.packing.plan_pack`).
    ``progress(steps_done, num_steps)`` is called after each interval. Raises ValueError on bad
    input (no reports, more stages than layers, NaN costs, ...).

    Example: constant costs and the uniform algorithm give ``num_steps`` equal step times.
    """
    _check_replay(reports, setup, algorithm)
    num_steps = setup.num_steps or setup.interval * len(reports)
    parts = _initial_parts(algorithm, reports[0], setup.num_stages)
    timeline = _Timeline(parts=parts, num_steps=num_steps)
    packing = algorithm == PACKING
    # Packing rebalances between packs with the trainer's default balancer.
    balance = setup.balance("optimal" if packing else algorithm)
    rebalances = packing or ALGORITHMS[algorithm].rebalances
    tracker = CostTracker(num_layers=len(reports[0].forward_s), smoothing=setup.smoothing)
    report_index = 0
    while timeline.steps_left > 0:
        report = reports[min(report_index, len(reports) - 1)]
        _run_interval(timeline, report, report_index < len(reports), setup)
        costs_s = tracker.update(report.forward_s, report.backward_s)
        # One decision per report, as in the trainer: the pack first (judged against the
        # rebalanced partition), the rebalancing rule only when it did not pack.
        packing_due = (report_index + 1) % setup.packing.interval == 0
        packed = packing and packing_due and timeline.steps_left > 0
        packed = packed and _pack(timeline, report, costs_s, setup)
        if rebalances and not packed and timeline.steps_left > 0:
            _rebalance(timeline, balance, report, costs_s, report_index, setup)
        report_index += 1
        if progress is not None:
            progress(len(timeline.step_times_s), num_steps)
    return timeline.result(algorithm)


def _plan_pack(
    costs_s: list[float],
    parts: list[int],
    report: CostReport,
    setup: ReplaySetup,
    steps_left: int,
) -> list[int] | None:
    """The trainer's packing decision on the smoothed costs: the new partition, or None.

    Its closed-form step model is calibrated, as in the trainer, against the step it would
    have measured: here the simulated one (at the report's wall-per-CPU ratio, overheads
    included). Memory capacity is not modelled (every candidate fits)."""
    pk = setup.packing
    k = report.wall_s_per_cpu_s
    measured_s = _step_times_s(report, parts, setup, [k])[k]
    request = PackRequest(
        num_microbatches=setup.num_microbatches,
        tokens_per_step=float(setup.num_microbatches),  # only ratios of it matter
        ranks_per_node=pk.ranks_per_node,
        steps_left=steps_left,
        restart_overhead_s=pk.restart_overhead_s,
        pack_policy=pk.pack_policy,
        max_slowdown=pk.max_slowdown,
        min_stages=pk.min_stages,
        comm_s=setup.comm_s,
        num_cpu_slots=None if setup.cores is None else max(1, int(setup.cores)),
        measured_step_s=measured_s,
        original_stages=setup.num_stages,
    )
    plan = plan_pack(costs_s, parts, request)
    return list(plan.chosen.parts) if plan.pack else None
