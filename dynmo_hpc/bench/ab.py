"""The A/B comparison of one run: its static-split steps against its balancer's steps.

An A/B run (``balance.ab_period_steps``, :mod:`dynmo_hpc.pipeline.ab`) alternates the partition
every ``k`` steps, so both arms ran over the same minutes of the machine. This module picks the
steps that compare like with like and reduces them to a gain:

- **migration steps out**: a step whose load report migrated layers (the switch between arms,
  or the balancer moving within its arm) and the step after it (fresh arenas, cold caches) time
  the move, not the partition;
- **noisy steps out**: a step whose wall/CPU ratio (``steps.wall_s_per_cpu_s``: the layers'
  wall seconds over their thread CPU seconds, worst rank) exceeds :data:`NOISE_FACTOR` times the
  run's median ratio ran while something else held its core. The rule is relative, so a machine
  that is uniformly busy keeps its steps, and only the bursts are set aside;
- **gain** = median kept static step time / median kept balancer step time (tokens per step are
  equal, so it is the tokens/s ratio), over a phase of the run (the ramp, or the steady state);
- **spread**: the same ratio per pair of blocks (static block ``2j``, balancer block ``2j + 1``),
  its 25th and 75th percentiles over the pairs.

Pure: tables in, figures out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynmo_hpc.bench.ceiling import Ceiling, combined_ceiling, report_ceiling

NOISE_FACTOR = 1.2
"""A step is noisy when its wall/CPU ratio is above this many times the run's median ratio."""
STATIC_ARM, DYNMO_ARM = 0, 1


def mark_steps(
    steps: pd.DataFrame, migration_steps: Iterable[int], noise_factor: float = NOISE_FACTOR
) -> pd.DataFrame:
    """``steps`` (the run log's, with ``ab_arm`` and ``wall_s_per_cpu_s``) sorted by step, with
    boolean columns ``migration`` (a migrating step or the one after), ``noisy`` (see the module
    docstring; a step without a ratio is never noisy) and ``kept`` (neither)."""
    if noise_factor < 1.0:
        raise ValueError(f"noise_factor={noise_factor} must be >= 1")
    out = steps.sort_values("step").reset_index(drop=True).copy()
    moved = {int(s) for s in migration_steps}
    out["migration"] = [int(s) in moved or int(s) - 1 in moved for s in out["step"]]
    ratios = out["wall_s_per_cpu_s"].to_numpy(dtype=np.float64)
    finite = ratios[np.isfinite(ratios)]
    limit = noise_factor * float(np.median(finite)) if finite.size else np.inf
    out["noisy"] = np.isfinite(ratios) & (ratios > limit)
    out["kept"] = ~out["migration"] & ~out["noisy"]
    return out


@dataclass(frozen=True, kw_only=True)
class ArmComparison:
    """One phase of one A/B run (or of several repeats pooled)."""

    static_step_s: float
    """Median kept step time in the static arm."""
    dynmo_step_s: float
    """Median kept step time in the balancer's arm."""
    block_gains: list[float]
    """Per pair of blocks with kept steps in both: static median over balancer median."""
    kept: tuple[int, int]
    """Steps kept (static arm, balancer arm)."""
    total: tuple[int, int]
    """Steps in the phase (static arm, balancer arm)."""

    @property
    def gain(self) -> float:
        """Balancer over static split in tokens/s (> 1: the balancer is faster)."""
        return self.static_step_s / self.dynmo_step_s

    @property
    def spread(self) -> tuple[float, float]:
        """25th and 75th percentiles of the block-pair gains (the gain itself for one pair)."""
        if not self.block_gains:
            return (self.gain, self.gain)
        low, high = np.percentile(self.block_gains, [25, 75])
        return (float(low), float(high))


def compare_arms(
    marked: list[pd.DataFrame], period_steps: int, first_step: int, end_step: int
) -> ArmComparison | None:
    """The comparison over steps ``first_step .. end_step - 1`` of one or more marked runs
    (:func:`mark_steps`; repeats pooled); None when an arm has no kept step there."""
    if period_steps < 1:
        raise ValueError(f"period_steps={period_steps} must be >= 1")
    kept: dict[int, list[float]] = {STATIC_ARM: [], DYNMO_ARM: []}
    total = {STATIC_ARM: 0, DYNMO_ARM: 0}
    gains: list[float] = []
    for table in marked:
        phase = table[(table["step"] >= first_step) & (table["step"] < end_step)]
        for arm in (STATIC_ARM, DYNMO_ARM):
            rows = phase[phase["ab_arm"] == arm]
            total[arm] += len(rows)
            kept[arm] += rows.loc[rows["kept"], "step_time_s"].astype(float).tolist()
        gains += _block_gains(phase[phase["kept"]], period_steps)
    if not kept[STATIC_ARM] or not kept[DYNMO_ARM]:
        return None
    return ArmComparison(
        static_step_s=float(np.median(kept[STATIC_ARM])),
        dynmo_step_s=float(np.median(kept[DYNMO_ARM])),
        block_gains=gains,
        kept=(len(kept[STATIC_ARM]), len(kept[DYNMO_ARM])),
        total=(total[STATIC_ARM], total[DYNMO_ARM]),
    )


def _block_gains(kept: pd.DataFrame, period_steps: int) -> list[float]:
    """Per pair of blocks (``step // (2 * period)``) with kept steps in both arms."""
    gains = []
    for _, pair in kept.groupby(kept["step"] // (2 * period_steps)):
        a = pair.loc[pair["ab_arm"] == STATIC_ARM, "step_time_s"]
        b = pair.loc[pair["ab_arm"] == DYNMO_ARM, "step_time_s"]
        if len(a) and len(b):
            gains.append(float(np.median(a)) / float(np.median(b)))
    return gains


def run_ceilings(
    layer_costs: pd.DataFrame,
    static_parts: list[int],
    num_microbatches: int,
    schedule: str,
) -> dict[int, Ceiling]:
    """Per load report (by its step): the ceiling of its measured costs over ``static_parts``
    (:func:`dynmo_hpc.bench.ceiling.report_ceiling`)."""
    out: dict[int, Ceiling] = {}
    for step, group in layer_costs.groupby("step"):
        rows = group.sort_values("layer")
        out[int(step)] = report_ceiling(
            rows["forward_s"].astype(float).tolist(),
            rows["backward_s"].astype(float).tolist(),
            static_parts,
            num_microbatches,
            schedule,
        )
    return out


def phase_ceiling(ceilings: dict[int, Ceiling], first_step: int, end_step: int) -> float | None:
    """The ceiling over the reports at steps ``first_step .. end_step - 1`` (None: no report)."""
    chosen = [c for step, c in ceilings.items() if first_step <= step < end_step]
    return combined_ceiling(chosen) if chosen else None
