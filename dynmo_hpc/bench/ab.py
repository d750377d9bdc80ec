"""The A/B comparison of one run: its static-split steps against its balancer's steps.

An A/B run (``balance.ab_period_steps``, :mod:`dynmo_hpc.train.ab_arms`) alternates the partition
every ``k`` steps, so both arms ran over the same minutes of the machine. This module picks the
steps that compare like with like and reduces them to a gain:

- **migration steps out**: a step whose load report migrated layers (the switch between arms,
  or the balancer moving within its arm) and the step after it (fresh arenas, cold caches) time
  the move, not the partition;
- **noisy steps out**: a step whose wall/CPU ratio (``steps.wall_s_per_cpu_s``: the layers'
  wall seconds over their thread CPU seconds, worst rank) exceeds :data:`NOISE_FACTOR` times the
  run's median ratio ran while something else held its core. The rule is relative, so a machine
  that is uniformly busy keeps its steps, and only the bursts are set aside;
- **gain**: one statistic with its own interval. Each *adjacent pair* of blocks (blocks
  ``j`` and ``j + 1`` of ``k`` steps, one in each arm, both with kept steps in the phase) gives
  one ratio, median kept static step time / median kept balancer step time (tokens per step are
  equal, so it is the tokens/s ratio). The gain is the median of these ratios over the phase's
  pairs (repeats pooled), the **spread** their 25th-75th percentiles, so the gain always lies in
  its spread. Every block is in up to two pairs, one with the block before it and one with the
  block after it, so A-then-B and B-then-A pairs are equally many (give or take one): a drift of
  the machine's speed, or of the model's cost (a scheme still ramping), raises half the ratios
  and lowers the other half instead of biasing them all one way;
- **both orders** (the ramp): while a scheme still ramps, the model's cost changes from block
  to block, and a median of single pairs leans with the change when the pairs of one order
  outnumber the other's. There the gain is taken from pairs taken in both orders only: per
  three blocks in a row (A B A or B A B), the middle block against the geometric mean of its
  neighbours, which is the geometric mean of the A-then-B and the B-then-A pair. A drift that
  is geometric over the three blocks cancels exactly (:func:`both_order_gains`);
- the tokens/s of each arm (the table's columns) is from the arm's median kept step time over
  the phase; their ratio need not equal the gain (it weighs blocks by their kept steps).

Pure: tables in, figures out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dynmo_hpc.bench.ceiling import Ceiling, Overheads, combined_ceiling, report_ceiling

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
    """Per adjacent pair of blocks with kept steps in both: static median over balancer median."""
    kept: tuple[int, int]
    """Steps kept (static arm, balancer arm)."""
    total: tuple[int, int]
    """Steps in the phase (static arm, balancer arm)."""

    @property
    def gain(self) -> float:
        """Balancer over static split in tokens/s (> 1: the balancer is faster): the median of
        :attr:`block_gains`."""
        return float(np.median(self.block_gains))

    @property
    def spread(self) -> tuple[float, float]:
        """25th and 75th percentiles of :attr:`block_gains` (the gain itself for one pair)."""
        low, high = np.percentile(self.block_gains, [25, 75])
        return (float(low), float(high))


def compare_arms(
    marked: list[pd.DataFrame],
    period_steps: int,
    first_step: int,
    end_step: int,
    *,
    both_orders: bool = False,
) -> ArmComparison | None:
    """The comparison over steps ``first_step .. end_step - 1`` of one or more marked runs
    (:func:`mark_steps`; repeats pooled); None when no adjacent pair of blocks has kept steps
    in both arms there. ``both_orders``: the gains are :func:`both_order_gains` instead of
    :func:`adjacent_block_gains` (None when no three blocks in a row qualify)."""
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
        pairs = both_order_gains if both_orders else adjacent_block_gains
        gains += pairs(phase[phase["kept"]], period_steps)
    if not gains:
        return None
    return ArmComparison(
        static_step_s=float(np.median(kept[STATIC_ARM])),
        dynmo_step_s=float(np.median(kept[DYNMO_ARM])),
        block_gains=gains,
        kept=(len(kept[STATIC_ARM]), len(kept[DYNMO_ARM])),
        total=(total[STATIC_ARM], total[DYNMO_ARM]),
    )


def _block_medians(kept: pd.DataFrame, period_steps: int) -> dict[int, tuple[int, float]]:
    """Per block (``step // period``) of one arm with kept steps: (arm, median step time)."""
    medians: dict[int, tuple[int, float]] = {}
    for block, rows in kept.groupby(kept["step"] // period_steps):
        arms = rows["ab_arm"].unique()
        if len(arms) == 1 and int(arms[0]) in (STATIC_ARM, DYNMO_ARM):
            medians[int(block)] = (int(arms[0]), float(np.median(rows["step_time_s"])))
    return medians


def both_order_gains(kept: pd.DataFrame, period_steps: int) -> list[float]:
    """Per three blocks in a row with kept steps, the outer two of one arm and the middle of the
    other: static over balancer, with the outer arm's time the geometric mean of its two blocks
    (the A-then-B and B-then-A pair ratios' geometric mean). ``kept`` as in
    :func:`adjacent_block_gains`.

    Example: blocks A, B, A with medians 1.2, 1.0, 1.5 give ``[sqrt(1.2 * 1.5)]``.
    """
    medians = _block_medians(kept, period_steps)
    gains = []
    for block in sorted(medians):
        if block + 1 not in medians or block + 2 not in medians:
            continue
        (arm, before_s), (mid_arm, mid_s), (after_arm, after_s) = (
            medians[block],
            medians[block + 1],
            medians[block + 2],
        )
        if arm != after_arm or arm == mid_arm:
            continue
        outer_s = float(np.sqrt(before_s * after_s))
        gains.append(outer_s / mid_s if arm == STATIC_ARM else mid_s / outer_s)
    return gains


def adjacent_block_gains(kept: pd.DataFrame, period_steps: int) -> list[float]:
    """Per adjacent pair of blocks (``step // period``: ``j`` and ``j + 1``, one static and one
    balancer block) with kept steps in both: static median step time over balancer median, in
    the order of the pairs. ``kept``: one run's kept steps (``step``, ``ab_arm``,
    ``step_time_s``).

    Example: blocks A, B, A with medians 1.2, 1.0, 1.4 give ``[1.2, 1.4]``.
    """
    medians = _block_medians(kept, period_steps)
    gains = []
    for block in sorted(medians):
        if block + 1 not in medians:
            continue
        (arm, time_s), (next_arm, next_s) = medians[block], medians[block + 1]
        if arm == next_arm:
            continue
        static_s, dynmo_s = (time_s, next_s) if arm == STATIC_ARM else (next_s, time_s)
        gains.append(static_s / dynmo_s)
    return gains


def report_overheads(
    marked: pd.DataFrame,
    stage_times: pd.DataFrame,
    report_costs: pd.DataFrame,
    parts: list[int],
    steps: tuple[int, int],
    poll_max_s: float = 0.0,
    poll_yield_s: float = 0.0,
) -> Overheads | None:
    """The measured :class:`~dynmo_hpc.bench.ceiling.Overheads` of one load report's interval
    (steps ``[first, end)``, all run on ``parts``), over its kept steps (:func:`mark_steps`);
    None when it has none.

    - stage ``p``: median ``compute_s`` (wall seconds in its forward and backward regions) less
      the sum of its layers' seconds in ``report_costs`` (the report's ``layer``, ``forward_s``,
      ``backward_s``), at least 0;
    - tail: median of ``step_time_s`` less the largest ``compute_s + idle_s`` over the stages
      (the schedule's span on the stage that finished last), at least 0.
    """
    first, end = steps
    chosen = marked[(marked["step"] >= first) & (marked["step"] < end) & marked["kept"]]
    if chosen.empty:
        return None
    times = stage_times[stage_times["step"].isin(chosen["step"])]
    compute = times.pivot(index="step", columns="stage", values="compute_s").sort_index()
    idle = times.pivot(index="step", columns="stage", values="idle_s").sort_index()
    if compute.shape[1] != len(parts) - 1:
        return None
    rows = report_costs.sort_values("layer")
    layer_s = (rows["forward_s"] + rows["backward_s"]).to_numpy(dtype=np.float64)
    stage_s = []
    for p in range(len(parts) - 1):
        layers = float(layer_s[parts[p] : parts[p + 1]].sum())
        stage_s.append(max(0.0, float(np.median(compute[p])) - layers))
    span = (compute + idle).max(axis=1)
    step_s = chosen.set_index("step")["step_time_s"].astype(float).reindex(span.index)
    tail_s = max(0.0, float(np.median(step_s - span)))
    return Overheads(
        stage_s=stage_s, tail_s=tail_s, poll_max_s=poll_max_s, poll_yield_s=poll_yield_s
    )


def run_ceilings(
    layer_costs: pd.DataFrame,
    static_parts: list[int],
    num_microbatches: int,
    schedule: str,
    measured: RunTimes | None = None,
) -> dict[int, Ceiling]:
    """Per load report (by its step): the ceiling of its measured costs over ``static_parts``
    (:func:`dynmo_hpc.bench.ceiling.report_ceiling`), with the overheads measured over the
    report's interval (:func:`report_overheads`) when ``measured`` is given and the interval
    has kept steps, else on layer compute only."""
    out: dict[int, Ceiling] = {}
    previous = -1
    for step, group in layer_costs.groupby("step"):
        rows = group.sort_values("layer")
        overheads = None
        if measured is not None and int(step) in measured.parts_at_report:
            overheads = report_overheads(
                measured.marked,
                measured.stage_times,
                rows,
                measured.parts_at_report[int(step)],
                (previous + 1, int(step) + 1),
                measured.poll_max_s,
                measured.poll_yield_s,
            )
        out[int(step)] = report_ceiling(
            rows["forward_s"].astype(float).tolist(),
            rows["backward_s"].astype(float).tolist(),
            static_parts,
            num_microbatches,
            schedule,
            overheads,
        )
        previous = int(step)
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class RunTimes:
    """What a run measured besides its layers, for :func:`run_ceilings`' overheads."""

    marked: pd.DataFrame
    """Its steps, marked (:func:`mark_steps`)."""
    stage_times: pd.DataFrame
    """The run log's ``stage_times`` (step, stage, compute_s, idle_s)."""
    parts_at_report: dict[int, list[int]]
    """Per load report step: the partition in force over its interval."""
    poll_max_s: float = 0.0
    poll_yield_s: float = 0.0


def parts_at_reports(partitions: pd.DataFrame) -> dict[int, list[int]]:
    """Per load report step: the partition the run log's ``partitions`` table recorded there
    (the one in force over the report's interval; a migration at the report comes after)."""
    out = {}
    for step, group in partitions.groupby("step"):
        rows = group.sort_values("stage")
        out[int(step)] = [0, *rows["end_layer"].astype(int).tolist()]
    return out


def phase_ceiling(ceilings: dict[int, Ceiling], first_step: int, end_step: int) -> float | None:
    """The ceiling over the reports at steps ``first_step .. end_step - 1`` (None: no report)."""
    chosen = [c for step, c in ceilings.items() if first_step <= step < end_step]
    return combined_ceiling(chosen) if chosen else None
