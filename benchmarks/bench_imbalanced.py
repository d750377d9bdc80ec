"""A real imbalanced run: uniform start, then DynMo balancing, against static and the ideal.

jobs/imbalanced.yaml has blocks of two widths, so Megatron's uniform split overloads stage 1.
Each round trains it twice, side by side: ``balance.algorithm=static`` and ``optimal``. From the
run logs it reports tokens/s before the first migration and after the last, the static run's
tokens/s over the same steps, and the ideal: tokens per step / (sum of per-layer costs / P),
i.e. a perfectly balanced pipeline with no bubble and no communication.

Figures are medians over rounds with the range; runs too short for the windows are refused with
one line (exit status 1) instead of printing nan.

    .venv/bin/python benchmarks/bench_imbalanced.py [--rounds 2] [--steps 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd

from dynmo_hpc import config as config_mod
from dynmo_hpc.bench.scripts import write_json_out
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load

ROOT = Path(__file__).resolve().parent.parent


MIN_STEPS_AFTER = 2
"""Measured steps the 'after' window needs after the last migration and its settling step."""


def job_config(out_dir: Path, algorithm: str, steps: int) -> config_mod.JobConfig:
    return config_mod.load(
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


def train(out_dir: Path, algorithm: str, steps: int) -> Path:
    rc, run_dir = launch_local(job_config(out_dir, algorithm, steps), timeout_s=1800)
    if rc:
        raise SystemExit(f"bench_imbalanced: the {algorithm} run failed (exit code {rc})")
    return run_dir / "run.h5"


def check_settings(rounds: int, steps: int) -> None:
    """Refuse settings whose windows would be empty: one line on stderr, exit status 1.

    The first load report comes at step ``interval - 1`` and its migration right after it; the
    step after a migration is left out (it settles), so the 'after' window needs
    ``interval + 1 + MIN_STEPS_AFTER`` steps at least.
    """
    if rounds < 1:
        raise SystemExit(f"bench_imbalanced: --rounds must be >= 1, got {rounds}")
    interval = job_config(Path("unused"), "optimal", max(steps, 1)).balance.interval
    min_steps = interval + 1 + MIN_STEPS_AFTER
    if steps < min_steps:
        raise SystemExit(
            f"bench_imbalanced: --steps {steps} is too short for its windows (the first "
            f"migration follows step {interval - 1}, and {MIN_STEPS_AFTER} steps must follow "
            f"it and its settling step); HINT: use --steps {min_steps} or more"
        )


def window_median(tps: pd.Series, low: int, high: int | None, what: str) -> float:
    """Median tokens/s over steps ``low..high`` (inclusive; open above when ``high`` is None)."""
    mask = tps.index >= low if high is None else (tps.index >= low) & (tps.index <= high)
    window = tps[mask]
    if len(window) < 1:
        raise SystemExit(
            f"bench_imbalanced: no step left for '{what}' (steps {low}..{high or 'end'}): the "
            "balancer migrated too late in the run; HINT: use more --steps"
        )
    return float(window.median())


def measure_round(tmp: Path, rnd: int, steps: int) -> dict[str, object]:
    """One round: static and optimal back to back (order alternating), figures from the logs."""
    order = ["static", "optimal"] if rnd % 2 == 0 else ["optimal", "static"]
    logs = {a: load(train(tmp / f"r{rnd}", a, steps)) for a in order}
    dyn, static = logs["optimal"], logs["static"]
    migrations = dyn.events[dyn.events["kind"] == "migrate"]
    if migrations.empty:
        raise SystemExit("bench_imbalanced: the balancer never migrated; nothing to compare")
    first, last = int(migrations["step"].min()), int(migrations["step"].max())
    tps = dyn.steps.set_index("step")["tokens_per_s"]
    stps = static.steps.set_index("step")["tokens_per_s"]
    costs = static.layer_costs[static.layer_costs["step"] == static.layer_costs["step"].max()]
    total_s = float((costs["forward_s"] + costs["backward_s"]).sum())
    tokens_per_step = float(dyn.steps["tokens_per_s"].iloc[0] * dyn.steps["step_time_s"].iloc[0])
    return {
        "before": window_median(tps, 1, first, "before balancing"),
        "after": window_median(tps, last + 2, None, "after balancing"),
        "static": window_median(stps, last + 2, None, "static, same steps"),
        "ideal": tokens_per_step / (total_s / 2),
        "parts_before": dyn.parts_at(int(dyn.report_steps()[0])),
        "parts_after": json.loads(json.dumps(migrations["detail"].iloc[-1]["new_parts"])),
        "first_migration_step": first,
        "last_migration_step": last,
    }


def print_table(rows: list[dict[str, object]], rounds: int) -> None:
    """A markdown table: medians over rounds with [min-max] in brackets, and the ratios."""
    med = lambda key: statistics.median(float(r[key]) for r in rows)  # noqa: E731

    def cell(key: str) -> str:
        values = [float(r[key]) for r in rows]  # type: ignore[arg-type]
        return f"{med(key):.0f} [{min(values):.0f}-{max(values):.0f}]"

    print(f"jobs/imbalanced.yaml on 2 ranks, {rounds} rounds, tokens/s median [min-max]")
    print("| | tokens/s |")
    print("| --- | --- |")
    print(f"| uniform split `{rows[-1]['parts_before']}`, before balancing | {cell('before')} |")
    print(
        f"| after DynMo balanced (`{rows[-1]['parts_after']}`) | {cell('after')} "
        f"({med('after') / med('before'):.2f}x) |"
    )
    print(f"| static uniform split, same steps | {cell('static')} |")
    print(f"| ideal: tokens per step / (sum of layer costs / 2) | {cell('ideal')} |")
    print(
        f"after / before: {med('after') / med('before'):.2f}x; after / static: "
        f"{med('after') / med('static'):.2f}x; after / ideal: {med('after') / med('ideal'):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None, help="also write the rounds here")
    args = parser.parse_args()
    check_settings(args.rounds, args.steps)
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            rows.append(measure_round(Path(tmp), rnd, args.steps))
            print(f"round {rnd + 1}: {rows[-1]}", file=sys.stderr, flush=True)
    print_table(rows, args.rounds)
    write_json_out(args.json, {"rounds": rows, "steps": args.steps}, indent=None, newline=False)


if __name__ == "__main__":
    main()
