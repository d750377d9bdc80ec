"""The ``fault:`` section: how a job recovers from a crashed rank, and test-only fault injection.

The one place a fault is configured; :mod:`dynmo_hpc.testing.fault_injection` enacts it.

A failed MPI step (a rank killed by a signal, an aborted rank, a failed migration) is restarted
by the process outside the step (:mod:`dynmo_hpc.launch.supervisor`) from the newest complete
checkpoint, up to ``max_restarts`` times; see docs/reliability.md.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Literal

from dynmo_hpc.errors import ConfigError

FAULT_PHASES = ("step", "load_report", "migration", "checkpoint")
"""Where an injected fault can strike: mid-step, mid-load-report, mid-migration (after the
first chunk has gone), mid-checkpoint (after this rank's layer files, before the manifest)."""

INJECT_ACTIONS = ("signal", "hang", "corrupt", "raise", "kill_job", "diverge")
"""How an injected fault fails (see :attr:`FaultSection.inject_action`)."""

MAX_RESTARTS_LIMIT = 100
"""More restarts than this is a job that cannot work: refuse the setting."""


@dataclass(frozen=True, kw_only=True)
class FaultSection:
    """Restarts after a failed step, and fault injection for the fault-tolerance tests."""

    max_restarts: int = 2
    """Restarts from the newest complete checkpoint after a failed step (0: fail at once). A
    failure that repeats at the same step with the same cause is not retried again."""
    stop_grace_s: float = 60.0
    """After Ctrl-C, SIGTERM or SIGHUP to ``dynmo-hpc run``: seconds the ranks get to reach a
    step boundary and checkpoint before they are killed (a second signal kills at once)."""
    inject_step: int | None = None
    """Test only: at this step (0-based), or the first ``inject_phase`` after it, rank
    ``inject_rank`` fails as ``inject_action`` says. Only the first launch of a job does so."""
    inject_rank: int = 0
    """Test only: the rank that fails."""
    inject_phase: Literal["step", "load_report", "migration", "checkpoint"] = "step"
    """Test only: where in the step it fails (see ``FAULT_PHASES``)."""
    inject_signal: str = "SIGKILL"
    """Test only: the signal it sends itself (a name such as SIGKILL or SIGSEGV)."""
    inject_action: Literal["signal", "hang", "corrupt", "raise", "kill_job", "diverge"] = "signal"
    """Test only: ``signal`` (send ``inject_signal``; SIGTERM is the stop-and-checkpoint path),
    ``hang`` (freeze, SIGSTOP: its peers' ``phase_timeout_s`` must end the step), ``corrupt``
    (``migration`` only: flip a byte of a received chunk, as damage in transit would), ``raise``
    (an exception: the rank aborts with its traceback), ``kill_job`` (SIGKILL to the launcher's
    whole process group, as a crashed node would end a local job, with no chance to save),
    ``diverge`` (``step`` only: nudge one weight of this rank's first layer after the optimizer
    step, as a replica gone its own way would; the replica agreement check must stop the job)."""
    phase_timeout_s: float = 1800.0
    """A rank that spends longer than this in one phase (a step, a load report, a migration, a
    checkpoint) ends itself with exit code 124, so a hung peer or network cannot hang the job;
    the step then fails and is restarted. Raise it for models whose checkpoint takes longer."""

    def validate(self) -> None:
        if not 0 <= self.max_restarts <= MAX_RESTARTS_LIMIT:
            raise ConfigError(
                f"fault.max_restarts={self.max_restarts} must be in 0..{MAX_RESTARTS_LIMIT}; "
                "HINT: 2 or 3 covers a crashed node; 0 fails at the first error"
            )
        if not (math.isfinite(self.stop_grace_s) and 0.0 <= self.stop_grace_s <= 86400.0):
            raise ConfigError(
                f"fault.stop_grace_s={self.stop_grace_s} must be a number of seconds in 0..86400"
            )
        if self.inject_step is not None and self.inject_step < 0:
            raise ConfigError(f"fault.inject_step={self.inject_step} must be >= 0 (or null)")
        if self.inject_rank < 0:
            raise ConfigError(f"fault.inject_rank={self.inject_rank} must be >= 0")
        if self.inject_phase not in FAULT_PHASES:
            raise ConfigError(
                f"fault.inject_phase={self.inject_phase!r} must be one of {', '.join(FAULT_PHASES)}"
            )
        if self.inject_action not in INJECT_ACTIONS:
            raise ConfigError(
                f"fault.inject_action={self.inject_action!r} must be one of "
                f"{', '.join(INJECT_ACTIONS)}"
            )
        if self.inject_action == "corrupt" and self.inject_phase != "migration":
            raise ConfigError(
                "fault.inject_action=corrupt damages a migration; HINT: set "
                "fault.inject_phase=migration"
            )
        if not (math.isfinite(self.phase_timeout_s) and self.phase_timeout_s >= 1.0):
            raise ConfigError(
                f"fault.phase_timeout_s={self.phase_timeout_s} must be a number of seconds >= 1"
            )
        if not isinstance(getattr(signal, self.inject_signal, None), signal.Signals):
            raise ConfigError(
                f"fault.inject_signal={self.inject_signal!r} is not a signal name; "
                "HINT: use e.g. SIGKILL, SIGSEGV or SIGTERM"
            )
