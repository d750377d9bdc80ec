"""Pipeline schedules as data: for each stage, the ordered list of actions it performs.

Why pure functions: a schedule is the part of pipeline parallelism that is easy to get subtly wrong
(a missing backward, a deadlock from mismatched order), and as data it can be checked exhaustively
in milliseconds, without a single rank. The runner in :mod:`dynmo_hpc.pipeline.stage` executes
the list; communication is implied by each action (a forward receives from the previous stage
and sends to the next; a backward the reverse).

Example:
    >>> [str(a) for a in one_f_one_b(stage=0, num_stages=2, num_microbatches=3)]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    """One compute action on one stage: forward or backward of a microbatch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _check(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages({num_stages}) and num_microbatches({num_microbatches}) must be >= 1"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """All forwards, then all backwards (in the same microbatch order).

    Simple, but every stage holds all M microbatches' activations at once.
    """
    _check(stage, num_stages, num_microbatches)
    fwd = [Action(stage, "F", m) for m in range(num_microbatches)]
    bwd = [Action(stage, "B", m) for m in range(num_microbatches)]
    return fwd + bwd


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B (PipeDream-flush): same bubble as GPipe, at most P - stage microbatches in flight.

    Three phases:
      * warmup: stage s runs ``min(P - s - 1, M)`` forwards to fill the pipe below it;
      * steady state: alternate one forward, one backward;
      * cooldown: the remaining backwards drain the pipe.
    Backwards run in microbatch order 0..M-1 on every stage, so gradients accumulate in the same
    order as in a single-process loop (bitwise-equal results).
    """
    _check(stage, num_stages, num_microbatches)
    return _warmup_then_pairs(
        stage, min(num_stages - stage - 1, num_microbatches), num_microbatches
    )


def one_f_one_b_slack(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B with one more warmup forward on every stage but the last (``1f1b-slack``).

    Why: in 1F1B's steady state two balanced neighbours run in lockstep, each action waiting
    for the other's last one, so every delay of one stage (a noisy core, a late wake-up) stalls
    the other too, and a balanced split loses more to noise than an unbalanced one, whose light
    stage waits anyway. One forward ahead gives each stage a queued input: a late neighbour is
    absorbed instead of passed on. The price is one more microbatch of activations on each
    stage but the last (stage ``s`` holds ``P - s + 1``). The bubble without noise is the same
    as 1F1B's or smaller. Backwards keep microbatch order, so results are bitwise those of
    1F1B.
    """
    _check(stage, num_stages, num_microbatches)
    extra = 1 if stage < num_stages - 1 else 0
    warmup = min(num_stages - stage - 1 + extra, num_microbatches)
    return _warmup_then_pairs(stage, warmup, num_microbatches)


def _warmup_then_pairs(stage: int, num_warmup: int, num_microbatches: int) -> list[Action]:
    """``num_warmup`` forwards, then (forward, backward) pairs, then the remaining backwards."""
    actions: list[Action] = []
    next_fwd, next_bwd = 0, 0

    # Warmup: forwards only.
    for _ in range(num_warmup):
        actions.append(Action(stage, "F", next_fwd))
        next_fwd += 1

    # Steady state: one forward, one backward.
    for _ in range(num_microbatches - num_warmup):
        actions.append(Action(stage, "F", next_fwd))
        next_fwd += 1
        actions.append(Action(stage, "B", next_bwd))
        next_bwd += 1

    # Cooldown: drain the backwards.
    while next_bwd < num_microbatches:
        actions.append(Action(stage, "B", next_bwd))
        next_bwd += 1
    return actions


SCHEDULES = {"1f1b": one_f_one_b, "1f1b-slack": one_f_one_b_slack, "gpipe": gpipe}


def build_schedule(name: str, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Look up a schedule by its config name (``pipeline.schedule``)."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    return fn(stage, num_stages, num_microbatches)


def theoretical_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a flush schedule with equal stages: (P - 1) / (M + P - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
