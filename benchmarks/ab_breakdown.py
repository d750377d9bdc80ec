"""Where an A/B run's gain went: each arm's measured step against the step model, from its log.

Why: the bench's capture compares a measured gain with a modelled ceiling; when the capture is
low, this says which of the model's parts the run disagrees with. For the steady state of one A/B
run (``balance.ab_period_steps``), per arm (A: the static split, B: the balancer's plan):

- ``step``: median kept step time, and what the ceiling's model (layer costs of each report on
  the partition in force, plus the overheads measured over its interval) predicts for it;
  ``measured/model`` near 1 says the model prices that arm honestly;
- per stage: ``layers`` (its layers' seconds per step, thread CPU), ``compute`` (wall seconds in
  its forward and backward regions), ``idle`` (waiting for inputs), and the tail after the
  schedule;
- ``B's partition``: which partition the balancer ran in each B interval against the best one
  of the ceiling on that report's costs (a plan that lags the costs shows here);
- ``layer cost B/A``: each layer's mean seconds in B reports over A reports (1.0: a layer costs
  the same wherever it runs);
- the ceiling on layer compute only and with the measured overheads, on all reports and on each
  arm's reports alone;
- ``where the gap went``: the gain split exactly into four factors, on each arm's mean layer
  costs (compute only): the ceiling on A's costs, divided by what B's plan loses against the
  best partition at A's costs, by B's layers costing more than A's (two stages computing at
  once on a shared machine), and by B's measured/model over A's (what the model leaves out).

    PYTHONPATH=. .venv/bin/python benchmarks/ab_breakdown.py \
        runs/bench_ab/runs/bench_ab_pruning_optimal_vs_uniform_r0
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_hpc.bench.ab import (
    RunTimes,
    mark_steps,
    parts_at_reports,
    phase_ceiling,
    report_overheads,
    run_ceilings,
)
from dynmo_hpc.bench.ceiling import partition_step_s, report_ceiling
from dynmo_hpc.runlog import load


def _reports(
    run: Any, marked: Any, parts: dict[int, list[int]], first: int
) -> list[dict[str, Any]]:
    """Per steady-state load report: its arm, partition, costs, overheads and kept steps."""
    out, previous = [], -1
    num_microbatches = int(run.config["train"]["num_microbatches"])
    schedule = str(run.config["pipeline"]["schedule"])
    for step, rows in run.layer_costs.groupby("step"):
        step, lo = int(step), previous + 1
        previous = step
        kept = marked[(marked["step"] >= lo) & (marked["step"] <= step) & marked["kept"]]
        if lo < first or kept.empty or step not in parts:
            continue
        rows = rows.sort_values("layer")
        fwd, bwd = rows["forward_s"].to_numpy(), rows["backward_s"].to_numpy()
        overheads = report_overheads(marked, run.stage_times, rows, parts[step], (lo, step + 1))
        times = run.stage_times[run.stage_times["step"].isin(kept["step"])]
        out.append(
            {
                "step": step,
                "arm": int(kept["ab_arm"].iloc[0]),
                "parts": parts[step],
                "costs": fwd + bwd,
                "fwd": fwd,
                "bwd": bwd,
                "measured_s": float(kept["step_time_s"].median()),
                "model_s": partition_step_s(
                    fwd, bwd, parts[step], num_microbatches, schedule, overheads
                ),
                "compute_s": times.groupby("stage")["compute_s"].median().to_numpy(),
                "idle_s": times.groupby("stage")["idle_s"].median().to_numpy(),
                "tail_s": overheads.tail_s if overheads else float("nan"),
            }
        )
    return out


def _arm_lines(reports: list[dict[str, Any]], arm: int) -> list[str]:
    chosen = [r for r in reports if r["arm"] == arm]
    if not chosen:
        return [f"arm {'AB'[arm]}: no report"]
    measured = np.median([r["measured_s"] for r in chosen])
    model = np.median([r["model_s"] for r in chosen])
    ratio = np.median([r["measured_s"] / r["model_s"] for r in chosen])
    layers = np.median(
        [
            [
                r["costs"][p0:p1].sum()
                for p0, p1 in zip(r["parts"][:-1], r["parts"][1:], strict=True)
            ]
            for r in chosen
        ],
        axis=0,
    )
    compute = np.median([r["compute_s"] for r in chosen], axis=0)
    idle = np.median([r["idle_s"] for r in chosen], axis=0)
    tail = np.nanmedian([r["tail_s"] for r in chosen])
    fmt = ", ".join
    return [
        f"arm {'AB'[arm]} ({len(chosen)} reports): step {measured:.3f} s measured, {model:.3f} s "
        f"model, measured/model {ratio:.3f} (median per report)",
        f"  per stage: layers {fmt(f'{x:.3f}' for x in layers)} s, compute "
        f"{fmt(f'{x:.3f}' for x in compute)} s, idle {fmt(f'{x:.3f}' for x in idle)} s; "
        f"tail {tail:.3f} s",
    ]


def gap_line(
    reports: list[dict[str, Any]], static: list[int], num_microbatches: int, schedule: str
) -> str:
    """The gain as ceiling / (plan x layer costs x unmodelled), each arm at its mean costs.

    The four factors multiply back to the measured gain exactly (A measured / B measured): the
    ceiling is static over best on A's mean costs; ``plan`` is B's most frequent partition over
    the best, both on A's costs; ``layer costs`` is B's partition on B's mean costs over it on
    A's; ``unmodelled`` is B's measured/model over A's.
    """
    arms = [[r for r in reports if r["arm"] == arm] for arm in (0, 1)]
    if not all(arms):
        return "where the gap went: needs reports of both arms"
    mean = [
        (np.mean([r["fwd"] for r in chosen], axis=0), np.mean([r["bwd"] for r in chosen], axis=0))
        for chosen in arms
    ]
    measured = [float(np.median([r["measured_s"] for r in chosen])) for chosen in arms]
    plans = [tuple(r["parts"]) for r in arms[1]]
    plan = list(max(set(plans), key=plans.count))
    best = report_ceiling(*mean[0], static, num_microbatches, schedule)

    def model(parts: list[int], arm: int) -> float:
        return partition_step_s(*mean[arm], parts, num_microbatches, schedule)

    plan_loss = model(plan, 0) / best.best_step_s
    cost_rise = model(plan, 1) / model(plan, 0)
    unmodelled = (measured[1] / model(plan, 1)) / (measured[0] / model(static, 0))
    return (
        f"where the gap went: gain {measured[0] / measured[1]:.3f} = ceiling on A's costs "
        f"{best.ratio:.3f} (best {best.best_parts}) / plan {plan_loss:.3f} (B's {plan}) / "
        f"B's layer costs over A's {cost_rise:.3f} / unmodelled {unmodelled:.3f}"
    )


def breakdown(run_dir: Path) -> list[str]:
    """The report's lines for the A/B run in ``run_dir``."""
    run = load(run_dir / "run.h5")
    cfg = run.config
    period = int(cfg["balance"]["ab_period_steps"])
    if period < 1:
        raise SystemExit(f"ab_breakdown: {run_dir} is not an A/B run; HINT: pass a bench --ab run")
    num_steps = int(run.steps["step"].max()) + 1
    first = cfg["train"].get("steady_state_step") or num_steps // 2
    marked = mark_steps(run.steps, run.events[run.events["kind"] == "migrate"]["step"].tolist())
    parts = parts_at_reports(run.partitions)
    reports = _reports(run, marked, parts, int(first))
    static = parts[min(parts)]
    num_microbatches, schedule = (
        int(cfg["train"]["num_microbatches"]),
        str(cfg["pipeline"]["schedule"]),
    )
    times = RunTimes(marked=marked, stage_times=run.stage_times, parts_at_report=parts)
    plain = run_ceilings(run.layer_costs, static, num_microbatches, schedule)
    honest = run_ceilings(run.layer_costs, static, num_microbatches, schedule, times)
    lines = [f"{run_dir.name}: steady state from step {first}, A/B period {period} steps"]
    lines += _arm_lines(reports, 0) + _arm_lines(reports, 1)
    b_reports = [r for r in reports if r["arm"] == 1]
    matches = sum(r["parts"] == honest[r["step"]].best_parts for r in b_reports)
    lines.append(
        f"B's partition is the ceiling's best in {matches} of {len(b_reports)} B reports: "
        + ", ".join(
            f"{r['step']}: {r['parts']} vs {honest[r['step']].best_parts}" for r in b_reports
        )
    )
    a_costs = [r["costs"] for r in reports if r["arm"] == 0]
    b_costs = [r["costs"] for r in b_reports]
    if a_costs and b_costs:
        ratio = np.mean(b_costs, axis=0) / np.mean(a_costs, axis=0)
        lines.append("layer cost B/A: " + " ".join(f"{x:.2f}" for x in ratio))
    for name, ceilings in (("layer compute only", plain), ("with measured overheads", honest)):
        by_arm = []
        for arm in (0, 1):
            steps = {r["step"] for r in reports if r["arm"] == arm}
            chosen = {s: c for s, c in ceilings.items() if s in steps}
            value = phase_ceiling(chosen, 0, num_steps)
            by_arm.append("-" if value is None else f"{value:.3f}")
        total = phase_ceiling(ceilings, int(first), num_steps)
        lines.append(
            f"ceiling, {name}: {total if total is None else round(total, 3)} "
            f"(on A reports {by_arm[0]}, on B reports {by_arm[1]})"
        )
    lines.append(gap_line(reports, static, num_microbatches, schedule))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="A/B run directories")
    for run_dir in parser.parse_args().run_dirs:
        print("\n".join(breakdown(run_dir)), end="\n\n")


if __name__ == "__main__":
    main()
