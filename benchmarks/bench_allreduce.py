"""The gradient all-reduce's share of step time with two data-parallel replicas.

Trains ``jobs/replicas.yaml`` (2 replicas x 2 stages, 4 local ranks; ``--set`` overrides on top)
for ``--steps`` steps, ``--repeats`` times, balancing statically so no migration perturbs the
step times. From each run log it reads, per step after the first (warm-up), ``step_time_s`` (the
``steps`` table) and each rank's ``allreduce_s`` (the ``stage_times`` table: the exposed
all-reduce, the seconds :meth:`dynmo_hpc.pipeline.grad_sync.GradReducer.finish` takes after the
schedule, the part the last backward did not hide, including the wait for the slower replica),
and reports the median over steps of the slowest rank's all-reduce seconds, of the step time,
and of their ratio per step; the median and range over repeats of that share. Not a timed test:
it prints figures, it asserts nothing about them.
A markdown table goes to stdout, progress to stderr, the same figures as JSON to ``--out FILE``.

    .venv/bin/python benchmarks/bench_allreduce.py --repeats 3 --steps 20
    .venv/bin/python benchmarks/bench_allreduce.py --repeats 1 --steps 4 --set model.d_model=32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.bench.scripts import write_json_out
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "replicas.yaml"


def one_run(out_dir: Path, steps: int, overrides: list[str], repeat: int) -> dict[str, Any]:
    """Train once; the per-step all-reduce seconds (slowest rank), step seconds and shares."""
    cfg = config_mod.load(
        JOB,
        [
            f"train.steps={steps}",
            "balance.algorithm=static",
            "checkpoint.at_end=false",
            "checkpoint.every_steps=0",
            f"job.out_dir={out_dir}",
            f"job.name=allreduce_{repeat}",
            *overrides,
        ],
    )
    rc, run_dir = launch_local(cfg, overwrite=True)
    if rc != 0:
        raise SystemExit(f"error: training run failed with exit code {rc}")
    log = load(run_dir / "run.h5")
    steps_table = log.steps.set_index("step")
    allreduce = log.stage_times.groupby("step")["allreduce_s"].max()
    kept = [s for s in steps_table.index if s >= 1]
    step_s = [float(steps_table.loc[s, "step_time_s"]) for s in kept]
    reduce_s = [float(allreduce.loc[s]) for s in kept]
    return {
        "replicas": cfg.pipeline.replicas,
        "stages": cfg.pipeline.num_stages,
        "median_step_s": statistics.median(step_s),
        "median_allreduce_s": statistics.median(reduce_s),
        "median_share": statistics.median(r / s for r, s in zip(reduce_s, step_s, strict=True)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        print(
            f"error: --steps {args.steps} --repeats {args.repeats}: step 0 is warm-up, so a run "
            "needs at least 2 steps and one repeat; HINT: use --steps 20 --repeats 3",
            file=sys.stderr,
        )
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as tmp:
        for repeat in range(args.repeats):
            print(f"run {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
            rows.append(one_run(Path(tmp), args.steps, args.overrides, repeat))
    shares = [row["median_share"] for row in rows]
    print("| run | replicas x stages | step s (median) | all-reduce s (median) | share |")
    print("| --- | --- | --- | --- | --- |")
    for i, row in enumerate(rows):
        print(
            f"| {i + 1} | {row['replicas']} x {row['stages']} | {row['median_step_s']:.4f} | "
            f"{row['median_allreduce_s']:.4f} | {row['median_share']:.3f} |"
        )
    print(
        f"\nall-reduce share of step time: median {statistics.median(shares):.3f} "
        f"(range {min(shares):.3f}-{max(shares):.3f} over {len(shares)} runs)"
    )
    write_json_out(args.out, {"runs": rows, "overrides": args.overrides}, newline=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
