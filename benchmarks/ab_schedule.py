"""Which microbatch schedule is faster, on each arm of A/B runs that alternated two schedules.

Runs made with ``dynmo-hpc bench ... --set balance.ab_schedule=1f1b-slack`` alternate the jobs'
``pipeline.schedule`` and ``balance.ab_schedule`` in pairs of blocks (one block of each arm), so
each arm meets both schedules over the same minutes (:mod:`dynmo_hpc.bench.ab_schedule`). For
each run, and pooled per scheme over repeats, this prints per arm (A: the static split, B: the
balancer's plan) the median kept step time under each schedule and the second schedule's
speedup over the first (median over three-pair windows, 25th-75th percentiles) in the steady
state (after the bench's warm-up blocks):

    PYTHONPATH=. .venv/bin/python benchmarks/ab_schedule.py runs/bench_sched/runs/*
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from dynmo_hpc.bench.ab import STATIC_ARM, mark_steps
from dynmo_hpc.bench.ab_schedule import compare_schedules
from dynmo_hpc.bench.ab_summary import WARMUP_BLOCKS
from dynmo_hpc.runlog import load

ARM_LABELS = {STATIC_ARM: "A static"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="A/B run directories (run.h5 inside)")
    args = parser.parse_args()
    pooled: dict[tuple[str, int], list[float]] = defaultdict(list)
    names: dict[str, tuple[str, str]] = {}
    print("| run | arm | first schedule step s | second step s | second's speedup (IQR) |")
    print("| --- | --- | --- | --- | --- |")
    for run_dir in args.runs:
        run = load(run_dir / "run.h5")
        balance, pipeline = run.config["balance"], run.config["pipeline"]
        second = balance.get("ab_schedule")
        if not second:
            print(f"| {run_dir.name} | - | not a two-schedule run | | |")
            continue
        period = int(balance["ab_period_steps"])
        steps = run.steps.sort_values("step")
        migrations = run.events[run.events["kind"] == "migrate"]["step"].tolist()
        marked = mark_steps(steps, migrations)
        steady = run.config["train"].get("steady_state_step")
        num_steps = int(run.config["train"]["steps"])
        first = max(WARMUP_BLOCKS * period, num_steps // 2 if steady is None else int(steady))
        scheme = run_dir.name.removeprefix("bench_ab_").split("_optimal_")[0]
        names[scheme] = (str(pipeline["schedule"]), str(second))
        for arm, comparison in sorted(compare_schedules(marked, period, first, num_steps).items()):
            q25, q75 = comparison.spread
            label = ARM_LABELS.get(arm, "B balancer")
            print(
                f"| {run_dir.name} | {label} | {comparison.first_step_s:.3f} | "
                f"{comparison.second_step_s:.3f} | {comparison.speedup:.3f} "
                f"({q25:.3f}-{q75:.3f}) |"
            )
            pooled[(scheme, arm)] += comparison.ratios
    print()
    print("| scheme | schedules | arm | second's speedup, repeats pooled (IQR, windows) |")
    print("| --- | --- | --- | --- |")
    for (scheme, arm), ratios in sorted(pooled.items()):
        q25, q75 = np.percentile(ratios, [25, 75])
        first_name, second_name = names[scheme]
        print(
            f"| {scheme} | {second_name} over {first_name} | {ARM_LABELS.get(arm, 'B balancer')} "
            f"| {np.median(ratios):.3f} ({q25:.3f}-{q75:.3f}, {len(ratios)}) |"
        )


if __name__ == "__main__":
    main()
