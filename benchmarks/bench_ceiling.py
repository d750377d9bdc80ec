"""The most any partition could gain over the uniform split, from a run's own load reports.

For each report it takes the per-layer costs (forward + backward thread seconds per step) and
compares the heaviest stage of Megatron's uniform split with that of the exact min-max split on
the run's stage count. It prints, per run directory, the ratio summed over the run's reports (the
compute-only ceiling on a whole run's speedup) and at its last report. The README's bench table
quotes it for the uniform runs of a bench:

    .venv/bin/python benchmarks/bench_ceiling.py runs/bench/runs/bench_*_uniform_r0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dynmo_hpc.balance import partition
from dynmo_hpc.balance.common import loads_from_prefix, prefix_sums
from dynmo_hpc.runlog import load


def ceiling(run_dir: Path) -> tuple[float, float]:
    """(over the whole run, at the last report): uniform heaviest stage / optimal heaviest."""
    run = load(run_dir / "run.h5")
    num_stages = int(run.config["pipeline"]["num_stages"])
    if run.layer_costs.empty:
        raise SystemExit(
            f"bench_ceiling: {run_dir} has no load report; HINT: give runs of more than "
            "balance.interval steps"
        )
    costs = run.layer_costs.assign(cost_s=run.layer_costs.forward_s + run.layer_costs.backward_s)
    uniform_s = optimal_s = 0.0
    last = 1.0
    for _, group in sorted(costs.groupby("step"), key=lambda item: item[0]):
        values = group.sort_values("layer")["cost_s"].tolist()
        prefix = prefix_sums(values)
        u = max(loads_from_prefix(prefix, partition(values, num_stages, "uniform")))
        o = max(loads_from_prefix(prefix, partition(values, num_stages, "optimal")))
        uniform_s, optimal_s, last = uniform_s + u, optimal_s + o, u / o
    return uniform_s / optimal_s, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (holding run.h5)")
    args = parser.parse_args()
    print("| run | ceiling over the run | at the last report |")
    print("| --- | --- | --- |")
    for run_dir in args.runs:
        whole, last = ceiling(run_dir)
        print(f"| {run_dir.name} | {whole:.3f} | {last:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
