"""What frames a rank's training run: its result, stop signals, phase watchdog, node count.

Kept apart from the step loop (:mod:`dynmo_hpc.train.trainer`) so each piece reads alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from dynmo_hpc.config import JobConfig
from dynmo_hpc.handoff.failures import event_kind, take_pending_failures
from dynmo_hpc.handoff.rank_status import RankStatus
from dynmo_hpc.pipeline.comm import host_name

log = logging.getLogger(__name__)

PHASE_TIMEOUT_EXIT_CODE = 124
"""A rank's exit code when its phase watchdog fired (as ``timeout(1)`` uses)."""


@dataclass
class TrainResult:
    """What rank 0 knows at the end of a run (other ranks return an empty result)."""

    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)
    completed_steps: int = 0
    """Steps done when the run ended: ``train.steps``, or fewer after a stop signal."""
    num_steps: int = 0
    """``train.steps``: the steps the job asked for."""

    def to_json(self) -> dict[str, Any]:
        median_tps = float(np.median(self.tokens_per_s)) if self.tokens_per_s else 0.0
        return {
            "losses": self.losses,
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "median_tokens_per_s": median_tps,
            "final_loss": self.losses[-1] if self.losses else None,
            "parts": self.parts,
            "completed_steps": self.completed_steps,
            "num_steps": self.num_steps,
        }


class StopRequest:
    """Records SIGUSR2/SIGTERM so the step loop can stop at a step boundary, checkpointing.

    A handler only sets a flag: the ranks agree at the next step boundary (an ``allreduce``), so
    they all stop after the same step and the checkpoint is consistent.
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def count_nodes(comm: MPI.Comm) -> int:
    """Distinct nodes in the job (SLURM node names when present: all "nodes" may share a host)."""
    return len(set(comm.allgather(host_name())))


class PhaseTracker:
    """The phases a rank passes through: recorded, and watched for hangs.

    :meth:`enter` records the phase in the rank's status file
    (:mod:`dynmo_hpc.handoff.rank_status`), so after a crash the supervisor can say where each
    rank was, and restarts the phase clock of a watchdog thread: a rank that stays longer than
    ``fault.phase_timeout_s`` in one phase after start-up (a peer died silently, or froze)
    exits with code 124, so the launcher ends the step and the supervisor restarts it.
    """

    def __init__(self, rank: int, run_dir: Path, phase_timeout_s: float, attempt: int) -> None:
        self.status = RankStatus(run_dir, rank, attempt)
        self.rank = rank
        self.phase_timeout_s = phase_timeout_s
        self._phase, self._step, self._since = "start", -1, time.monotonic()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="phase-watchdog", daemon=True)
        self._watchdog.start()

    def enter(self, phase: str, step: int) -> None:
        """This rank starts ``phase`` of ``step``."""
        self._phase, self._step, self._since = phase, step, time.monotonic()
        self.status.update(phase, step)

    def _watch(self) -> None:
        timeout_s = self.phase_timeout_s
        while not self._stop.wait(min(1.0, timeout_s / 4)):
            stuck_s = time.monotonic() - self._since
            # Start-up (imports, a restore) has no peer to wait for: only later phases count.
            if stuck_s > timeout_s and self._phase != "start":
                log.error(
                    "rank %d: %s of step %d has not finished after %.0f s "
                    "(fault.phase_timeout_s=%g): a peer is gone or frozen; ending this rank "
                    "so the job can restart",
                    self.rank,
                    self._phase,
                    self._step + 1,
                    stuck_s,
                    timeout_s,
                )
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(PHASE_TIMEOUT_EXIT_CODE)

    def close(self) -> None:
        self._stop.set()
        self.status.update("done", -1)
        self.status.close()


def log_failures(writer: Any, run_dir: Path) -> None:
    """Rank 0 of a restarted step: put the failures that led here into the run log (and the
    other events the launcher queued between steps, such as a refused shrink)."""
    for record in take_pending_failures(run_dir):
        kind, detail = event_kind(record)
        step = detail.get("step")
        writer.log_event(step=int(step) if step is not None else -1, kind=kind, detail=detail)


def log_progress(cfg: JobConfig, result: TrainResult, step: int, loss: float, aux: float) -> None:
    """Rank 0: one progress line every ``train.log_interval`` steps (and the first and last)."""
    steps, every = cfg.train.steps, cfg.train.log_interval
    if (step + 1) % every and step + 1 != steps and step != 0:
        return
    recent = result.step_time_s[-every:]
    eta_s = float(np.median(recent)) * (steps - step - 1)
    log.info(
        "step %d/%d | loss %.4f%s | %.0f tok/s | step %.3f s | ETA %.0f s",
        step + 1,
        steps,
        loss,
        f" aux {aux:.4f}" if aux else "",
        float(np.median(result.tokens_per_s[-every:])),
        recent[-1],
        eta_s,
    )
