"""Does a step plus a checkpoint fit in the time between SLURM's warning and the kill?

SLURM sends SIGUSR2 ``slurm.signal_delay_s`` seconds before the time limit (or a preemption).
The ranks then finish the step they are in and write a checkpoint; only after that can the job
be requeued and continue. A job whose step plus checkpoint takes longer is killed first: it ends
TIMEOUT with no checkpoint from the warning, and the steps since its last one are lost.

Both sides check it with the same rule, which is why it sits here, beneath both: the submit
host (:mod:`dynmo_hpc.launch.preflight`, from the run log of the run being continued) and rank 0
(:mod:`dynmo_hpc.train.trainer`, once it has measured both in this run).

The measurement is the median step time (robust to the first, warm-up steps and to a migration
step) plus the slowest checkpoint seen: the checkpoint after the warning is the same size as
every other one, and a slow file system is the usual cause of a slow one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SignalBudget:
    """What the ranks need after SLURM's warning, against what they get."""

    step_time_s: float
    checkpoint_s: float
    signal_delay_s: float

    @property
    def needed_s(self) -> float:
        return self.step_time_s + self.checkpoint_s

    def fits(self) -> bool:
        return self.needed_s <= self.signal_delay_s

    def problem(self) -> str:
        """The warning for a budget that does not fit (one line, with a HINT)."""
        return (
            f"a step ({self.step_time_s:.1f} s) plus a checkpoint ({self.checkpoint_s:.1f} s) "
            f"take {self.needed_s:.1f} s, more than slurm.signal_delay_s="
            f"{self.signal_delay_s:g}: after SLURM's warning the job is killed before its "
            "checkpoint is written (TIMEOUT, no requeue). HINT: raise slurm.signal_delay_s to "
            f"at least {math.ceil(2 * self.needed_s)} (and slurm.time_min with it), or "
            "checkpoint.every_minutes to bound what a kill loses"
        )

    def to_event(self) -> dict[str, float | str]:
        return {
            "step_time_s": self.step_time_s,
            "checkpoint_s": self.checkpoint_s,
            "needed_s": self.needed_s,
            "signal_delay_s": self.signal_delay_s,
            "message": self.problem(),
        }


def measured_budget(
    step_times_s: Sequence[float], checkpoint_times_s: Sequence[float], signal_delay_s: float
) -> SignalBudget | None:
    """The budget from measured times (median step, slowest checkpoint); None until both exist.

    Example:
        >>> measured_budget([1.0, 9.0, 2.0], [30.0, 50.0], 60).fits()
        True
        >>> measured_budget([], [30.0], 60) is None
        True
    """
    steps = [t for t in step_times_s if math.isfinite(t) and t >= 0]
    checkpoints = [t for t in checkpoint_times_s if math.isfinite(t) and t >= 0]
    if not steps or not checkpoints:
        return None
    return SignalBudget(statistics.median(steps), max(checkpoints), float(signal_delay_s))
