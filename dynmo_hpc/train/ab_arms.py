"""A/B within one run: the partition alternates between the static split and DynMo's plan.

Why: on a shared machine the speed drifts by tens of percent over minutes, so two whole runs
back to back compare two different machines. Alternating the partition every
``balance.ab_period_steps`` steps inside one run compares the static split (arm A) and the
balancer's plan (arm B) over the same minutes. Migration does not change the math (each layer
computes the same thing on any rank, with its optimizer state), so the run trains exactly the
model a static run trains; only the step times differ.

Invariants:

- step ``s`` belongs to arm ``(s // k + lead) % 2`` (:func:`ab_arm`): blocks of ``k`` steps
  alternate, starting with the leading arm (``balance.ab_lead``, A unless set). The bench
  alternates the lead from one repeat to the next, so neither arm always runs first (the first
  blocks of a run pay its warm-up, and the bench sets a block of each arm aside for that);
- the balancer plans from the partition *it* chose (:attr:`ABSwitch.dynmo_parts`), with the
  costs measured in both arms, as if it ran alone; its plan is enacted only in B blocks;
- the switch happens at the load report of a block's last step (``k`` is a multiple of
  ``balance.interval``), so that step's time holds the migration.

Pure: no MPI; :class:`dynmo_hpc.train.load_report.LoadReporter` calls it on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_ARM = -1
"""Logged arm of a step that is not part of an A/B run."""
STATIC_ARM = 0
"""Arm A: the job's initial (static) partition."""
DYNMO_ARM = 1
"""Arm B: the balancer's latest plan."""
ARM_NAMES = {STATIC_ARM: "static", DYNMO_ARM: "dynmo"}


def lead_arm(name: str) -> int:
    """The arm a ``balance.ab_lead`` value names (``"static"`` or ``"dynmo"``)."""
    for arm, arm_name in ARM_NAMES.items():
        if arm_name == name:
            return arm
    raise ValueError(f"unknown A/B arm {name!r}; choose one of {sorted(ARM_NAMES.values())}")


def ab_arm(step: int, period_steps: int, lead: int = STATIC_ARM) -> int:
    """The arm of ``step`` (0-based) when blocks start with arm ``lead``: :data:`NO_ARM` when
    ``period_steps`` is 0.

    Examples: ``[ab_arm(s, 2) for s in range(6)] == [0, 0, 1, 1, 0, 0]``;
    ``[ab_arm(s, 2, DYNMO_ARM) for s in range(6)] == [1, 1, 0, 0, 1, 1]``.
    """
    if period_steps < 0 or step < 0:
        raise ValueError(f"period_steps={period_steps} and step={step} must be >= 0")
    if lead not in ARM_NAMES:
        raise ValueError(f"lead={lead} must be {STATIC_ARM} or {DYNMO_ARM}")
    if period_steps == 0:
        return NO_ARM
    return (step // period_steps + lead) % 2


def ab_schedule(step: int, period_steps: int, schedule: str, second: str | None) -> str:
    """The microbatch schedule step ``step`` runs: ``schedule`` (``pipeline.schedule``) in even
    pairs of blocks, ``second`` (``balance.ab_schedule``) in odd ones; always ``schedule`` when
    ``second`` is None or the run is not an A/B run.

    A pair is ``2 * period_steps`` steps: one block of each arm, so both arms run both schedules
    and each adjacent pair of blocks (one per arm) shares its schedule, which keeps the A/B gain
    a comparison under one schedule. Example, period 2: steps 0-3 ``schedule``, 4-7 ``second``.
    """
    if second is None or period_steps == 0:
        return schedule
    return second if (step // (2 * period_steps)) % 2 else schedule


@dataclass
class ABSwitch:
    """Rank 0's A/B state: the static split, the balancer's own partition, the period."""

    period_steps: int
    static_parts: list[int]
    """Arm A's partition (the job's initial one)."""
    dynmo_parts: list[int]
    """The partition the balancer last chose (it starts where the run starts)."""
    lead: int = STATIC_ARM
    """The arm of the first block (:func:`ab_arm`)."""

    def after_decision(
        self, step: int, enacted: list[int] | None, in_force: list[int]
    ) -> list[int] | None:
        """Record the balancer's decision at the report after ``step`` (``enacted``: its new
        partition, or None to keep its own); return the partition to migrate to before step
        ``step + 1`` (that step's arm's partition), or None when it is already in force."""
        if enacted is not None:
            self.dynmo_parts = list(enacted)
        arm = ab_arm(step + 1, self.period_steps, self.lead)
        target = self.static_parts if arm == STATIC_ARM else self.dynmo_parts
        return None if list(target) == list(in_force) else list(target)


def wall_s_per_cpu_s(compute_s: list[float], layer_cpu_s: list[float]) -> float:
    """The step's wall/CPU ratio: per rank, wall seconds in its layers (``compute_s``) over
    the thread CPU seconds its layer timers measured (``layer_cpu_s``); the largest over the
    ranks, since one rank slowed by other work holds up the whole pipeline. NaN when no rank
    measured CPU time (a GPU run's timers measure kernel time instead: the ratio is still
    wall over measured, but no longer about CPU sharing).

    About 1.0 on a core of its own; 2.0 when the rank got half a core (another process ran).

    Example: ``wall_s_per_cpu_s([1.0, 3.0], [1.0, 2.0]) == 1.5``.
    """
    if len(compute_s) != len(layer_cpu_s):
        raise ValueError("compute_s and layer_cpu_s need one entry per rank")
    ratios = [w / c for w, c in zip(compute_s, layer_cpu_s, strict=True) if c > 0]
    return max(ratios) if ratios else float("nan")
