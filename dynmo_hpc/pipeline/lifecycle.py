"""What frames a rank's training run: its result, stop signals, fault injection, node count.

Kept apart from the step loop (:mod:`dynmo_hpc.pipeline.trainer`) so each piece reads alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI


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
