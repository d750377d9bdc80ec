"""Two microbatch schedules compared inside one A/B run, on both arms (``balance.ab_schedule``).

Why inside the run: whether ``1f1b-slack`` beats ``1f1b`` is a few percent, less than the
machine drifts between two runs, and the answer may differ between the static split (one stage
idles, slack absorbs nothing) and a balanced plan (both stages busy, slack absorbs jitter). So
the run alternates schedules as well as partitions: pairs of blocks (one block of each arm,
``2k`` steps) run ``pipeline.schedule`` and ``balance.ab_schedule`` in turn
(:func:`~dynmo_hpc.train.ab_arms.ab_schedule`), and each arm is compared with itself under the
two schedules over the same minutes.

The statistic, per arm: its kept steps (:func:`~dynmo_hpc.bench.ab.mark_steps`) grouped by pair
of blocks; per three pairs in a row (schedules X Y X), the middle pair's median step time
against the geometric mean of its neighbours', oriented as first schedule over second (> 1: the
second schedule is faster). Taking both orders cancels a drift that is geometric over the three
pairs, as :func:`~dynmo_hpc.bench.ab.both_order_gains` does for the arms. The figure is the
median of these ratios, with their 25th-75th percentiles.

Pure: tables in, figures out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynmo_hpc.bench.ab import DYNMO_ARM, STATIC_ARM


@dataclass(frozen=True, kw_only=True)
class ScheduleComparison:
    """One arm's step time under the second schedule against the first, over a phase."""

    arm: int
    """:data:`~dynmo_hpc.bench.ab.STATIC_ARM` or :data:`~dynmo_hpc.bench.ab.DYNMO_ARM`."""
    first_step_s: float
    """Median kept step time of the arm under the first schedule (``pipeline.schedule``)."""
    second_step_s: float
    """Median kept step time of the arm under the second (``balance.ab_schedule``)."""
    ratios: list[float]
    """Per three pairs of blocks in a row: first-schedule time over second-schedule time."""

    @property
    def speedup(self) -> float:
        """Second schedule over the first in tokens/s (> 1: the second is faster)."""
        return float(np.median(self.ratios))

    @property
    def spread(self) -> tuple[float, float]:
        """25th and 75th percentiles of :attr:`ratios`."""
        q25, q75 = np.percentile(self.ratios, [25, 75])
        return float(q25), float(q75)


def compare_schedules(
    marked: pd.DataFrame, period_steps: int, first_step: int, end_step: int
) -> dict[int, ScheduleComparison]:
    """Per arm with at least three pairs of blocks in a row of kept steps in ``[first_step,
    end_step)``: the comparison of the two schedules. ``marked``: one run's steps with ``step``,
    ``ab_arm``, ``step_time_s`` and ``kept`` (:func:`~dynmo_hpc.bench.ab.mark_steps`)."""
    if period_steps < 1:
        raise ValueError(f"period_steps={period_steps} must be >= 1")
    pair_steps = 2 * period_steps
    phase = marked[(marked["step"] >= first_step) & (marked["step"] < end_step) & marked["kept"]]
    out: dict[int, ScheduleComparison] = {}
    for arm in (STATIC_ARM, DYNMO_ARM):
        rows = phase[phase["ab_arm"] == arm]
        medians = {
            int(pair): float(np.median(group["step_time_s"]))
            for pair, group in rows.groupby(rows["step"] // pair_steps)
        }
        ratios = []
        for pair in sorted(medians):
            if pair + 1 not in medians or pair + 2 not in medians:
                continue
            outer_s = float(np.sqrt(medians[pair] * medians[pair + 2]))
            mid_s = medians[pair + 1]
            # Even pairs run the first schedule, odd pairs the second.
            ratios.append(outer_s / mid_s if pair % 2 == 0 else mid_s / outer_s)
        if not ratios:
            continue
        second = (rows["step"] // pair_steps) % 2 == 1
        out[arm] = ScheduleComparison(
            arm=arm,
            first_step_s=float(np.median(rows.loc[~second, "step_time_s"])),
            second_step_s=float(np.median(rows.loc[second, "step_time_s"])),
            ratios=ratios,
        )
    return out
