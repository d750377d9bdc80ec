"""The pipeline-aware ceiling: the most any contiguous partition could gain over a static split
on a run's own measured costs, and the share of it DynMo captured.

Why not the compute-only bound (heaviest stage over heaviest stage): with ``M`` microbatches on
``P`` stages a 1F1B step is not ``M`` times the slowest stage; the fill and drain run every
stage's first forwards and last backwards too, so a partition that moves work off the slowest
stage gains less than the ratio of bottlenecks says, and less the smaller ``M`` is. The ceiling
prices each partition with the simulator's step model (:func:`dynmo_hpc.sim.step.simulate_step`:
every forward and backward of every microbatch, in the schedule's order), on the per-layer
forward and backward seconds of one load report:

    ceiling = step_s(static split) / min over contiguous partitions of step_s(partition)

**What a step costs besides its layers** (:class:`Overheads`, measured from the same run by
:func:`dynmo_hpc.bench.ab.report_overheads`; without them the model is layer compute only and
the ceiling is an upper bound no run reaches). A measured step is three things, and the model
prices each as the trainer spends it:

- the layers' forward and backward (the load report's per-layer seconds): they move with their
  layer when the partition changes;
- per stage, the rest of its forward and backward regions (``stages.compute_s`` less its
  layers' seconds: building the microbatch, detaching inputs and collecting input gradients
  between layers, wall over CPU time): it stays with the stage, spread evenly over the stage's
  ``2 M`` actions;
- the step's tail after the schedule (``step_time_s`` less the slowest stage's compute plus
  waits: gradient norms and the clipping all-reduce, the optimizer, the schemes' hooks, the loss
  gather, the load report): the same for every partition, added once per step;

and a waiting stage notices its input late by the trainer's poll back-off
(:func:`dynmo_hpc.sim.wakeup.noticed_s`, cap ``poll_max_s``, after yielding for
``poll_yield_s``). A time shared by every partition
dilutes the ceiling as it dilutes the measured gain, so the two stay comparable.

The minimum is over every partition when there are at most :data:`MAX_ENUMERATED` of them (all
2-stage splits, for instance), else over the min-max partition of the total costs
(:func:`dynmo_hpc.balance.optimal.optimal`) and the static split itself.

**Capture** = ``(gain - 1) / (ceiling - 1)``: the share of the possible gain a balancer got
(1.0: all of it; 0: none; negative: slower than the static split). Undefined (None) when the
ceiling is within :data:`MIN_ROOM` of 1: a balanced split leaves nothing to capture.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dynmo_hpc.balance.optimal import optimal
from dynmo_hpc.sim.step import simulate_step, stage_times_s

MAX_ENUMERATED = 4096
"""Most partitions the ceiling tries one by one; beyond it, the min-max partition stands in."""
MIN_ROOM = 0.01
"""A ceiling below ``1 + MIN_ROOM`` leaves no gain to capture: capture is undefined there."""


@dataclass(frozen=True, kw_only=True)
class Overheads:
    """A step's measured seconds besides its layers (see the module docstring), per step."""

    stage_s: list[float]
    """Per stage: seconds in its forward and backward regions beyond its layers' (>= 0)."""
    tail_s: float
    """Seconds of the step after the schedule (>= 0), the same on every partition."""
    poll_max_s: float = 0.0
    """The trainer's longest sleep while waiting for an input (0: inputs noticed at once)."""
    poll_yield_s: float = 0.0
    """How long a wait yields the core before it sleeps (``runtime.wait_mode``'s window where
    each stage has a core of its own, else 0)."""

    def __post_init__(self) -> None:
        values = [*self.stage_s, self.tail_s, self.poll_max_s, self.poll_yield_s]
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"overheads must be finite and >= 0, got {self}")


def partition_step_s(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    parts: Sequence[int],
    num_microbatches: int,
    schedule: str = "1f1b",
    overheads: Overheads | None = None,
) -> float:
    """Simulated seconds of one step on ``parts``: per-layer forward and backward seconds per
    step (a load report's), split into stages and microbatches, in ``schedule``'s order, plus
    ``overheads`` (None: layer compute only)."""
    fwd = stage_times_s(forward_s, parts, num_microbatches)
    bwd = stage_times_s(backward_s, parts, num_microbatches)
    if overheads is None:
        return simulate_step(fwd, bwd, num_microbatches, schedule).step_time_s
    if len(overheads.stage_s) != len(parts) - 1:
        raise ValueError(
            f"overheads.stage_s has {len(overheads.stage_s)} entries; pass one per stage "
            f"({len(parts) - 1})"
        )
    per_action = [o / (2 * num_microbatches) for o in overheads.stage_s]
    return simulate_step(
        [f + o for f, o in zip(fwd, per_action, strict=True)],
        [b + o for b, o in zip(bwd, per_action, strict=True)],
        num_microbatches,
        schedule,
        stage_overhead_s=[overheads.tail_s] * len(fwd),
        poll_max_s=overheads.poll_max_s,
        poll_yield_s=overheads.poll_yield_s,
    ).step_time_s


def _candidates(costs_s: Sequence[float], num_stages: int) -> list[list[int]]:
    num_layers = len(costs_s)
    if math.comb(num_layers - 1, num_stages - 1) <= MAX_ENUMERATED:
        return [
            [0, *cuts, num_layers]
            for cuts in itertools.combinations(range(1, num_layers), num_stages - 1)
        ]
    return [optimal(list(costs_s), num_stages)]


@dataclass(frozen=True, kw_only=True)
class Ceiling:
    """One load report's ceiling over a static split."""

    static_step_s: float
    """Simulated step on the static split."""
    best_step_s: float
    """Simulated step on the best partition found."""
    best_parts: list[int]

    @property
    def ratio(self) -> float:
        """``static_step_s / best_step_s`` (>= 1)."""
        return self.static_step_s / self.best_step_s if self.best_step_s > 0 else 1.0


def report_ceiling(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    static_parts: Sequence[int],
    num_microbatches: int,
    schedule: str = "1f1b",
    overheads: Overheads | None = None,
) -> Ceiling:
    """The ceiling of one load report's costs over ``static_parts`` (see the module docstring),
    every partition priced with the same ``overheads`` (None: layer compute only).

    Example: 2 stages, 1 microbatch, costs [1, 1, 4] (forward only): the static split
    ``[0, 2, 3]`` runs 2 + 4 = 6 s (one microbatch goes through both stages); no split does
    better, so the ceiling is 1.0. With 4 layers [1, 1, 1, 3] and ``[0, 2, 4]`` on 8
    microbatches, see the tests for the hand count.
    """
    if len(forward_s) != len(backward_s):
        raise ValueError("forward_s and backward_s need one entry per layer")
    num_stages = len(static_parts) - 1
    static_s = partition_step_s(
        forward_s, backward_s, static_parts, num_microbatches, schedule, overheads
    )
    costs = [f + b for f, b in zip(forward_s, backward_s, strict=True)]
    best_s, best_parts = static_s, list(static_parts)
    for parts in _candidates(costs, num_stages):
        step_s = partition_step_s(
            forward_s, backward_s, parts, num_microbatches, schedule, overheads
        )
        if step_s < best_s:
            best_s, best_parts = step_s, parts
    return Ceiling(static_step_s=static_s, best_step_s=best_s, best_parts=best_parts)


def combined_ceiling(ceilings: Sequence[Ceiling]) -> float:
    """The ceiling over several reports (each covering as many steps): total static step time
    over total best step time, so a slow report weighs by its seconds, as in a run."""
    if not ceilings:
        raise ValueError("no load reports to compute a ceiling from")
    best = sum(c.best_step_s for c in ceilings)
    return sum(c.static_step_s for c in ceilings) / best if best > 0 else 1.0


def capture(gain: float, ceiling: float) -> float | None:
    """``(gain - 1) / (ceiling - 1)``; None when the ceiling leaves no room (< 1 + MIN_ROOM)
    or either figure is not finite.

    Example: ``capture(1.2, 1.25) == 0.8`` (0.2 of a possible 0.25).
    """
    if not (math.isfinite(gain) and math.isfinite(ceiling)) or ceiling < 1.0 + MIN_ROOM:
        return None
    return (gain - 1.0) / (ceiling - 1.0)
