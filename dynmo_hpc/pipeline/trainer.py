"""The per-rank training loop: schedule, clip, step, report, checkpoint.

Runs on every rank of an MPI job (see :mod:`dynmo_hpc.launch.worker`); rank ``r`` is pipeline stage
``r``. Everything collective happens at step boundaries, in the same order on every rank:

1. the stage runs its schedule (point-to-point with neighbours only);
2. ``Allreduce`` of per-layer squared gradient norms (global-norm clipping);
3. optimizer step;
4. ``gather`` of the step's losses and stage times to rank 0 (progress, run log);
5. every ``balance.interval`` steps, a load report (per-layer costs and bytes) to rank 0, whose
   balancing decision is broadcast; if it enacts a new partition, layers migrate
   (:mod:`dynmo_hpc.pipeline.migration`) before the next step (:mod:`.load_report`). Both count
   in the step's logged time: the pipeline waits for them.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance import uniform
from dynmo_hpc.config import JobConfig
from dynmo_hpc.handoff.env import launch_unix_s
from dynmo_hpc.handoff.resize import take_phases, write_request
from dynmo_hpc.model.optim import clip_coefficient, lr_at, squared_grad_norm
from dynmo_hpc.model.schemes import SchemeController
from dynmo_hpc.pipeline import checkpoint, resume
from dynmo_hpc.pipeline.comm import make_link
from dynmo_hpc.pipeline.costs import (
    CostTracker,
    IntervalAccumulator,
)
from dynmo_hpc.pipeline.data import TextDataset
from dynmo_hpc.pipeline.device import pick_device
from dynmo_hpc.pipeline.elastic import PackController, resize_event
from dynmo_hpc.pipeline.lifecycle import (
    FaultPoints,
    StopRequest,
    TrainResult,
    count_nodes,
    inject_failure,
    log_failures,
    log_progress,
)
from dynmo_hpc.pipeline.load_report import LoadReporting
from dynmo_hpc.pipeline.migration import measure_bandwidth
from dynmo_hpc.pipeline.schedule import build_schedule
from dynmo_hpc.pipeline.stage import PipelineStage, StepStats

log = logging.getLogger(__name__)


def initial_partition(cfg: JobConfig) -> list[int]:
    """``pipeline.partition`` if given, else Megatron's uniform split of all layers."""
    if cfg.pipeline.partition is not None:
        return list(cfg.pipeline.partition)
    return uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages)


class Trainer(LoadReporting):
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
        self.pipeline_step_s = deque(maxlen=cfg.balance.interval)
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
        launched_unix_s = launch_unix_s()
        if self.rank == 0:
            if math.isfinite(launched_unix_s):
                self.packer.startup_s = time.time() - launched_unix_s
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

    # ------------------------------------------------------------------ the loop
    def step(self, step: int) -> StepStats:
        """One training step, then its load report (and migration) when one is due; the step's
        logged time and tokens/s span both, since the next step waits for them."""
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
        self.pipeline_step_s.append(time.perf_counter() - t0)
        reported = (step + 1) % cfg.balance.interval == 0 or step + 1 == cfg.train.steps
        if reported:
            self._load_report(step)
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
            if reported:
                self.writer.flush()
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
        stop = StopRequest()
        try:
            last_step = cfg.train.steps
            saved_step = -1
            resized = False
            for step in range(self.start_step, cfg.train.steps):
                self.step(step)
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
                # None, not Infinity, for one rank (no link): strict JSON
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s
                if math.isfinite(self.bandwidth_bytes_per_s)
                else None,
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
