"""The trainer's load report: gather per-layer costs to rank 0, decide, broadcast, migrate.

Why its own module: it is the one collective of the step loop that can change where layers run,
with its rank-0 bookkeeping (run log, cost smoothing, the balancing and packing decisions, the
bandwidth the decision rule learns). :class:`LoadReporter` owns that state (the partition in
force, the smoothed costs, the report count, the learnt bandwidth, a pending pack) and is given
everything else it uses when it is built; :class:`dynmo_hpc.train.trainer.Trainer` calls
:meth:`LoadReporter.report` after each report step and reads the state for its checkpoints.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from dynmo_hpc.balance import uniform
from dynmo_hpc.balance.registry import ALGORITHMS, STATIC
from dynmo_hpc.config import JobConfig
from dynmo_hpc.pipeline.costs import (
    CostTracker,
    IntervalAccumulator,
    LoadReport,
    RankReport,
    assemble_load_report,
)
from dynmo_hpc.pipeline.device import peak_memory_bytes
from dynmo_hpc.pipeline.migration.move import MigrationError, MigrationStats, migrate
from dynmo_hpc.pipeline.stage import PipelineStage
from dynmo_hpc.testing.fault_injection import FaultInjector
from dynmo_hpc.train.ab_arms import ABSwitch, lead_arm
from dynmo_hpc.train.lifecycle import PhaseTracker, TrainResult
from dynmo_hpc.train.pack_inputs import PackController, pack_result_event
from dynmo_hpc.train.rebalance import decide

log = logging.getLogger(__name__)


@dataclass
class ReportState:
    """What the load reports carry from one to the next (and a checkpoint saves)."""

    parts: list[int]
    """The partition in force."""
    tracker: CostTracker
    """The smoothed per-layer costs."""
    bandwidth_bytes_per_s: float
    """What the decision rule prices a migration with; learnt from each migration."""
    num_reports: int = 0


class LoadReporter:
    """The load-report collective and rank 0's decisions (see the module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        comm: MPI.Comm,
        migration_comm: MPI.Comm,
        stage: PipelineStage,
        state: ReportState,
        *,
        phases: PhaseTracker,
        faults: FaultInjector,
        packer: PackController,
        history: TrainResult,
        start_step: int,
    ) -> None:
        """``history``: rank 0's per-step results (its tokens/s feed the packing decision);
        ``start_step``: the first step of this launch (a pack's result is measured from it)."""
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank
        self.migration_comm = migration_comm
        self.stage = stage
        self.state = state
        self.phases = phases
        self.faults = faults
        self.packer = packer
        self.history = history
        self.start_step = start_step
        self.writer: Any = None
        """Rank 0's run log, once the trainer opened it."""
        self.accumulator = IntervalAccumulator()
        self._placed_once = False
        """A static baseline (``balance.algorithm`` that does not rebalance) has decided."""
        self.pack_target: dict[str, Any] | None = None
        """Set on every rank when rank 0 decided to pack: the stage count and partition."""
        self.pipeline_step_s: deque[float] = deque(maxlen=cfg.balance.interval)
        """Rank 0, the last ``balance.interval`` steps: seconds of schedule, clipping, optimizer
        and gather without the load report or migration: the steady pace the packer's model
        predicts (a migration is a one-off, and its time is in the logged step time)."""
        self.allreduce_s: deque[float] = deque(maxlen=cfg.balance.interval)
        """Rank 0: each recent step's gradient all-reduce (its slowest rank's), for packing."""
        self.ab: ABSwitch | None = None
        """Rank 0 of an A/B run (``balance.ab_period_steps``): which partition each block runs."""
        if cfg.balance.ab_period_steps:
            # arm A is the job's own split even after a resume into a B block
            static = cfg.pipeline.partition or uniform(
                [1.0] * cfg.model.num_layers, cfg.pipeline.num_stages
            )
            self.ab = ABSwitch(
                cfg.balance.ab_period_steps,
                list(static),
                list(state.parts),
                lead_arm(cfg.balance.ab_lead),
            )

    @property
    def parts(self) -> list[int]:
        return self.state.parts

    def _pack_result(self, step: int) -> None:
        """Rank 0, first report after a pack: the measured throughput beside the prediction."""
        predicted, self.packer.predicted_tokens_per_s = self.packer.predicted_tokens_per_s, None
        detail = pack_result_event(predicted, self.history.tokens_per_s[self.start_step :])
        if detail is not None:
            self.packer.history.learn(detail)
            detail["correction"] = self.packer.history.correction
            self.writer.log_event(step=step, kind="pack_result", detail=detail)

    def report(self, step: int) -> None:
        """Gather per-layer costs and bytes to rank 0, record them, balance, maybe migrate.

        Runs inside the step it reports on (:meth:`dynmo_hpc.train.trainer.Trainer.step`),
        so that step's time includes it; rank 0 flushes the run log once the step's row is
        written."""
        forward_s, backward_s = self.accumulator.mean_per_step()
        mine = RankReport(
            forward_s=forward_s,
            backward_s=backward_s,
            sizes=self.stage.layer_sizes(),
            peak_mem_bytes=peak_memory_bytes(self.stage.device),
        )
        self.phases.enter("load_report", step)
        self.faults.at("load_report", step)
        gathered = self.comm.gather(mine, root=0)
        plan_parts: list[int] | None = None
        pack_target: dict[str, Any] | None = None
        if self.rank == 0:
            report = assemble_load_report(
                step, self.cfg.model.num_layers, gathered, self.cfg.pipeline.replicas
            )
            self._pack_result(step)  # its correction applies to this report's decision
            costs_s = self._record(report)
            # One decision per report: the pack is judged against the best partition at this
            # size (what a rebalance reaches), so only when it does not pack does the
            # rebalancing rule decide; a pack moves the layers through its checkpoint.
            pack_target = self._consider_pack(report)
            if pack_target is None:
                plan_parts = self._decide(report, costs_s)
        new_parts, self.pack_target = self.comm.bcast((plan_parts, pack_target), root=0)
        self.state.num_reports += 1
        if new_parts is not None:
            self.phases.enter("migration", step)
            self.faults.at("migration", step)  # its peers are inside the exchange
            stats = self._migrate(step, new_parts)
            totals = self.comm.gather(stats, root=0)
            self.state.parts = list(new_parts)
            if self.rank == 0:
                self._record_migration(step, totals)

    def _migrate(self, step: int, new_parts: list[int]) -> MigrationStats:
        """Every replica moves the same layers at once, each over its own pipeline
        (``migration_comm``); a replica whose migration failed verification makes every rank
        raise (the replicas must never hold different partitions)."""
        failure: MigrationError | None = None
        try:
            stats = migrate(
                self.stage, self.migration_comm, new_parts, on_chunk=self.faults.chunk_hook(step)
            )
        except MigrationError as exc:
            failure = exc
        if self.cfg.pipeline.replicas > 1 and self.comm.allreduce(failure is not None, MPI.LOR):
            raise failure or MigrationError(
                f"migration to partition {new_parts} failed verification in another replica; "
                "HINT: resume from the last checkpoint"
            )
        if failure is not None:
            raise failure
        return stats

    def _consider_pack(self, report: LoadReport) -> dict[str, Any] | None:
        """Rank 0: the packing decision (logged); the target stage count and partition, or None."""
        recent = list(self.pipeline_step_s)
        costs_s = self.state.tracker.costs_s
        if costs_s is None:
            return None
        plan = self.packer.consider(
            report,
            costs_s,
            self.parts,
            bandwidth_bytes_per_s=self.state.bandwidth_bytes_per_s,
            measured_step_s=float(np.median(recent)) if recent else None,
            allreduce_s=float(np.median(self.allreduce_s)) if self.allreduce_s else 0.0,
        )
        if plan is None:
            return None
        detail = plan.to_event()
        recent_tps = self.history.tokens_per_s[-self.cfg.balance.interval :]
        detail["measured_tokens_per_s_before"] = (
            float(np.median(recent_tps)) if recent_tps else None
        )
        self.writer.log_event(step=report.step, kind="pack", detail=detail)
        log.info("step %d: %s", report.step + 1, plan.reason)
        if not plan.pack:
            return None
        return detail

    def _record_migration(self, step: int, totals: list[MigrationStats]) -> None:
        """Rank 0: log the migration and update the bandwidth the decision rule predicts with."""
        moved = sum(t.bytes_sent for t in totals)
        seconds = max(t.seconds for t in totals)
        # The decision rule prices a migration as the busiest rank's bytes (sent plus received:
        # they share the rank's one progress loop, which hashes both) / bandwidth, so the
        # bandwidth it learns is exactly that ratio, as this migration achieved it.
        busiest = max(t.bytes_sent + t.bytes_received for t in totals)
        if busiest and seconds > 0:
            self.state.bandwidth_bytes_per_s = busiest / seconds
        self.writer.log_event(
            step=step,
            kind="migrate",
            detail={
                "new_parts": self.parts,
                "num_moves": totals[0].num_moves,
                "num_replicas": self.cfg.pipeline.replicas,
                "bytes_moved": moved,
                "seconds": seconds,
            },
        )
        log.info(
            "step %d: migrated %d layers (%.1f MB in %.3f s), partition now %s",
            step + 1,
            totals[0].num_moves,
            moved / 1e6,
            seconds,
            self.parts,
        )

    def _record(self, report: LoadReport) -> list[float]:
        """Rank 0: write the report to the run log and smooth the costs (returned)."""
        self.writer.log_layer_report(
            step=report.step,
            forward_s=report.forward_s,
            backward_s=report.backward_s,
            num_params=report.num_params,
            param_bytes=[s.param_bytes for s in report.sizes],
            grad_bytes=[s.grad_bytes for s in report.sizes],
            optim_bytes=[s.optim_bytes for s in report.sizes],
            parts=self.parts,
            peak_mem_bytes=report.peak_mem_bytes,
        )
        return self.state.tracker.update(report.forward_s, report.backward_s)

    def _decide(self, report: LoadReport, costs_s: list[float]) -> list[int] | None:
        """Rank 0: the rebalancing decision on the smoothed costs; the new partition to migrate
        to, or None."""
        if self.cfg.balance.algorithm == STATIC or report.step + 1 >= self.cfg.train.steps:
            return None  # static, or after the last step: a migration could not pay back
        if not ALGORITHMS[self.cfg.balance.algorithm].rebalances:
            # A static baseline places the layers once, at the first report of this launch
            # (``profiled``: from the costs measured so far), and never again.
            if self._placed_once:
                return None
            self._placed_once = True
        plan = decide(
            self.cfg.balance,
            report,
            costs_s=costs_s,
            parts=self.parts if self.ab is None else self.ab.dynmo_parts,
            bandwidth_bytes_per_s=self.state.bandwidth_bytes_per_s,
            report_index=self.state.num_reports,
            steps_left=self.cfg.train.steps - (report.step + 1),
        )
        if plan.enact:
            self.writer.log_event(step=report.step, kind="rebalance", detail=plan.to_event())
            log.info("step %d: rebalance %s -> %s", report.step + 1, self.parts, plan.new_parts)
        else:
            log.debug("step %d: keep %s: %s", report.step + 1, self.parts, plan.reason)
        if self.ab is not None:
            return self.ab.after_decision(report.step, plan.parts_to_enact, self.parts)
        return plan.parts_to_enact
