"""What frames a rank's training run: its result, stop signals, fault injection, node count.

Kept apart from the step loop (:mod:`dynmo_hpc.pipeline.trainer`) so each piece reads alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from dynmo_hpc.config import JobConfig
from dynmo_hpc.handoff import env
from dynmo_hpc.handoff.failures import take_pending_failures
from dynmo_hpc.handoff.rank_status import RankStatus

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
    name = os.environ.get("SLURMD_NODENAME") or MPI.Get_processor_name()
    return len(set(comm.allgather(name)))


def inject_failure(mode: str, rank: int, step: int) -> None:
    """Fault injection for tests (``runtime.fail_at_step``): fail the way ``mode`` says.

    ``raise``: an exception (the job aborts with its traceback); ``sigterm``: SIGTERM to this
    rank (the stop-and-checkpoint path); ``sigkill_job``: SIGKILL to the launcher's whole process
    group, as a crashed node or an OOM kill would end the job, with no chance to save.
    """
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if mode == "sigkill_job":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    raise RuntimeError(f"injected failure on rank {rank} at step {step}")


class FaultPoints:
    """The phases a rank passes through: recorded, watched for hangs, and fault injection.

    :meth:`enter` records the phase in the rank's status file
    (:mod:`dynmo_hpc.handoff.rank_status`), so after a crash the supervisor can say where each
    rank was, and restarts the phase clock of a watchdog thread: a rank that stays longer than
    ``fault.phase_timeout_s`` in one phase after start-up (a peer died silently, or froze)
    exits with code 124,
    so the launcher ends the step and the supervisor restarts it. With ``fault.inject_step``
    set, rank ``fault.inject_rank`` of a job's first MPI step fails as
    ``fault.inject_action`` says at the first :meth:`strike` of ``fault.inject_phase`` at or
    after that step: a real crash at a chosen moment, for the tests.
    """

    def __init__(self, cfg: JobConfig, rank: int, run_dir: Path) -> None:
        attempt = env.attempt()
        self.status = RankStatus(run_dir, rank, attempt)
        fault = cfg.fault
        self.fault = fault
        self.armed = fault.inject_step is not None and fault.inject_rank == rank and attempt == 0
        self.rank = rank
        self._phase, self._step, self._since = "start", -1, time.monotonic()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="phase-watchdog", daemon=True)
        self._watchdog.start()

    def enter(self, phase: str, step: int) -> None:
        """This rank starts ``phase`` of ``step``; a ``step`` fault strikes here."""
        self._phase, self._step, self._since = phase, step, time.monotonic()
        self.status.update(phase, step)
        if phase == "step":
            self.strike(phase, step)

    def strike(self, phase: str, step: int, chunk: np.ndarray | None = None) -> None:
        """The point inside ``phase`` where an injected fault strikes this rank."""
        f = self.fault
        if not self.armed or phase != f.inject_phase or f.inject_step is None:
            return
        if step < f.inject_step:
            return
        if (f.inject_action == "corrupt") != (chunk is not None):
            return  # a corruption needs a received chunk; a crash strikes before the exchange
        if chunk is not None:
            if chunk.size:
                self.armed = False
                chunk.view(np.uint8).reshape(-1)[0] ^= 0xFF
                log.warning("fault injection: rank %d damaged a received chunk", self.rank)
            return
        signum = signal.SIGSTOP if f.inject_action == "hang" else getattr(signal, f.inject_signal)
        log.warning(
            "fault injection: rank %d sends itself %s in %s of step %d",
            self.rank,
            signal.Signals(signum).name,
            phase,
            step,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self.armed = False
        os.kill(os.getpid(), signum)

    def _watch(self) -> None:
        timeout_s = self.fault.phase_timeout_s
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
    """Rank 0 of a restarted step: put the failures that led here into the run log."""
    for record in take_pending_failures(run_dir):
        step = record.get("step")
        writer.log_event(step=int(step) if step is not None else -1, kind="failure", detail=record)


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
