"""How far a run's per-layer cost profile moved, and how unbalanced the uniform split ends.

Why: a scheme job is only a useful test of the balancer if its schemes change the *shape* of the
per-layer cost during training (not just its total) and leave the uniform split unbalanced. For
each run directory this reads the run log's load reports and prints

* ``tv``: the total variation distance ``0.5 * sum_i |p_i - q_i|`` between the per-block cost
  shares (cost = forward_s + backward_s of blocks 1..num_blocks, normalised to sum 1) at the
  first and at the last load report (0: same shape, 1: disjoint);
* ``stage max/min``: heaviest / lightest stage cost, all layers included, under the uniform split
  (:func:`dynmo_hpc.balance.static.uniform`) at the last load report;
* ``wall``: the run's wall time from its first to its last step record (training only, without
  the launch).

    .venv/bin/python benchmarks/scheme_shift.py runs/moe runs/pruning ...
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

from dynmo_hpc.balance.static import uniform
from dynmo_hpc.runlog import load


def shift(run_dir: Path) -> dict[str, float]:
    """The profile shift figures of one run (see the module docstring)."""
    log = load(run_dir / "run.h5")
    num_blocks = int(log.config["model"]["num_blocks"])
    num_stages = int(log.config["pipeline"]["num_stages"])
    costs = log.layer_costs.copy()
    costs["cost_s"] = costs["forward_s"] + costs["backward_s"]
    steps = sorted(int(s) for s in costs["step"].unique())
    if not steps:
        raise SystemExit(
            f"scheme_shift: {run_dir} has no load report; HINT: give runs of more than "
            "balance.interval steps"
        )

    def layer_costs(step: int) -> np.ndarray:
        rows = costs[costs["step"] == step].sort_values("layer")
        return rows["cost_s"].to_numpy()

    first, last = layer_costs(steps[0]), layer_costs(steps[-1])
    p = first[1 : num_blocks + 1] / first[1 : num_blocks + 1].sum()
    q = last[1 : num_blocks + 1] / last[1 : num_blocks + 1].sum()
    bounds = uniform(list(last), num_stages)
    stage = [last[a:b].sum() for a, b in itertools.pairwise(bounds)]
    wall = log.steps["wall_s"]
    return {
        "first_step": steps[0],
        "last_step": steps[-1],
        "tv": 0.5 * float(np.abs(p - q).sum()),
        "stage_ratio": max(stage) / min(stage),
        "wall_s": float(wall.iloc[-1] - wall.iloc[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (with run.h5)")
    args = parser.parse_args()
    print(f"{'run':<20}{'reports':>10}{'tv':>8}{'stage max/min':>15}{'wall':>9}")
    for run_dir in args.runs:
        s = shift(run_dir)
        reports = f"{s['first_step']}-{s['last_step']}"
        print(
            f"{run_dir.name:<20}{reports:>10}{s['tv']:>8.3f}{s['stage_ratio']:>15.2f}"
            f"{s['wall_s']:>8.0f}s"
        )


if __name__ == "__main__":
    main()
