"""The per-rank training loop: schedule, clip, step, report, checkpoint.

Runs on every rank of an MPI job (see :mod:`dynmo_hpc.launch.worker`); each rank is one stage
of one data-parallel replica, as its :class:`~dynmo_hpc.pipeline.topology.Topology` says (with
one replica, rank ``r`` is stage ``r``). Everything collective happens at step boundaries, in the
same order on every rank:

1. the stage runs its replica's share of the step's microbatches (point-to-point with its
   pipeline neighbours only), then sums its gradients with the other replicas' copies of the
   stage (:mod:`dynmo_hpc.pipeline.grad_sync`, over the data communicator); with tied
   embeddings the first and last stage then sum the tied weight's two copies' gradients
   (:mod:`dynmo_hpc.pipeline.tied_grads`);
2. ``Allreduce`` of per-layer squared gradient norms over the replica's pipeline (global-norm
   clipping, each layer counted once);
3. optimizer step;
4. ``gather`` of the step's losses and stage times to rank 0 (progress, run log);
5. every ``balance.interval`` steps, a load report (per-layer costs and bytes) to rank 0, whose
   balancing decision is broadcast; if it enacts a new partition, layers migrate
   (:mod:`dynmo_hpc.pipeline.migration.move`) before the next step (:mod:`.load_report`). Both count
   in the step's logged time: the pipeline waits for them.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance import uniform
from dynmo_hpc.balance.registry import STATIC
from dynmo_hpc.checkpoint import resume, store
from dynmo_hpc.checkpoint.lineage import Key
from dynmo_hpc.config import JobConfig
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.handoff import env
from dynmo_hpc.handoff.resize import size_change, write_request
from dynmo_hpc.model.optim import clip_coefficient, lr_at, squared_grad_norm
from dynmo_hpc.model.schemes import SchemeController
from dynmo_hpc.model.tied import norm_exclusions
from dynmo_hpc.pipeline.comm import make_link
from dynmo_hpc.pipeline.costs import CostTracker
from dynmo_hpc.pipeline.device import pick_device
from dynmo_hpc.pipeline.evaluate import evaluate, is_eval_step
from dynmo_hpc.pipeline.grad_sync import GradReducer, check_replicas_agree
from dynmo_hpc.pipeline.groups import make_groups
from dynmo_hpc.pipeline.migration.move import measure_bandwidth
from dynmo_hpc.pipeline.schedule import build_schedule
from dynmo_hpc.pipeline.stage import PipelineStage, StepStats
from dynmo_hpc.pipeline.tied_grads import sum_tied_grads
from dynmo_hpc.report_cycle import is_report_step
from dynmo_hpc.testing.fault_injection import make_injector
from dynmo_hpc.train.ab_arms import ab_schedule
from dynmo_hpc.train.lifecycle import PhaseTracker, StopRequest, TrainResult, count_nodes
from dynmo_hpc.train.load_report import LoadReporter, ReportState
from dynmo_hpc.train.pack_inputs import PackController
from dynmo_hpc.train.rank0_log import Rank0Log
from dynmo_hpc.train.run_state import run_state as build_run_state

log = logging.getLogger(__name__)


def initial_partition(cfg: JobConfig) -> list[int]:
    """``pipeline.partition`` if given, else Megatron's uniform split of all layers."""
    if cfg.pipeline.partition is not None:
        return list(cfg.pipeline.partition)
    return uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages)


def _shared_run_state(
    cfg: JobConfig, comm: MPI.Comm, resume_from: Path | None
) -> dict[str, Any] | None:
    """The run state of the checkpoint resumed from (None for a fresh start); collective: rank
    0 verifies the checkpoint (reads every file once) and shares the state."""
    if resume_from is None:
        return None
    checked = resume.checked_resume_dir(cfg, resume_from) if comm.rank == 0 else None
    state: dict[str, Any] | None = comm.bcast(checked[1] if checked else None, root=0)
    assert state is not None
    return state


def _restored_history(state: dict[str, Any] | None) -> TrainResult:
    """Rank 0's per-step results so far: the checkpoint's, or none."""
    result = TrainResult()
    if state is not None:
        history = state.get("history", {})
        result.losses = list(history.get("losses", []))
        result.tokens_per_s = list(history.get("tokens_per_s", []))
        result.step_time_s = list(history.get("step_time_s", []))
    return result


class Trainer:
    """One rank's training run, built from collaborators with explicit inputs.

    - the stage (:class:`~dynmo_hpc.pipeline.stage.PipelineStage`) runs the schedule;
    - the load reporter (:class:`~dynmo_hpc.train.load_report.LoadReporter`) owns the
      partition, the smoothed costs and the balancing and packing decisions;
    - the phase tracker and the fault injector (null unless a test configured one) mark the
      named phases;
    - the pack controller (:class:`~dynmo_hpc.train.pack_inputs.PackController`) and the
      checkpoint writer (:mod:`dynmo_hpc.checkpoint.resume`) serve the elastic and restart paths;
    - rank 0's run log (:class:`~dynmo_hpc.train.rank0_log.Rank0Log`) writes what the
      launch and each step did.

    The trainer itself runs the step loop and decides when each of them acts.
    """

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
        self.groups = make_groups(
            comm, cfg.pipeline.num_stages, cfg.pipeline.replicas, tied=cfg.model.tie_embeddings
        )
        self.topo = self.groups.topology
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank
        self.run_dir = run_dir
        attempt = env.attempt()
        self.phases = PhaseTracker(self.rank, run_dir, cfg.fault.phase_timeout_s, attempt)
        self.faults = make_injector(cfg.fault, self.rank, attempt)
        self.phases.enter("start", -1)
        self.num_nodes = count_nodes(comm)
        torch.set_num_threads(cfg.runtime.threads_per_rank)
        self.device = pick_device(cfg.runtime.device)
        # torch.optim imports torch._dynamo when the first optimizer is built (2-3 s of CPU
        # here): every run pays it once, so pay it before the restore clock starts.
        importlib.import_module("torch._dynamo")
        restore_t0 = time.perf_counter()
        state = _shared_run_state(cfg, comm, resume_from)
        parts = resume.resume_partition(cfg, state) if state else initial_partition(cfg)
        self.start_step = int(state["step"]) if state else 0
        self.pipeline_stage = self._build_stage(parts, resume_from is None)
        restore_s = 0.0
        if resume_from is not None:
            restore_s = resume.restore_layers(self.pipeline_stage, resume_from, comm, restore_t0)
        self.pipeline_stage.check_invariants()
        self.schemes = SchemeController(cfg)
        if resume_from is not None:
            self.schemes.resume(self.pipeline_stage.slots, self.groups.pipeline.allgather)
            self.pipeline_stage.no_grad_below = self.schemes.no_grad_below
        self.result = _restored_history(state)
        self.packer = PackController(cfg, comm.size, self.num_nodes, self.device)
        self.packer.restore(state.get("pack") if state else None)
        self.reporter = self._build_reporter(parts, state)
        self.last_checkpoint_monotonic = time.monotonic()
        self.lineage_parent = self._lineage_key(resume_from)
        """Rank 0: the checkpoint this launch resumed from or wrote last (lineage record)."""
        self.log0: Rank0Log | None = None
        """Rank 0's run log (:mod:`.rank0_log`); None on the other ranks."""
        if self.rank == 0:
            self._start_rank0_log(resume_from, state, restore_s, restart=restart)

    def _lineage_key(self, directory: Path | None) -> Key | None:
        """Rank 0: ``directory``'s lineage key (its manifest only), or None."""
        if directory is None or self.rank != 0:
            return None
        return store.key_of(store.checkpoint_root(self.run_dir), directory)

    def _build_stage(self, parts: list[int], build_layers: bool) -> PipelineStage:
        """This rank's stage on ``parts``, linked to its neighbours (layers built unless they
        come from a checkpoint)."""
        cfg, topo = self.cfg, self.topo
        link = make_link(cfg.runtime, self.groups, self.device)
        dataset = TextDataset.for_job(cfg)
        first_microbatch = topo.microbatches(cfg.train.num_microbatches).start
        return PipelineStage(
            cfg,
            topo.stage,
            parts,
            link,
            dataset,
            self.device,
            build_layers=build_layers,
            first_microbatch=first_microbatch,
        )

    def _build_reporter(self, parts: list[int], state: dict[str, Any] | None) -> LoadReporter:
        """The load reporter, its bandwidth measured (collective) and its state restored."""
        cfg = self.cfg
        # Each replica migrates over its own pipeline; all replicas probe at once and the
        # slowest rate counts: what R parallel moves get where they share links.
        migration_comm = self.groups.pipeline.Dup()
        bandwidth = measure_bandwidth(migration_comm) if cfg.balance.algorithm != STATIC else 0.0
        bandwidth = self.comm.allreduce(bandwidth, op=MPI.MIN)
        tracker = CostTracker(cfg.model.num_layers, cfg.balance.smoothing)
        balancer = state.get("balancer", {}) if state else {}
        tracker.costs_s = resume.restored_costs(cfg, state) if state else None
        report_state = ReportState(
            parts=parts,
            tracker=tracker,
            bandwidth_bytes_per_s=bandwidth,
            num_reports=int(balancer.get("num_reports", 0)),
        )
        return LoadReporter(
            cfg,
            self.comm,
            migration_comm,
            self.pipeline_stage,
            report_state,
            phases=self.phases,
            faults=self.faults,
            packer=self.packer,
            history=self.result,
            start_step=self.start_step,
        )

    @property
    def parts(self) -> list[int]:
        """The partition in force (the load reporter owns it)."""
        return self.reporter.parts

    def _start_rank0_log(
        self,
        resume_from: Path | None,
        state: dict[str, Any] | None,
        restore_s: float,
        *,
        restart: bool,
    ) -> None:
        """Rank 0: open the run log (appending after a resume or restart) and log how this
        launch started (:meth:`.Rank0Log.start`); the resume or restart line is logged here."""
        restart_info = None
        if resume_from is not None and state is not None:
            restart_info = {
                "checkpoint": str(resume_from),
                "checkpoint_step": self.start_step,
                "restore_s": restore_s,
                "parts": self.parts,
                "saved_parts": state["parts"],
            }
            log.info(
                "resumed from %s (step %d) in %.2f s on partition %s",
                resume_from,
                self.start_step,
                restore_s,
                self.parts,
            )
        elif restart:
            restart_info = {"checkpoint": None, "checkpoint_step": 0, "parts": self.parts}
            log.info(
                "restarted from the beginning (no complete checkpoint yet) on partition %s",
                self.parts,
            )
        self.log0 = Rank0Log(
            self.cfg,
            self.run_dir,
            self.result,
            num_ranks=self.comm.size,
            num_replicas=self.topo.num_replicas,
            num_nodes=self.num_nodes,
        )
        self.log0.start(
            restart_info,
            resume_from=resume_from,
            state=state,
            start_step=self.start_step,
            restore_s=restore_s,
            device=self.device,
            packer=self.packer,
        )
        self.reporter.writer = self.log0.writer

    def _resize(self, step: int) -> None:
        """Every rank: checkpoint for the pack; rank 0 asks the manager for the resize."""
        target = self.reporter.pack_target
        assert target is not None
        directory = self.save_checkpoint(step + 1)
        if self.rank == 0:
            write_request(
                self.run_dir,
                {
                    **target,
                    "num_stages": target["to_stages"],
                    "num_replicas": target["to_replicas"],
                    "parts": target["parts"],
                    "step": step + 1,
                    "checkpoint": str(directory),
                    "checkpoint_s": self.packer.last_checkpoint_s,
                    "requested_unix_s": time.time(),
                },
            )
            pipe = self.cfg.pipeline
            change = size_change(
                pipe.replicas, pipe.num_stages, target["to_replicas"], target["to_stages"]
            )
            log.warning("packing %s after step %d: checkpoint %s", change, step + 1, directory)

    # ------------------------------------------------------------------ the loop
    def step(self, step: int) -> StepStats:
        """One training step, then its load report (and migration) when one is due; the step's
        logged time and tokens/s span both, since the next step waits for them."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.phases.enter("step", step)
        self.faults.at("step", step)
        topo, slots = self.topo, self.pipeline_stage.slots
        per_replica = cfg.train.num_microbatches // topo.num_replicas
        schedule = ab_schedule(
            step, cfg.balance.ab_period_steps, cfg.pipeline.schedule, cfg.balance.ab_schedule
        )
        actions = build_schedule(schedule, topo.stage, topo.num_stages, per_replica)
        reducer = GradReducer(self.groups.data, slots, int(cfg.pipeline.grad_bucket_mb * 2**20))
        stats = self.pipeline_stage.run_schedule(step, actions, reducer.layer_final)
        self.reporter.accumulator.add(stats.forward_s, stats.backward_s)
        sync = reducer.finish()
        sum_tied_grads(cfg.model, self.groups, slots)

        sq_norms = np.zeros(cfg.model.num_layers, dtype=np.float64)
        for slot in slots:
            excluded = norm_exclusions(cfg.model, slot.index)
            sq_norms[slot.index] = squared_grad_norm(slot.module, excluded)
        self.groups.pipeline.Allreduce(MPI.IN_PLACE, sq_norms, op=MPI.SUM)
        coefficient = clip_coefficient(sq_norms.tolist(), cfg.train.grad_clip)
        lr = lr_at(step, cfg.train)
        self.pipeline_stage.optimizer_step(lr, coefficient)
        self.faults.after_optimizer(step, slots)
        replicas = self.groups.data.allgather if topo.num_replicas > 1 else None
        scheme_events = self.schemes.step_end(step, slots, self.groups.pipeline.allgather, replicas)
        self.pipeline_stage.no_grad_below = self.schemes.no_grad_below

        cpu_s = sum(stats.forward_s.values()) + sum(stats.backward_s.values())
        mine = (stats.lm_loss_sum, stats.aux_loss_sum, stats.compute_s, stats.idle_s, cpu_s)
        gathered = self.comm.gather((*mine, *sync.row()), root=0)
        self.reporter.pipeline_step_s.append(time.perf_counter() - t0)
        if self.rank == 0:
            self.reporter.allreduce_s.append(max(g[5] for g in gathered))
        reported = is_report_step(step, cfg.balance.interval, cfg.train.steps)
        if reported:  # replicas must agree: checked before a migration moves their layers
            check_replicas_agree(self.groups.data, slots, topo.stage, full=False)
            self.reporter.report(step)
        step_time_s = time.perf_counter() - t0
        if self.log0 is not None:
            self.log0.log_step(step, lr, step_time_s, gathered, scheme_events, reported)
        return stats

    def _evaluate(self, step: int) -> None:
        """A validation pass (:mod:`dynmo_hpc.pipeline.evaluate`); rank 0 logs its mean loss."""
        mine = evaluate(self.pipeline_stage, self.topo.replica, self.topo.num_replicas)
        total = self.comm.reduce(mine, op=MPI.SUM, root=0)
        if self.log0 is not None:
            num_microbatches = self.cfg.train.eval_windows // self.cfg.train.micro_batch_size
            self.log0.log_eval(step, total / num_microbatches)

    def train(self) -> TrainResult:
        """Run the remaining steps; rank 0's result (other ranks return an empty one).

        Ends after ``train.steps``, after a stop signal (with a checkpoint), or after a pack's
        checkpoint (the next MPI step carries on: no result, no final checkpoint)."""
        if self.log0 is not None:
            self.log0.log_start(self.parts)
        stop = StopRequest()
        try:
            last_step, saved_step, resized = self._run_steps(stop)
            if resized:
                stop.restore()
                self.phases.close()
                if self.log0 is not None:
                    self.log0.close(status="resize")
                return self.result
            self._finish(last_step, saved_step)
        except BaseException as exc:
            stop.restore()
            if self.log0 is not None:
                self.log0.log_error(exc)
            raise
        stop.restore()
        self.phases.close()
        if self.log0 is not None:
            self.log0.close()
        return self.result

    def _run_steps(self, stop: StopRequest) -> tuple[int, int, bool]:
        """The step loop with its periodic checkpoints; returns the steps completed, the step
        of the last checkpoint written (-1: none) and whether it ended for a pack."""
        cfg = self.cfg
        last_step, saved_step = cfg.train.steps, -1
        for step in range(self.start_step, cfg.train.steps):
            self.step(step)
            if is_eval_step(step, cfg.train.eval_interval, cfg.train.steps):
                self._evaluate(step)
            # One collective per step: any rank's stop signal, rank 0's checkpoint clock.
            flags = np.array([stop.signum, self._minutes_due()], dtype=np.int64)
            self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
            if flags[0]:
                self._preempted(step, int(flags[0]))
                return step + 1, saved_step, False
            if self.reporter.pack_target is not None:
                self._resize(step)
                return last_step, saved_step, True
            every = cfg.checkpoint.every_steps
            if step + 1 < cfg.train.steps and ((every and (step + 1) % every == 0) or flags[1]):
                self.save_checkpoint(step + 1)
                saved_step = step + 1
        return last_step, saved_step, False

    def _finish(self, last_step: int, saved_step: int) -> None:
        """The final checkpoint (unless just written) and rank 0's ``result.json``."""
        cfg = self.cfg
        if (cfg.checkpoint.at_end or last_step < cfg.train.steps) and saved_step != last_step:
            self.save_checkpoint(last_step)
        self.result.parts = list(self.parts)
        self.result.completed_steps = last_step
        self.result.num_steps = cfg.train.steps
        if self.rank == 0:
            atomic_write_text(
                self.run_dir / "result.json", json.dumps(self.result.to_json(), indent=1)
            )

    def _minutes_due(self) -> int:
        """1 if rank 0's clock says a time-based checkpoint is due (other ranks say 0)."""
        minutes = self.cfg.checkpoint.every_minutes
        if self.rank != 0 or not minutes:
            return 0
        return int(time.monotonic() - self.last_checkpoint_monotonic >= 60.0 * minutes)

    def _preempted(self, step: int, signum: int) -> None:
        """SIGUSR2/SIGTERM (SLURM's warning before the time limit or a preemption) arrived."""
        if self.log0 is not None:
            self.log0.log_preempt(step, signum)

    def run_state(self, step: int) -> dict[str, Any]:
        """Rank 0: the run's state after ``step`` completed steps (see :mod:`.run_state`)."""
        return build_run_state(
            self.cfg,
            step,
            report=self.reporter.state,
            schemes=self.schemes.run_state(),
            pack=self.packer.run_state(),
            result=self.result,
        )

    def save_checkpoint(self, step: int) -> Path:
        """Write checkpoint ``step`` (collective) and log it on rank 0."""
        state = self.run_state(step) if self.rank == 0 else None
        self.phases.enter("checkpoint", step - 1)
        check_replicas_agree(self.groups.data, self.pipeline_stage.slots, self.topo.stage)
        directory, seconds, num_bytes = resume.save(
            self.comm,
            self.run_dir,
            step,
            self.pipeline_stage,
            self.cfg.checkpoint.keep,
            state,
            after_files=self.faults.hook("checkpoint", step - 1),
            parent=self.lineage_parent,
            writes_layers=self.topo.writes_layers,
        )
        self.last_checkpoint_monotonic = time.monotonic()
        self.lineage_parent = self._lineage_key(directory)
        if self.log0 is not None:
            self.packer.last_checkpoint_s = seconds
            self.log0.log_checkpoint(step, directory, seconds, num_bytes)
        return directory
