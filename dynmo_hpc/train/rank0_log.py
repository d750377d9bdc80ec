"""Rank 0's run log for one launch of the trainer: what it writes, and its log lines.

Why apart from the step loop (:mod:`dynmo_hpc.train.trainer`): only rank 0 writes the run
log, and what it writes (how the launch started, each step's row, checkpoints, a preemption,
the error that ends a run) decides nothing any rank acts on. The trainer says *when*; this
module says *what*. Other ranks hold no :class:`Rank0Log`.

Invariant: the :class:`~dynmo_hpc.train.lifecycle.TrainResult` given to :class:`Rank0Log`
is the trainer's own (the same object), so each step's row and the result agree.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

from dynmo_hpc.checkpoint import resume_events
from dynmo_hpc.config import JobConfig
from dynmo_hpc.handoff import env
from dynmo_hpc.handoff.resize import take_phases
from dynmo_hpc.handoff.signal_budget import measured_budget
from dynmo_hpc.pipeline.grad_sync import log_overlap
from dynmo_hpc.runlog.trajectory import SCHEME_STATS, job_layer_states
from dynmo_hpc.train.ab_arms import ab_arm, lead_arm, wall_s_per_cpu_s
from dynmo_hpc.train.lifecycle import TrainResult, log_failures, log_progress
from dynmo_hpc.train.pack_inputs import PackController, resize_event

log = logging.getLogger(__name__)


class Rank0Log:
    """Rank 0's run log (``run.h5``) and progress lines for one launch.

    ``writer`` is the open :class:`~dynmo_hpc.runlog.writer.RunLogWriter` after :meth:`start`,
    None before it and after :meth:`log_error` closed it.
    """

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        result: TrainResult,
        *,
        num_ranks: int,
        num_replicas: int,
        num_nodes: int,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.result = result
        self.num_ranks = num_ranks
        self.num_replicas = num_replicas
        self.num_nodes = num_nodes
        self.writer: Any = None
        self.signal_budget_checked = False

    def start(
        self,
        restart: dict[str, Any] | None,
        *,
        resume_from: Path | None,
        state: dict[str, Any] | None,
        start_step: int,
        restore_s: float,
        device: torch.device,
        packer: PackController,
    ) -> None:
        """Open the run log (appending after a resume or a restart: ``restart`` is the detail
        of either, None for a fresh run) and log how this launch started: the failures before
        it, skipped checkpoints, changed settings, a resize."""
        self.writer = self._open(restart, start_step, device)
        log_failures(self.writer, self.run_dir)
        if resume_from is not None and state is not None:
            resume_events.log_skipped_checkpoints(self.writer, resume_from, start_step)
            resume_events.log_config_changes(self.writer, self.cfg, state, start_step)
        launched_unix_s = env.launch_unix_s()
        if math.isfinite(launched_unix_s):
            packer.startup_s = time.time() - launched_unix_s
            # The simulator estimates a resize's pause from it, as the packing decision does.
            self.writer.log_event(
                step=start_step - 1, kind="launch", detail={"startup_s": packer.startup_s}
            )
        if resume_from is not None:
            self._log_resize(restore_s, start_step, packer)

    def _open(self, restart: dict[str, Any] | None, start_step: int, device: torch.device) -> Any:
        from dynmo_hpc.runlog.writer import RunLogWriter

        meta: dict[str, str | int | float] = {
            "launcher": "mpi",
            "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0][:200],
            "world_size": self.num_ranks,
            "num_replicas": self.num_replicas,
            "mpi_host": MPI.Get_processor_name(),
            "device": str(device),
            "torch_version": str(torch.__version__),
        }
        # A resumed run appends to its log; a new run never replaces one (the launcher refuses
        # an occupied run directory unless asked to overwrite, and then removes the old log).
        return RunLogWriter(
            self.run_dir / "run.h5",
            config_yaml=self.cfg.to_yaml(),
            meta=meta,
            resume=restart is not None,
            redo_from_step=start_step if restart is not None else None,
            restart_detail=restart,
        )

    def _log_resize(self, restore_s: float, start_step: int, packer: PackController) -> None:
        """A relaunched step: log the resize that started it, phase by phase."""
        phases = take_phases(self.run_dir)
        if phases is None:
            return
        detail = resize_event(phases, restore_s, time.time(), self.num_nodes)
        packer.last_resize_s = detail["total_s"]
        packer.predicted_tokens_per_s = detail["predicted_tokens_per_s_after"]
        self.writer.log_event(step=start_step - 1, kind="resize", detail=detail)
        log.warning("resized: %s", {k: v for k, v in detail.items() if k.endswith("_s")})

    def log_start(self, parts: list[int]) -> None:
        """The line that says what this launch trains, on which partition."""
        cfg = self.cfg
        log.info(
            "training %s: %d layers on %s%d stages %s, %d steps x %d microbatches of %d x %d",
            cfg.job.name,
            cfg.model.num_layers,
            f"{cfg.pipeline.replicas} replicas x " if cfg.pipeline.replicas > 1 else "",
            cfg.pipeline.num_stages,
            parts,
            cfg.train.steps,
            cfg.train.num_microbatches,
            cfg.train.micro_batch_size,
            cfg.model.seq_len,
        )

    def log_step(
        self,
        step: int,
        lr: float,
        step_time_s: float,
        gathered: list[tuple[float, ...]],
        scheme_events: list[dict[str, Any]],
        reported: bool,
    ) -> None:
        """The step's row (with its A/B arm and wall/CPU ratio), its stage times and scheme
        events in the run log; the progress line; a flush after a load report.
        ``gathered``: per rank, (LM loss, aux loss, compute wall s, idle s, layer CPU s,
        then :meth:`.SyncStats.row`); each replica's losses are its share of the global mean."""
        cfg = self.cfg
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
            num_ranks=self.num_ranks,
            num_nodes=self.num_nodes,
            ab_arm=ab_arm(step, cfg.balance.ab_period_steps, lead_arm(cfg.balance.ab_lead)),
            wall_s_per_cpu_s=wall_s_per_cpu_s([g[2] for g in gathered], [g[4] for g in gathered]),
        )
        self.writer.log_stage_times(
            step=step,
            compute_s=[g[2] for g in gathered],
            idle_s=[g[3] for g in gathered],
            num_replicas=self.num_replicas,
            allreduce_s=[g[5] for g in gathered],
        )
        if reported and self.num_replicas > 1:
            log_overlap(self.writer, step, gathered)
        for event in scheme_events:
            self.writer.log_event(step=step, kind=event["kind"], detail=event)
            if event["kind"] == SCHEME_STATS:
                self.writer.log_layer_states(step=step, states=job_layer_states(cfg, event))
        log_progress(cfg, self.result, step, loss, sum(g[1] for g in gathered))
        if reported:
            self.writer.flush()

    def log_eval(self, step: int, loss: float) -> None:
        """A validation pass after ``step``: its ``eval`` row and a progress line."""
        self.writer.log_eval(step=step, loss=loss)
        log.info(
            "step %d/%d | val loss %.4f (%d windows)",
            step + 1,
            self.cfg.train.steps,
            loss,
            self.cfg.train.eval_windows,
        )

    def log_checkpoint(self, step: int, directory: Path, seconds: float, num_bytes: int) -> None:
        """Checkpoint ``step`` (completed steps it holds) is written: its event, the signal
        budget check at this launch's first one, a flush and the log line."""
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
        self._check_signal_budget(step - 1, seconds)
        self.writer.flush()
        log.info(
            "checkpoint step %d: %.1f MB in %.2f s -> %s",
            step,
            num_bytes / 1e6,
            seconds,
            directory,
        )

    def _check_signal_budget(self, step: int, checkpoint_s: float) -> None:
        """At this launch's first checkpoint: warn (log and run log) when a step plus a
        checkpoint do not fit in ``slurm.signal_delay_s``
        (:mod:`dynmo_hpc.handoff.signal_budget`)."""
        if self.signal_budget_checked:
            return
        budget = measured_budget(
            self.result.step_time_s, [checkpoint_s], self.cfg.slurm.signal_delay_s
        )
        if budget is None:
            return
        self.signal_budget_checked = True
        if not budget.fits():
            log.warning("%s", budget.problem())
            self.writer.log_event(step=step, kind="signal_budget", detail=budget.to_event())

    def log_preempt(self, step: int, signum: int) -> None:
        """SIGUSR2/SIGTERM (SLURM's warning before the time limit or a preemption) arrived."""
        self.writer.log_event(
            step=step, kind="preempt", detail={"signal": signum, "completed_steps": step + 1}
        )
        log.warning(
            "signal %d: stopping after step %d of %d and writing a checkpoint",
            signum,
            step + 1,
            self.cfg.train.steps,
        )

    def log_error(self, exc: BaseException) -> None:
        """The error that ends the run, as the run log's last event; closes the log."""
        if self.writer is None:
            return
        self.writer.log_event(
            step=len(self.result.losses),
            kind="error",
            detail={"type": type(exc).__name__, "message": str(exc)[:2000]},
        )
        self.writer.close(status="error")
        self.writer = None

    def close(self, status: str = "ok") -> None:
        """The run log's end event with ``status`` (if still open)."""
        if self.writer is not None:
            self.writer.close(status=status)
