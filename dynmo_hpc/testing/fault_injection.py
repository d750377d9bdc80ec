"""Test-only fault injection: one rank fails on purpose at a named phase of a chosen step.

The fault-tolerance tests need real crashes at chosen moments (a rank killed mid-migration, a
frozen peer, a damaged chunk). The whole mechanism is this module: the trainer asks
:func:`make_injector` once and calls the injector at the named phases of
:data:`~dynmo_hpc.config.fault.FAULT_PHASES`. Unconfigured (``fault.inject_step`` null, another
rank, or a relaunch) it is :class:`NoFaults`, a null object whose calls do nothing and whose
hooks are ``None``, so the migration and the checkpoint writer run with no hook at all.

Invariant: a configured fault fires at most once, on rank ``fault.inject_rank`` of the job's
first MPI step (attempt 0), at the first call for ``fault.inject_phase`` at or after
``fault.inject_step``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from dynmo_hpc.config.fault import FaultSection

log = logging.getLogger(__name__)


class FaultInjector(Protocol):
    """What the trainer calls at its named phases."""

    def at(self, phase: str, step: int) -> None:
        """The point in ``phase`` of ``step`` where an injected fault strikes this rank."""

    def hook(self, phase: str, step: int) -> Callable[[], None] | None:
        """A callback for a strike point inside a callee (the checkpoint writer), or None."""

    def chunk_hook(self, step: int) -> Callable[[Any, int, np.ndarray], None] | None:
        """The migration's per-received-chunk callback (a corruption), or None."""

    def after_optimizer(self, step: int, slots: Sequence[Any]) -> None:
        """After the optimizer step of ``step``: where a ``diverge`` fault nudges a weight."""


class NoFaults:
    """The injector of every production run: nothing strikes, no hooks."""

    def at(self, phase: str, step: int) -> None:
        return None

    def hook(self, phase: str, step: int) -> Callable[[], None] | None:
        return None

    def chunk_hook(self, step: int) -> Callable[[Any, int, np.ndarray], None] | None:
        return None

    def after_optimizer(self, step: int, slots: Sequence[Any]) -> None:
        return None


class ArmedFault:
    """One configured fault on this rank; disarmed once it fired."""

    def __init__(self, fault: FaultSection, rank: int) -> None:
        assert fault.inject_step is not None
        self.fault = fault
        self.first_step = fault.inject_step
        self.rank = rank
        self.armed = True

    def _due(self, phase: str, step: int) -> bool:
        return self.armed and phase == self.fault.inject_phase and step >= self.first_step

    def at(self, phase: str, step: int) -> None:
        if self.fault.inject_action in ("corrupt", "diverge") or not self._due(phase, step):
            return  # a corruption needs a received chunk, a divergence the layers
        self.armed = False
        action = self.fault.inject_action
        if action == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {step}")
        _flush_logs()
        if action == "kill_job":
            log.warning("fault injection: rank %d kills its launcher's process group", self.rank)
            _flush_logs()
            os.killpg(os.getpgrp(), signal.SIGKILL)
        signum = signal.SIGSTOP if action == "hang" else getattr(signal, self.fault.inject_signal)
        log.warning(
            "fault injection: rank %d sends itself %s in %s of step %d",
            self.rank,
            signal.Signals(signum).name,
            phase,
            step,
        )
        _flush_logs()
        os.kill(os.getpid(), signum)

    def hook(self, phase: str, step: int) -> Callable[[], None] | None:
        return lambda: self.at(phase, step)

    def chunk_hook(self, step: int) -> Callable[[Any, int, np.ndarray], None] | None:
        if self.fault.inject_action != "corrupt":
            return None

        def corrupt(_item: Any, _index: int, chunk: np.ndarray) -> None:
            if self._due("migration", step) and chunk.size:
                self.armed = False
                chunk.view(np.uint8).reshape(-1)[0] ^= 0xFF
                log.warning("fault injection: rank %d damaged a received chunk", self.rank)

        return corrupt

    def after_optimizer(self, step: int, slots: Sequence[Any]) -> None:
        if self.fault.inject_action != "diverge" or not self._due("step", step) or not slots:
            return
        self.armed = False
        with torch.no_grad():
            first = next(iter(slots[0].module.parameters()))
            first.view(-1)[0] += 1e-3
        log.warning(
            "fault injection: rank %d nudged a weight of layer %d", self.rank, slots[0].index
        )


def make_injector(fault: FaultSection, rank: int, attempt: int) -> FaultInjector:
    """The injector for this rank and launch: :class:`ArmedFault` when ``fault.inject_*`` names
    this rank of a first launch (``attempt`` 0), else :class:`NoFaults`."""
    if fault.inject_step is None or fault.inject_rank != rank or attempt != 0:
        return NoFaults()
    return ArmedFault(fault, rank)


def _flush_logs() -> None:
    """Let the log lines out before the signal: a killed rank cannot flush them."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
