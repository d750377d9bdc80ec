"""A real imbalanced run: uniform start, then DynMo balancing, against static and the ideal.

jobs/imbalanced.yaml has blocks of two widths, so Megatron's uniform split overloads stage 1.
Each round trains it twice, side by side: ``balance.algorithm=static`` and ``optimal``. From the
run logs it reports tokens/s before the first migration and after the last, the static run's
tokens/s over the same steps, and the ideal: tokens per step / (sum of per-layer costs / P),
i.e. a perfectly balanced pipeline with no bubble and no communication.

    .venv/bin/python benchmarks/bench_imbalanced.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dynmo_hpc import config as config_mod
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load

ROOT = Path(__file__).resolve().parent.parent


def train(out_dir: Path, algorithm: str, steps: int) -> Path:
    cfg = config_mod.load(
        ROOT / "jobs" / "imbalanced.yaml",
        [
            f"job.out_dir={out_dir}",
            f"job.name={algorithm}",
            f"balance.algorithm={algorithm}",
            f"train.steps={steps}",
            "checkpoint.at_end=false",
            "checkpoint.every_steps=0",
        ],
    )
    rc, run_dir = launch_local(cfg, timeout_s=1800)
    if rc:
        raise SystemExit(f"{algorithm} run failed ({rc})")
    return run_dir / "run.h5"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = ["static", "optimal"] if rnd % 2 == 0 else ["optimal", "static"]
            logs = {a: load(train(Path(tmp) / f"r{rnd}", a, args.steps)) for a in order}
            dyn, static = logs["optimal"], logs["static"]
            migrations = dyn.events[dyn.events["kind"] == "migrate"]
            if migrations.empty:
                raise SystemExit("the balancer never migrated; nothing to compare")
            first, last = int(migrations["step"].min()), int(migrations["step"].max())
            tps = dyn.steps.set_index("step")["tokens_per_s"]
            stps = static.steps.set_index("step")["tokens_per_s"]
            before = float(tps[(tps.index >= 1) & (tps.index <= first)].median())
            after = float(tps[tps.index > last + 1].median())
            static_after = float(stps[stps.index > last + 1].median())
            costs = static.layer_costs[
                static.layer_costs["step"] == static.layer_costs["step"].max()
            ]
            total_s = float((costs["forward_s"] + costs["backward_s"]).sum())
            tokens_per_step = float(
                dyn.steps["tokens_per_s"].iloc[0] * dyn.steps["step_time_s"].iloc[0]
            )
            ideal = tokens_per_step / (total_s / 2)
            rows.append(
                {
                    "before": before,
                    "after": after,
                    "static": static_after,
                    "ideal": ideal,
                    "parts_before": dyn.parts_at(int(dyn.report_steps()[0])),
                    "parts_after": json.loads(
                        json.dumps(migrations["detail"].iloc[-1]["new_parts"])
                    ),
                }
            )
            print(f"round {rnd + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(f"jobs/imbalanced.yaml on 2 ranks, {args.rounds} rounds, medians (tokens/s)")
    print(f"partition: uniform {rows[-1]['parts_before']} -> balanced {rows[-1]['parts_after']}")
    print(f"{'dynmo before balancing (uniform split)':<42}{med('before'):>10.0f}")
    print(f"{'dynmo after balancing':<42}{med('after'):>10.0f}")
    print(f"{'static uniform split, same steps':<42}{med('static'):>10.0f}")
    print(f"{'ideal (total layer cost / P)':<42}{med('ideal'):>10.0f}")
    print(
        f"after / before: {med('after') / med('before'):.2f}x; after / static: "
        f"{med('after') / med('static'):.2f}x; after / ideal: {med('after') / med('ideal'):.2f}"
    )


if __name__ == "__main__":
    main()
