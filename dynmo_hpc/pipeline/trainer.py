"""The per-rank training loop: schedule, clip, step, report, checkpoint.

Runs on every rank of an MPI job (see :mod:`dynmo_hpc.launch.worker`); rank ``r`` is pipeline stage
``r``. Everything collective happens at step boundaries, in the same order on every rank:

1. the stage runs its schedule (point-to-point with neighbours only);
2. ``Allreduce`` of per-layer squared gradient norms (global-norm clipping);
3. optimizer step;
4. ``gather`` of the step's losses and stage times to rank 0 (progress, run log);
5. every ``balance.interval`` steps, a load report (per-layer costs and bytes) to rank 0, whose
   balancing decision is broadcast; if it enacts a new partition, layers migrate
   (:mod:`dynmo_hpc.pipeline.migration`) before the next step.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance import uniform
from dynmo_hpc.config import JobConfig
from dynmo_hpc.launch.local import LAUNCH_TIME_ENV
from dynmo_hpc.launch.resize import take_phases, write_request
from dynmo_hpc.model.optim import clip_coefficient, lr_at, squared_grad_norm
from dynmo_hpc.model.schemes import SchemeController
from dynmo_hpc.pipeline import checkpoint, resume
from dynmo_hpc.pipeline.comm import make_link
from dynmo_hpc.pipeline.costs import (
    CostTracker,
    IntervalAccumulator,
    LoadReport,
    RankReport,
    assemble_load_report,
)
from dynmo_hpc.pipeline.data import TextDataset
from dynmo_hpc.pipeline.device import peak_memory_bytes, pick_device
from dynmo_hpc.pipeline.elastic import PackController, pack_result_event, resize_event
from dynmo_hpc.pipeline.lifecycle import (
    FaultPoints,
    StopRequest,
    TrainResult,
    count_nodes,
    inject_failure,
    log_failures,
    log_progress,
)
from dynmo_hpc.pipeline.migration import MigrationStats, measure_bandwidth, migrate
from dynmo_hpc.pipeline.rebalance import decide
from dynmo_hpc.pipeline.schedule import build_schedule
from dynmo_hpc.pipeline.stage import PipelineStage, StepStats

log = logging.getLogger(__name__)


def initial_partition(cfg: JobConfig) -> list[int]:
    """``pipeline.partition`` if given, else Megatron's uniform split of all layers."""
    if cfg.pipeline.partition is not None:
        return list(cfg.pipeline.partition)
    return uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages)


class Trainer:
    """Owns one rank's stage, the step loop and rank 0's reporting."""

    def __init__(
        self,
        cfg: JobConfig,
        comm: MPI.Comm,
        run_dir: Path,
        resume_from: Path | None = None,
        *,
        restart: bool = False,
    ) -> None:
        """``restart``: a restart after a failure that left no checkpoint (starts over)."""
        num_stages = cfg.pipeline.num_stages
        if comm.size != num_stages:
            raise RuntimeError(
                f"MPI world size ({comm.size}) != pipeline.num_stages ({num_stages}); "
                f"HINT: launch with -n {num_stages} or set pipeline.num_stages={comm.size}"
            )
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank
        self.run_dir = run_dir
        self.faults = FaultPoints(cfg, self.rank, run_dir)
        self.faults.enter("start", -1)
        self.num_nodes = count_nodes(comm)
        torch.set_num_threads(cfg.runtime.threads_per_rank)
        self.device = pick_device(cfg.runtime.device)
        self.dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
        state: dict[str, Any] | None = None
        # torch.optim imports torch._dynamo when the first optimizer is built (2-3 s of CPU
        # here): every run pays it once, so pay it before the restore clock starts.
        importlib.import_module("torch._dynamo")

        restore_t0 = time.perf_counter()
        if resume_from is not None:
            # Rank 0 verifies (reads every file once) and shares the run state.
            checked = resume.checked_resume_dir(cfg, resume_from) if self.rank == 0 else None
            state = comm.bcast(checked[1] if checked else None, root=0)
            assert state is not None
            self.parts = resume.resume_partition(cfg, state)
        else:
            self.parts = initial_partition(cfg)
        self.start_step = int(state["step"]) if state else 0
        self.link = make_link(cfg.runtime.p2p, comm, self.rank, num_stages, self.device)
        self.pipeline_stage = PipelineStage(
            cfg,
            self.rank,
            self.parts,
            self.link,
            self.dataset,
            self.device,
            build_layers=resume_from is None,
        )
        restore_s = 0.0
        if resume_from is not None:
            restore_s = resume.restore_layers(self.pipeline_stage, resume_from, comm, restore_t0)
        self.pipeline_stage.check_invariants()
        self.schemes = SchemeController(cfg)
        if resume_from is not None:
            self.schemes.resume(self.pipeline_stage.slots, comm.allgather)
            self.pipeline_stage.frozen_prefix_end = self.schemes.frozen_prefix_end
        self.migration_comm = comm.Dup()
        self.accumulator = IntervalAccumulator()
        self.tracker = CostTracker(cfg.model.num_layers, cfg.balance.smoothing)
        self.num_reports = 0
        self.bandwidth_bytes_per_s = (
            measure_bandwidth(self.migration_comm) if cfg.balance.algorithm != "static" else 0.0
        )
        self.result = TrainResult()
        if state is not None:
            balancer = state.get("balancer", {})
            self.tracker.costs_s = balancer.get("costs_s")
            self.num_reports = int(balancer.get("num_reports", 0))
            history = state.get("history", {})
            self.result.losses = list(history.get("losses", []))
            self.result.tokens_per_s = list(history.get("tokens_per_s", []))
            self.result.step_time_s = list(history.get("step_time_s", []))
        self.last_checkpoint_monotonic = time.monotonic()
        self.writer: Any = None
        if self.rank == 0:
            restart_info = None
            if resume_from is not None and state is not None:
                restart_info = {
                    "checkpoint": str(resume_from),
                    "checkpoint_step": self.start_step,
                    "restore_s": restore_s,
                    "parts": self.parts,
                    "saved_parts": state["parts"],
                }
            elif restart:
                restart_info = {"checkpoint": None, "checkpoint_step": 0, "parts": self.parts}
                log.info(
                    "resumed from %s (step %d) in %.2f s on partition %s",
                    resume_from,
                    self.start_step,
                    restore_s,
                    self.parts,
                )
            self.writer = self._open_runlog(restart_info)
            log_failures(self.writer, run_dir)
            if resume_from is not None:
                self._log_skipped_checkpoints(resume_from)
        self.pack_target: dict[str, Any] | None = None
        """Set on every rank when rank 0 decided to pack: the stage count and partition."""
        self.packer = PackController(cfg, comm.size, self.num_nodes, self.device)
        launch_unix_s = float(os.environ.get(LAUNCH_TIME_ENV, "nan"))
        if self.rank == 0:
            if math.isfinite(launch_unix_s):
                self.packer.startup_s = time.time() - launch_unix_s
            if resume_from is not None:
                self._log_resize(restore_s)

    # ------------------------------------------------------------------ rank-0 reporting
    def _open_runlog(self, restart: dict[str, Any] | None) -> Any:
        from dynmo_hpc.runlog.writer import RunLogWriter

        meta: dict[str, str | int | float] = {
            "launcher": "mpi",
            "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0][:200],
            "world_size": self.comm.size,
            "mpi_host": MPI.Get_processor_name(),
            "device": str(self.device),
            "torch_version": str(torch.__version__),
        }
        # A resumed run appends to its log; a new run never replaces one (the launcher refuses
        # an occupied run directory unless asked to overwrite, and then removes the old log).
        return RunLogWriter(
            self.run_dir / "run.h5",
            config_yaml=self.cfg.to_yaml(),
            meta=meta,
            resume=restart is not None,
            redo_from_step=self.start_step if restart is not None else None,
            restart_detail=restart,
        )

    def _log_skipped_checkpoints(self, chosen: Path) -> None:
        """Warn (log and run log) about newer checkpoints that were damaged or incomplete."""
        chosen_step = int(chosen.name.removeprefix("step_"))
        for candidate in checkpoint.scan(chosen.parent):
            if candidate.step > chosen_step and candidate.problem is not None:
                log.warning("skipped checkpoint %s: %s", candidate.path, candidate.problem)
                self.writer.log_event(
                    step=self.start_step,
                    kind="checkpoint_skipped",
                    detail={"path": str(candidate.path), "problem": candidate.problem},
                )

    def _log_resize(self, restore_s: float) -> None:
        """Rank 0 of a relaunched step: log the resize that started it, phase by phase."""
        phases = take_phases(self.run_dir)
        if phases is None:
            return
        detail = resize_event(phases, restore_s, time.time(), self.num_nodes)
        self.packer.last_resize_s = detail["total_s"]
        self.packer.predicted_tokens_per_s = detail["predicted_tokens_per_s_after"]
        self.writer.log_event(step=self.start_step - 1, kind="resize", detail=detail)
        log.warning("resized: %s", {k: v for k, v in detail.items() if k.endswith("_s")})

    def _pack_result(self, step: int) -> None:
        """Rank 0, first report after a pack: the measured throughput beside the prediction."""
        predicted, self.packer.predicted_tokens_per_s = self.packer.predicted_tokens_per_s, None
        detail = pack_result_event(predicted, self.result.tokens_per_s[self.start_step :])
        if detail is not None:
            self.writer.log_event(step=step, kind="pack_result", detail=detail)

    def _load_report(self, step: int) -> None:
        """Gather per-layer costs and bytes to rank 0, record them, balance, maybe migrate."""
        forward_s, backward_s = self.accumulator.mean_per_step()
        mine = RankReport(
            forward_s=forward_s,
            backward_s=backward_s,
            sizes=self.pipeline_stage.layer_sizes(),
            peak_mem_bytes=peak_memory_bytes(self.device),
        )
        self.faults.enter("load_report", step)
        self.faults.strike("load_report", step)
        gathered = self.comm.gather(mine, root=0)
        plan_parts: list[int] | None = None
        pack_target: dict[str, Any] | None = None
        if self.rank == 0:
            report = assemble_load_report(step, self.cfg.model.num_layers, gathered)
            plan_parts = self._record_and_decide(report)
            pack_target = self._consider_pack(report)
            if pack_target is not None:
                plan_parts = None  # the layers move through the pack's checkpoint instead
            self._pack_result(step)
        new_parts, self.pack_target = self.comm.bcast((plan_parts, pack_target), root=0)
        self.num_reports += 1
        if new_parts is not None:
            self.faults.enter("migration", step)
            self.faults.strike("migration", step)  # its peers are inside the exchange
            stats = migrate(
                self.pipeline_stage,
                self.migration_comm,
                new_parts,
                on_chunk=lambda _item, _k, chunk: self.faults.strike("migration", step, chunk),
            )
            totals = self.comm.gather(stats, root=0)
            self.parts = list(new_parts)
            if self.rank == 0:
                self._record_migration(step, totals)
        if self.rank == 0:
            self.writer.flush()

    def _consider_pack(self, report: LoadReport) -> dict[str, Any] | None:
        """Rank 0: the packing decision (logged); the target stage count and partition, or None."""
        recent = self.result.step_time_s[-self.cfg.balance.interval :]
        costs_s = self.tracker.costs_s
        if costs_s is None:
            return None
        plan = self.packer.consider(
            report,
            costs_s,
            self.parts,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            measured_step_s=float(np.median(recent)) if recent else None,
        )
        if plan is None:
            return None
        detail = plan.to_event()
        recent_tps = self.result.tokens_per_s[-self.cfg.balance.interval :]
        detail["measured_tokens_per_s_before"] = (
            float(np.median(recent_tps)) if recent_tps else None
        )
        self.writer.log_event(step=report.step, kind="pack", detail=detail)
        log.info("step %d: %s", report.step + 1, plan.reason)
        if not plan.pack:
            return None
        return detail

    def _resize(self, step: int) -> None:
        """Every rank: checkpoint for the pack; rank 0 asks the manager for the resize."""
        assert self.pack_target is not None
        directory = self.save_checkpoint(step + 1)
        if self.rank == 0:
            write_request(
                self.run_dir,
                {
                    **self.pack_target,
                    "num_stages": self.pack_target["to_stages"],
                    "parts": self.pack_target["parts"],
                    "step": step + 1,
                    "checkpoint": str(directory),
                    "checkpoint_s": self.packer.last_checkpoint_s,
                    "requested_unix_s": time.time(),
                },
            )
            log.warning(
                "packing %d -> %d stages after step %d: checkpoint %s, ending this MPI step",
                self.cfg.pipeline.num_stages,
                self.pack_target["to_stages"],
                step + 1,
                directory,
            )

    def _record_migration(self, step: int, totals: list[MigrationStats]) -> None:
        """Rank 0: log the migration and update the bandwidth the decision rule predicts with."""
        moved = sum(t.bytes_sent for t in totals)
        seconds = max(t.seconds for t in totals)
        # The decision rule prices a migration as the busiest rank's bytes / bandwidth, so the
        # bandwidth it learns is exactly that ratio, as this migration achieved it.
        busiest = max(max(t.bytes_sent, t.bytes_received) for t in totals)
        if busiest and seconds > 0:
            self.bandwidth_bytes_per_s = busiest / seconds
        self.writer.log_event(
            step=step,
            kind="migrate",
            detail={
                "new_parts": self.parts,
                "num_moves": totals[0].num_moves,
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

    def _record_and_decide(self, report: LoadReport) -> list[int] | None:
        """Rank 0: write the report to the run log, smooth the costs, decide; the new partition
        to migrate to, or None."""
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
        costs_s = self.tracker.update(report.forward_s, report.backward_s)
        if self.cfg.balance.algorithm == "static" or report.step + 1 >= self.cfg.train.steps:
            return None  # static, or after the last step: a migration could not pay back
        plan = decide(
            self.cfg.balance,
            costs_s=costs_s,
            num_params=report.num_params,
            layer_bytes=report.layer_bytes,
            parts=self.parts,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            report_index=self.num_reports,
        )
        if plan.enact:
            self.writer.log_event(step=report.step, kind="rebalance", detail=plan.to_event())
            log.info("step %d: rebalance %s -> %s", report.step + 1, self.parts, plan.new_parts)
        return plan.parts_to_enact

    # ------------------------------------------------------------------ the loop
    def step(self, step: int) -> StepStats:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.faults.enter("step", step)
        if cfg.runtime.fail_at_step == step and self.rank == cfg.runtime.fail_rank:
            inject_failure(cfg.runtime.fail_mode, self.rank, step)
        actions = build_schedule(
            cfg.pipeline.schedule, self.rank, cfg.pipeline.num_stages, cfg.train.num_microbatches
        )
        stats = self.pipeline_stage.run_schedule(step, actions)
        self.accumulator.add(stats.forward_s, stats.backward_s)

        sq_norms = np.zeros(cfg.model.num_layers, dtype=np.float64)
        for slot in self.pipeline_stage.slots:
            sq_norms[slot.index] = squared_grad_norm(slot.module)
        self.comm.Allreduce(MPI.IN_PLACE, sq_norms, op=MPI.SUM)
        coefficient = clip_coefficient(sq_norms.tolist(), cfg.train.grad_clip)
        lr = lr_at(step, cfg.train)
        self.pipeline_stage.optimizer_step(lr, coefficient)
        scheme_events = self.schemes.step_end(step, self.pipeline_stage.slots, self.comm.allgather)
        self.pipeline_stage.frozen_prefix_end = self.schemes.frozen_prefix_end

        gathered = self.comm.gather(
            (stats.lm_loss_sum, stats.aux_loss_sum, stats.compute_s, stats.idle_s), root=0
        )
        step_time_s = time.perf_counter() - t0
        if self.rank == 0:
            loss = sum(g[0] for g in gathered)
            tokens_per_s = cfg.tokens_per_step / step_time_s
            self.result.losses.append(loss)
            self.result.tokens_per_s.append(tokens_per_s)
            self.result.step_time_s.append(step_time_s)
            self.writer.log_step(
                step=step,
                loss=loss,
                step_time_s=step_time_s,
                tokens_per_s=tokens_per_s,
                lr=lr,
                num_stages=cfg.pipeline.num_stages,
                num_ranks=self.comm.size,
                num_nodes=self.num_nodes,
            )
            self.writer.log_stage_times(
                step=step, compute_s=[g[2] for g in gathered], idle_s=[g[3] for g in gathered]
            )
            for event in scheme_events:
                self.writer.log_event(step=step, kind=event["kind"], detail=event)
            log_progress(cfg, self.result, step, loss, sum(g[1] for g in gathered))
        return stats

    def train(self) -> TrainResult:
        cfg = self.cfg
        if self.rank == 0:
            log.info(
                "training %s: %d layers on %d stages %s, %d steps x %d microbatches of %d x %d",
                cfg.job.name,
                cfg.model.num_layers,
                cfg.pipeline.num_stages,
                self.parts,
                cfg.train.steps,
                cfg.train.num_microbatches,
                cfg.train.micro_batch_size,
                cfg.model.seq_len,
            )
        interval = cfg.balance.interval
        stop = StopRequest()
        try:
            last_step = cfg.train.steps
            saved_step = -1
            resized = False
            for step in range(self.start_step, cfg.train.steps):
                self.step(step)
                if (step + 1) % interval == 0 or step + 1 == cfg.train.steps:
                    self._load_report(step)
                # One collective per step: any rank's stop signal, rank 0's checkpoint clock.
                flags = np.array([stop.signum, self._minutes_due()], dtype=np.int64)
                self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
                if flags[0]:
                    last_step = step + 1
                    self._preempted(step, int(flags[0]))
                    break
                if self.pack_target is not None:
                    self._resize(step)
                    resized = True
                    break
                every = cfg.checkpoint.every_steps
                if step + 1 < cfg.train.steps and ((every and (step + 1) % every == 0) or flags[1]):
                    self.save_checkpoint(step + 1)
                    saved_step = step + 1
            if resized:  # the next MPI step carries on: no result, no final checkpoint
                stop.restore()
                self.faults.close()
                if self.writer is not None:
                    self.writer.close(status="resize")
                return self.result
            if (cfg.checkpoint.at_end or last_step < cfg.train.steps) and saved_step != last_step:
                self.save_checkpoint(last_step)
            self.result.parts = list(self.parts)
            self.result.completed_steps = last_step
            self.result.num_steps = cfg.train.steps
            if self.rank == 0:
                atomic_write_text(
                    self.run_dir / "result.json", json.dumps(self.result.to_json(), indent=1)
                )
        except BaseException as exc:
            stop.restore()
            if self.writer is not None:
                self.writer.log_event(
                    step=len(self.result.losses),
                    kind="error",
                    detail={"type": type(exc).__name__, "message": str(exc)[:2000]},
                )
                self.writer.close(status="error")
                self.writer = None
            raise
        stop.restore()
        self.faults.close()
        if self.writer is not None:
            self.writer.close()
        return self.result

    def _minutes_due(self) -> int:
        """1 if rank 0's clock says a time-based checkpoint is due (other ranks say 0)."""
        minutes = self.cfg.checkpoint.every_minutes
        if self.rank != 0 or not minutes:
            return 0
        return int(time.monotonic() - self.last_checkpoint_monotonic >= 60.0 * minutes)

    def _preempted(self, step: int, signum: int) -> None:
        """SIGUSR2/SIGTERM (SLURM's warning before the time limit or a preemption) arrived."""
        if self.rank == 0:
            self.writer.log_event(
                step=step, kind="preempt", detail={"signal": signum, "completed_steps": step + 1}
            )
            log.warning(
                "signal %d: stopping after step %d of %d and writing a checkpoint",
                signum,
                step + 1,
                self.cfg.train.steps,
            )

    def run_state(self, step: int) -> dict[str, Any]:
        """Rank 0: the run's state after ``step`` completed steps (see :mod:`.resume`)."""
        cfg = self.cfg
        return {
            "step": step,
            "num_stages": cfg.pipeline.num_stages,
            "parts": list(self.parts),
            "num_layers": cfg.model.num_layers,
            "identity": resume.identity(cfg),
            "config_sha256": resume.config_sha256(cfg),
            "data": {"next_step": step, "batches": "pure function of (job.seed, step, microbatch)"},
            "lr_schedule": {"next_step": step, "next_lr": lr_at(step, cfg.train)},
            "rng": {"seed": cfg.job.seed, "stateful_generators": []},
            "frozen_prefix_end": self.schemes.frozen_prefix_end,
            "balancer": {
                "costs_s": self.tracker.costs_s,
                "num_reports": self.num_reports,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            },
            "history": {
                "losses": self.result.losses,
                "tokens_per_s": self.result.tokens_per_s,
                "step_time_s": self.result.step_time_s,
            },
        }

    def save_checkpoint(self, step: int) -> Path:
        """Write checkpoint ``step`` (collective) and log it on rank 0."""
        state = self.run_state(step) if self.rank == 0 else None
        self.faults.enter("checkpoint", step - 1)
        directory, seconds, num_bytes = resume.save(
            self.comm,
            self.run_dir,
            step,
            self.pipeline_stage,
            self.cfg.checkpoint.keep,
            state,
            after_files=lambda: self.faults.strike("checkpoint", step - 1),
        )
        self.last_checkpoint_monotonic = time.monotonic()
        if self.rank == 0:
            self.packer.last_checkpoint_s = seconds
            self.writer.log_event(
                step=step - 1,
                kind="checkpoint",
                detail={
                    "path": str(directory),
                    "step": step,
                    "seconds": seconds,
                    "bytes": num_bytes,
                },
            )
            self.writer.flush()
            log.info(
                "checkpoint step %d: %.1f MB in %.2f s -> %s",
                step,
                num_bytes / 1e6,
                seconds,
                directory,
            )
        return directory
