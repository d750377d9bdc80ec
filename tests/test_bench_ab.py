"""A/B within one run (``balance.ab_period_steps``): the arms, the switch, the run log columns.

The pure parts (which arm a step is in, when the switch migrates, the wall/CPU ratio) are
checked on hand-made inputs; then a real 2-rank run in A/B mode must train exactly what a static
run trains (bitwise losses: migration is invisible to the math), run each block on its arm's
partition, and log every step's arm and wall/CPU ratio.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dynmo_hpc.bench.ab import adjacent_block_gains, compare_arms, mark_steps, report_overheads
from dynmo_hpc.bench.ab_schedule import compare_schedules
from dynmo_hpc.bench.ab_summary import ABRunFigures, ab_rows
from dynmo_hpc.bench.summary import algorithm_label
from dynmo_hpc.cli.bench_ab import ab_order
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.runlog import load
from dynmo_hpc.train.ab_arms import (
    DYNMO_ARM,
    NO_ARM,
    STATIC_ARM,
    ABSwitch,
    ab_arm,
    ab_schedule,
    lead_arm,
    wall_s_per_cpu_s,
)
from tests.helpers.jobs import run_job, tiny_config


def test_arms_alternate_every_period_starting_with_the_static_split() -> None:
    assert [ab_arm(s, 2) for s in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [ab_arm(s, 3) for s in range(7)] == [0, 0, 0, 1, 1, 1, 0]
    assert ab_arm(5, 0) == NO_ARM
    with pytest.raises(ValueError):
        ab_arm(-1, 2)


def test_the_leading_arm_can_be_the_balancers() -> None:
    """``balance.ab_lead: dynmo`` starts with arm B; the switch follows the same blocks."""
    assert [ab_arm(s, 2, DYNMO_ARM) for s in range(6)] == [1, 1, 0, 0, 1, 1]
    assert lead_arm("static") == STATIC_ARM and lead_arm("dynmo") == DYNMO_ARM
    switch = ABSwitch(2, static_parts=[0, 3, 6], dynmo_parts=[0, 3, 6], lead=DYNMO_ARM)
    # report after step 1 (arm B): step 2 is arm A, already in force
    assert switch.after_decision(1, [0, 4, 6], [0, 3, 6]) is None
    # report after step 3 (arm A): step 4 is arm B, the balancer's plan
    assert switch.after_decision(3, None, [0, 3, 6]) == [0, 4, 6]
    with pytest.raises(ValueError):
        ab_arm(0, 2, lead=2)
    with pytest.raises(ValueError):
        lead_arm("b")


def test_switch_migrates_to_the_next_steps_arm_and_keeps_the_balancers_own_plan() -> None:
    switch = ABSwitch(2, static_parts=[0, 3, 6], dynmo_parts=[0, 3, 6])
    # report after step 1 (arm A); the balancer plans [0, 4, 6]; step 2 is arm B: go there
    assert switch.after_decision(1, [0, 4, 6], [0, 3, 6]) == [0, 4, 6]
    # report after step 3 (arm B), the balancer keeps its plan; step 4 is arm A: back
    assert switch.after_decision(3, None, [0, 4, 6]) == [0, 3, 6]
    assert switch.dynmo_parts == [0, 4, 6]
    # a plan made during an A block is remembered but not enacted until the next B block
    switch2 = ABSwitch(4, static_parts=[0, 3, 6], dynmo_parts=[0, 3, 6])
    assert switch2.after_decision(1, [0, 5, 6], [0, 3, 6]) is None
    assert switch2.after_decision(3, None, [0, 3, 6]) == [0, 5, 6]
    # nothing to do when the arm's partition is already in force
    assert switch.after_decision(5, None, [0, 4, 6]) is None


def test_wall_cpu_ratio_is_the_worst_rank_and_nan_without_cpu_time() -> None:
    assert wall_s_per_cpu_s([1.0, 3.0], [1.0, 2.0]) == 1.5
    assert wall_s_per_cpu_s([2.0, 1.0], [1.0, 1.0]) == 2.0
    assert math.isnan(wall_s_per_cpu_s([1.0], [0.0]))
    with pytest.raises(ValueError):
        wall_s_per_cpu_s([1.0], [1.0, 1.0])


def test_pairs_of_blocks_alternate_the_two_schedules() -> None:
    assert [ab_schedule(s, 2, "1f1b", "1f1b-slack") for s in range(10)] == [
        *["1f1b"] * 4,
        *["1f1b-slack"] * 4,
        *["1f1b"] * 2,
    ]
    assert ab_schedule(7, 2, "1f1b", None) == "1f1b"
    assert ab_schedule(7, 0, "1f1b", "gpipe") == "1f1b"  # not an A/B run


@pytest.mark.parametrize("drift", [0.0, 0.02])
def test_schedule_comparison_reads_the_true_speedup_of_each_arm_under_a_drift(
    drift: float,
) -> None:
    """The second schedule is 1.2x faster on the balancer's arm and no faster on the static
    split's; the machine slows geometrically by ``drift`` per pair of blocks."""
    period = 5
    rows = []
    for step in range(120):
        arm = ab_arm(step, period)
        second = ab_schedule(step, period, "1f1b", "1f1b-slack") == "1f1b-slack"
        base_s = 1.0 if arm == STATIC_ARM else 0.8
        if second and arm == DYNMO_ARM:
            base_s /= 1.2
        slow = (1 + drift) ** (step / (2 * period))
        rows.append({"step": step, "ab_arm": arm, "step_time_s": base_s * slow, "kept": True})
    marked = pd.DataFrame(rows)
    got = compare_schedules(marked, period, 20, 120)
    assert got[DYNMO_ARM].speedup == pytest.approx(1.2)
    assert got[STATIC_ARM].speedup == pytest.approx(1.0)
    assert got[DYNMO_ARM].spread == pytest.approx((1.2, 1.2))
    assert len(got[STATIC_ARM].ratios) == 8  # pairs 2-11 of 10 steps: eight triples
    assert compare_schedules(marked, period, 20, 40) == {}  # two pairs: no triple


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["balance.algorithm=optimal", "balance.ab_period_steps=3"], "multiple of"),
        (["balance.algorithm=static", "balance.ab_period_steps=2"], "rebalancing algorithm"),
        (["balance.algorithm=uniform", "balance.ab_period_steps=2"], "rebalancing algorithm"),
        (
            ["balance.algorithm=optimal", "balance.ab_period_steps=2", "elastic.enabled=true"],
            "elastic.enabled=false",
        ),
        (["train.steady_state_step=4"], "steady_state_step=4 is not a step"),
        (["balance.ab_schedule=1f1b-slack"], "ab_period_steps=0; HINT"),
    ],
)
def test_bad_ab_settings_are_refused_with_a_hint(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, *overrides)


IMBALANCED = ["model.layer_d_ff=[16, 16, 16, 2048]", "train.steps=8", "balance.interval=2"]
"""The last block 128x wider than the others: the balancer's plan leaves uniform's split."""


@pytest.mark.mpi
@pytest.mark.slow
def test_ab_run_trains_what_a_static_run_trains_and_logs_its_arms(tmp_path: Path) -> None:
    static_cfg = tiny_config(tmp_path, *IMBALANCED, "job.name=static")
    ab_cfg = tiny_config(
        tmp_path,
        *IMBALANCED,
        "job.name=ab",
        "balance.algorithm=optimal",
        "balance.margin=0",
        "balance.ab_period_steps=2",
    )
    static = run_job(static_cfg)
    ab = run_job(ab_cfg)
    assert ab["losses"] == static["losses"]  # bitwise: the partition never changes the math

    run = load(ab_cfg.run_dir / "run.h5")
    steps = run.steps.sort_values("step")
    assert steps["ab_arm"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert all(math.isfinite(k) and k > 0 for k in steps["wall_s_per_cpu_s"])
    static_parts = [0, 3, 6]
    # The balancer's plan comes from costs measured on this (shared, noisy) machine, so the test
    # derives what arm B must run from the plans the run log records, instead of assuming one:
    # a B block runs the balancer's latest plan from before it, an A block the static split.
    plans = run.events[run.events["kind"] == "rebalance"]
    plan_steps = plans["step"].tolist()
    plan_parts = [d["new_parts"] for d in plans["detail"]]

    def dynmo_plan_before(step: int) -> list[int]:
        made = [parts for at, parts in zip(plan_steps, plan_parts, strict=True) if at < step]
        return made[-1] if made else static_parts

    expected = {1: static_parts, 3: dynmo_plan_before(2), 5: static_parts, 7: dynmo_plan_before(6)}
    # the partition logged at each report is the one its block ran on
    assert {step: run.parts_at(step) for step in expected} == expected
    # a migration at the last report of a block exactly where the next block's partition differs
    blocks = [static_parts, expected[3], static_parts, expected[7]]
    switches = [1 + 2 * i for i in range(3) if blocks[i] != blocks[i + 1]]
    migrations = run.events[run.events["kind"] == "migrate"]
    assert migrations["step"].tolist() == switches
    for step, detail in zip(migrations["step"], migrations["detail"], strict=True):
        assert detail["new_parts"] == blocks[(step + 1) // 2]

    plain = load(static_cfg.run_dir / "run.h5").steps
    assert (plain["ab_arm"] == NO_ARM).all()
    assert {STATIC_ARM, DYNMO_ARM} == set(steps["ab_arm"])

    # Steps 4-7 run GPipe (balance.ab_schedule) on both ranks: same function, summed in another
    # order (all forwards first), so equal to float tolerance.
    both_cfg = dataclasses.replace(
        ab_cfg,
        job=dataclasses.replace(ab_cfg.job, name="ab_gpipe"),
        balance=dataclasses.replace(ab_cfg.balance, ab_schedule="gpipe"),
    )
    both = run_job(both_cfg)
    assert both["losses"] == pytest.approx(static["losses"], rel=1e-5)
    assert both["losses"][:4] == static["losses"][:4]  # steps 0-3: the job's own 1F1B


def test_bench_ab_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``dynmo-hpc bench --ab`` on the tiny imbalanced model: two A/B runs (uniform and the
    parameter split, each against optimal; megatron places the 4 blocks as uniform does, so it
    reports uniform's runs), the headline against the best static baseline, the table with its
    ramp and steady rows, the same losses in both runs, the three files. Structure only: no
    speed is asserted."""
    from dynmo_hpc.bench.ab_summary import HEADLINE_COLUMNS
    from dynmo_hpc.cli import main
    from tests.helpers.jobs import ROOT, TINY

    out = tmp_path / "bench"
    skip = ("train.steps", "balance.algorithm", "balance.interval")
    sets = [s for item in TINY if not item.startswith(skip) for s in ("--set", item)]
    sets += ["--set", IMBALANCED[0], "--set", "balance.interval=2"]
    argv = ["bench", "--ab", "--schemes", "plain"]
    argv += ["--algorithms", "uniform,megatron,parameters,optimal"]
    argv += ["--repeats", "1", "--steps", "24", "--ab-period", "4", "--out", str(out)]
    argv += ["--jobs-dir", str(ROOT / "jobs" / "stress"), *sets]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    text = (out / "results.md").read_text()
    assert text in printed
    assert "megatron = uniform (the same split: run once, reported under both names)" in text
    assert f"Jobs: `{ROOT / 'jobs' / 'stress'}`; 1 repeats" in text
    header = "| scheme | static split | balancer | phase (steps) | static tokens/s |"
    assert header in text
    headline, detail = text.split("Every run, one line per phase")
    assert "| " + " | ".join(HEADLINE_COLUMNS) + " | uniform tokens/s | megatron tokens/s |" in (
        headline
    )
    heads = [line for line in headline.splitlines() if line.startswith("| plain |")]
    # the first block of each arm (steps 0-7) is the warm-up, in neither phase
    assert [h.split("|")[2].strip() for h in heads] == ["ramp 8-11", "steady 12-23"]
    for head in heads:
        cells = [c.strip() for c in head.split("|")[1:-1]]
        assert len(cells) == len(HEADLINE_COLUMNS) + 3  # a tokens/s column per static split
        if cells[3].startswith("no static baseline"):
            continue
        best = cells[3].split(" = ")
        assert set(best) in ({"uniform", "megatron"}, {"parameters"})
        # the best baseline's tokens/s is its own column's (chosen by the lowest gain within
        # its own runs, not by the highest tokens/s); megatron's is uniform's
        names = ("uniform", "megatron", "parameters")
        speeds = {n: float(v) for n, v in zip(names, cells[-3:], strict=True) if v != "-"}
        assert float(cells[4]) == speeds[best[0]]
        assert speeds["megatron"] == speeds["uniform"]
        assert cells[6].endswith(")") and "x (" in cells[6]
    rows = [line for line in detail.splitlines() if line.startswith("| plain |")]
    # uniform, megatron (uniform's runs) and the parameter split, each against optimal: the
    # ramp (8-11), the steady (12-23)
    labels = [tuple(cell.strip() for cell in row.split("|")[2:5]) for row in rows[:6]]
    uniform, megatron, parameters, optimal = (
        algorithm_label(a) for a in ("uniform", "megatron", "parameters", "optimal")
    )
    megatron += " (the same split as uniform: its runs)"
    assert labels == [
        (uniform, optimal, "ramp 8-11"),
        (uniform, optimal, "steady 12-23"),
        (megatron, optimal, "ramp 8-11"),
        (megatron, optimal, "steady 12-23"),
        (parameters, optimal, "ramp 8-11"),
        (parameters, optimal, "steady 12-23"),
    ]
    assert [r.split("|")[5:] for r in rows[:2]] == [r.split("|")[5:] for r in rows[2:4]]
    for row in rows[:6]:
        ceiling = row.split("|")[8].strip()
        assert ceiling == "-" or float(ceiling) >= 1.0
    assert rows[6].endswith("| 0 |")  # the two runs trained the same model, bit for bit
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import h5py

    with h5py.File(out / "results.h5", "r") as f:
        assert sorted(f["runs"]) == [
            "bench_ab_plain_optimal_vs_parameters_r0",
            "bench_ab_plain_optimal_vs_uniform_r0",
        ]
        run = f["runs/bench_ab_plain_optimal_vs_uniform_r0"]
        assert (
            run["ab_arm"][()].tolist() == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
        )
        assert [p.decode() for p in f["rows/phase"][()]] == ["ramp", "steady"] * 3
        assert [p.decode() for p in f["rows/runs_of"][()]] == ["", "", "uniform", "uniform", "", ""]
        best = f["best"]
        assert [p.decode() for p in best["phase"][()]] == ["ramp", "steady"]
        for k, head in enumerate(heads):
            cells = [c.strip() for c in head.split("|")[1:-1]]
            if cells[3].startswith("no static baseline"):
                assert best["static"][k].decode() == ""
                continue
            assert (
                " = ".join(
                    [best["static"][k].decode(), *filter(None, best["tied"][k].decode().split(","))]
                )
                == cells[3]
            )
            assert f"{best['gain'][k]:.2f}x" == cells[6].split()[0]
    # benchmarks/ab_breakdown.py reads a run's log: both arms priced, B's partition checked
    import os
    import subprocess
    import sys

    script = ROOT / "benchmarks" / "ab_breakdown.py"
    run_dir = out / "runs" / "bench_ab_plain_optimal_vs_uniform_r0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("steady state from step 12, A/B period 4 steps")
    assert any(line.startswith("arm A (") and "measured/model" in line for line in lines)
    assert any(line.startswith("ceiling, with measured overheads: ") for line in lines)
    gap = next(line for line in lines if line.startswith("where the gap went: "))
    numbers = [float(w) for w in gap.replace("(", " ").split() if w[:1].isdigit() and "." in w]
    gain, ceiling, plan, costs, unmodelled = numbers
    assert gain == pytest.approx(ceiling / (plan * costs * unmodelled), rel=5e-3)


def _breakdown_script() -> Any:
    import importlib.util

    from tests.helpers.jobs import ROOT

    path = ROOT / "benchmarks" / "ab_breakdown.py"
    spec = importlib.util.spec_from_file_location("ab_breakdown", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gap_factors_name_a_dearer_balanced_arm_and_multiply_back_to_the_gain() -> None:
    """4 layers costing 1, 1, 1, 3 s on the static arm ``[0, 2, 4]``; the balancer runs the
    best split ``[0, 3, 4]`` where every layer costs 10 % more (both stages busy at once) and
    the step 10 % over its model, against the static arm's 5 %: no plan loss, layer costs 1.10,
    unmodelled 1.10 / 1.05, and the factors give back the measured gain."""
    from dynmo_hpc.bench.ceiling import partition_step_s

    script = _breakdown_script()
    fwd, bwd = np.array([0.5, 0.5, 0.5, 1.5]), np.array([0.5, 0.5, 0.5, 1.5])
    a_s = 1.05 * partition_step_s(fwd, bwd, [0, 2, 4], 8)
    b_s = 1.10 * partition_step_s(1.1 * fwd, 1.1 * bwd, [0, 3, 4], 8)
    reports = [
        {"arm": 0, "parts": [0, 2, 4], "fwd": fwd, "bwd": bwd, "measured_s": a_s},
        {"arm": 1, "parts": [0, 3, 4], "fwd": 1.1 * fwd, "bwd": 1.1 * bwd, "measured_s": b_s},
    ]
    line = script.gap_line(reports, [0, 2, 4], 8, "1f1b")
    assert "plan 1.000 (B's [0, 3, 4])" in line and "best [0, 3, 4]" in line
    assert "B's layer costs over A's 1.100" in line
    assert f"unmodelled {1.10 / 1.05:.3f}" in line
    assert f"gain {a_s / b_s:.3f}" in line
    assert "needs reports of both arms" in script.gap_line(reports[:1], [0, 2, 4], 8, "1f1b")


def test_bench_ab_refuses_algorithms_without_a_static_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dynmo_hpc.cli import main
    from tests.helpers.jobs import ROOT

    argv = ["bench", "--ab", "--schemes", "plain", "--algorithms", "optimal,diffusion"]
    argv += ["--out", str(tmp_path), "--jobs-dir", str(ROOT / "jobs" / "stress")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "lacks a static baseline" in err and "HINT" in err


def _steps(
    step_time_s: list[float], ratios: list[float], period: int, lead: int = STATIC_ARM
) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "step": range(len(step_time_s)),
            "step_time_s": step_time_s,
            "wall_s_per_cpu_s": ratios,
            "ab_arm": [ab_arm(s, period, lead) for s in range(len(step_time_s))],
        }
    )


def test_noise_rule_and_migrations_set_steps_aside() -> None:
    # period 4; migrations after steps 3 and 7 (the switches); step 9 ran on a shared core
    times = [1.0, 1.0, 1.0, 5.0, 3.0, 0.8, 0.8, 4.0, 1.0, 9.0, 1.0, 1.0]
    ratios = [1.0] * 12
    ratios[9] = 1.25  # above 1.2 x the median 1.0
    marked = mark_steps(_steps(times, ratios, 4), [3, 7])
    assert marked["migration"].tolist() == [
        False,
        False,
        False,
        True,
        True,
        False,
        False,
        True,
        True,
        False,
        False,
        False,
    ]
    assert marked["noisy"].tolist() == [s == 9 for s in range(12)]
    assert marked["kept"].sum() == 7
    comparison = compare_arms([marked], 4, 0, 12)
    assert comparison is not None
    assert comparison.kept == (5, 2) and comparison.total == (8, 4)
    assert comparison.static_step_s == 1.0 and comparison.dynmo_step_s == 0.8
    # blocks A (steps 0-3), B (4-7), A (8-11): two adjacent pairs, each 1.0 / 0.8
    assert comparison.block_gains == [pytest.approx(1.25)] * 2
    assert comparison.gain == pytest.approx(1.25)
    # the phase bounds cut the steps: the steady state 8-11 has no balancer step at all
    assert compare_arms([marked], 4, 8, 12) is None
    # a looser rule keeps step 9, and a pooled repeat adds its pairs
    loose = mark_steps(_steps(times, ratios, 4), [3, 7], noise_factor=1.3)
    assert loose["kept"].sum() == 8
    pooled = compare_arms([marked, marked], 4, 0, 12)
    assert pooled is not None and pooled.kept == (10, 4) and len(pooled.block_gains) == 4
    with pytest.raises(ValueError):
        mark_steps(_steps(times, ratios, 4), [], noise_factor=0.5)


def test_steps_without_a_ratio_are_never_noisy() -> None:
    marked = mark_steps(_steps([1.0, 1.0], [float("nan"), float("nan")], 1), [])
    assert marked["kept"].tolist() == [True, True]


def test_adjacent_pairs_cancel_a_drift_that_static_then_balancer_pairs_do_not() -> None:
    """The machine slows down 2 % per block while the balancer is exactly 1.2x faster: pairs
    of a block with both neighbours give a median of 1.2 (the drift raises the A-then-B ratios
    and lowers the B-then-A ones alike), where pairing each static block only with the
    balancer block after it would read the drift as gain."""
    period, num_blocks = 5, 12
    times = []
    for step in range(period * num_blocks):
        drift = 1.02 ** (step // period)
        times.append(drift * (1.2 if ab_arm(step, period) == 0 else 1.0))
    marked = mark_steps(_steps(times, [1.0] * len(times), period), [])
    comparison = compare_arms([marked], period, 0, len(times))
    assert comparison is not None
    assert len(comparison.block_gains) == num_blocks - 1
    assert comparison.block_gains[0] == pytest.approx(1.2 / 1.02)  # A then B: B ran slower
    assert comparison.block_gains[1] == pytest.approx(1.2 * 1.02)  # B then A: A ran slower
    assert comparison.gain == pytest.approx(1.2, rel=0.025)
    static_then_balancer = comparison.block_gains[0::2]
    assert sorted(static_then_balancer)[len(static_then_balancer) // 2] < 1.18


@pytest.mark.parametrize("seed", range(5))
def test_gain_lies_in_its_spread(seed: int) -> None:
    """Gain and spread are one statistic (median and quartiles of the same pair ratios), so the
    gain lies inside its spread whatever the data; the old pooled-median gain did not."""
    rng = np.random.default_rng(seed)
    period = 4
    times = rng.lognormal(0.0, 0.3, size=48).tolist()
    marked = mark_steps(_steps(times, [1.0] * 48, period), [7, 15])
    comparison = compare_arms([marked], period, 0, 48)
    assert comparison is not None
    low, high = comparison.spread
    assert low <= comparison.gain <= high


def test_overheads_measured_from_the_run_and_priced_per_stage() -> None:
    """A report's overheads from its interval's kept steps: per stage, wall time in its regions
    beyond its layers; the tail, step time beyond the slowest stage's compute plus waits."""
    marked = mark_steps(_steps([1.0, 1.1, 9.0], [1.0, 1.0, 1.0], 0), [2])
    stage_times = pd.DataFrame(
        {
            "step": [0, 0, 1, 1, 2, 2],
            "stage": [0, 1] * 3,
            "compute_s": [0.7, 0.5, 0.7, 0.5, 5.0, 5.0],
            "idle_s": [0.1, 0.3, 0.2, 0.4, 0.0, 0.0],
        }
    )
    costs = pd.DataFrame(
        {"layer": [0, 1, 2], "forward_s": [0.2, 0.1, 0.1], "backward_s": [0.4, 0.2, 0.2]}
    )
    overheads = report_overheads(marked, stage_times, costs, [0, 1, 3], (0, 3), 1e-3)
    assert overheads is not None
    # step 2 migrated: set aside. Stage 0: 0.7 - 0.6; stage 1: 0.5 - 0.6 -> 0 (never negative)
    assert overheads.stage_s == [pytest.approx(0.1), 0.0]
    # tails: 1.0 - max(0.8, 0.8) = 0.2 and 1.1 - max(0.9, 0.9) = 0.2
    assert overheads.tail_s == pytest.approx(0.2) and overheads.poll_max_s == 1e-3
    assert report_overheads(marked, stage_times, costs, [0, 1, 3], (2, 3)) is None


def test_run_ceilings_price_each_report_with_its_intervals_overheads() -> None:
    """Two reports (steps 1 and 3) on [0, 1, 2]; the run spent 1 s per step after the schedule,
    which every partition pays, so the ceiling with it is lower than on layer compute alone."""
    from dynmo_hpc.bench.ab import RunTimes, parts_at_reports, run_ceilings

    costs = pd.DataFrame(
        {
            "step": [1, 1, 3, 3],
            "layer": [0, 1, 0, 1],
            "forward_s": [1.0, 3.0, 1.0, 3.0],
            "backward_s": [0.0] * 4,
        }
    )
    partitions = pd.DataFrame(
        {"step": [1, 1, 3, 3], "stage": [0, 1, 0, 1], "end_layer": [1, 2, 1, 2]}
    )
    assert parts_at_reports(partitions) == {1: [0, 1, 2], 3: [0, 1, 2]}
    marked = mark_steps(_steps([5.0, 5.0, 5.0, 5.0], [1.0] * 4, 0), [])
    stage_times = pd.DataFrame(
        {
            "step": [s for s in range(4) for _ in (0, 1)],
            "stage": [0, 1] * 4,
            "compute_s": [1.0, 3.0] * 4,
            "idle_s": [3.0, 1.0] * 4,
        }
    )
    times = RunTimes(
        marked=marked, stage_times=stage_times, parts_at_report=parts_at_reports(partitions)
    )
    plain = run_ceilings(costs, [0, 1, 2], 1, "1f1b")
    honest = run_ceilings(costs, [0, 1, 2], 1, "1f1b", times)
    # one microbatch through both stages: 4 s on any 2-stage split of 2 layers; plus the tail 1
    assert plain[1].static_step_s == 4.0 and honest[1].static_step_s == 5.0
    assert honest[3].static_step_s == 5.0


def test_a_signal_that_stops_a_run_stops_the_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to ``dynmo-hpc bench`` reaches the run's ranks, which stop cleanly (exit 0 with
    the signal recorded): the bench must stop there, exit 128 + 15 and say where the run is,
    rather than go on to its next run (it did: a killed bench kept training)."""
    import signal

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.cli import bench_ab
    from dynmo_hpc.errors import Interrupted
    from dynmo_hpc.launch import local
    from dynmo_hpc.launch.supervisor import JobOutcome

    calls: list[str] = []

    def stopped(cfg: config_mod.JobConfig, **_: object) -> JobOutcome:
        calls.append(cfg.job.name)
        return JobOutcome(exit_code=0, failures=[], restarts=0, interrupted=signal.SIGTERM)

    monkeypatch.setattr(local, "run_local", stopped)
    cfg = tiny_config(tmp_path, "job.name=stopped")
    with pytest.raises(Interrupted, match=r"interrupted \(SIGTERM\) during stopped") as caught:
        bench_ab.train_run("stopped", cfg)
    assert caught.value.signum == signal.SIGTERM
    from dynmo_hpc.cli import main

    rc = main(
        [
            "bench",
            "--schemes",
            "plain",
            "--algorithms",
            "uniform,optimal",
            "--steps",
            "10",
            "--out",
            str(tmp_path / "bench"),
        ]
    )
    assert rc == 128 + signal.SIGTERM
    assert len(calls) == 2  # the direct call, then the bench's first run only
    assert "interrupted (SIGTERM)" in capsys.readouterr().err


def _drifting_times(num_blocks: int, period: int, lead: int, gain: float) -> list[float]:
    """Step times of a machine (or a ramping model) that slows 3 % per block, with the static
    arm ``gain`` times slower than the balancer's."""
    times = []
    for step in range(period * num_blocks):
        drift = 1.03 ** (step // period)
        times.append(drift * (gain if ab_arm(step, period, lead) == STATIC_ARM else 1.0))
    return times


@pytest.mark.parametrize("gain", [1.0, 1.2])
def test_pairs_taken_in_both_orders_read_the_true_gain_under_a_drift(gain: float) -> None:
    """Repeats leading with either arm, a steady drift: the both-order gain reads exactly the
    true gain (1.0: none; 1.2), every triple of blocks alike, where pairs of one order alone
    read the drift as gain or loss."""
    period, num_blocks = 3, 10
    marked = [
        mark_steps(
            _steps(_drifting_times(num_blocks, period, lead, gain), [1.0] * 30, period, lead), []
        )
        for lead in (STATIC_ARM, DYNMO_ARM)
    ]
    both = compare_arms(marked, period, 0, period * num_blocks, both_orders=True)
    assert both is not None and len(both.block_gains) == 2 * (num_blocks - 2)
    assert both.block_gains == [pytest.approx(gain, rel=1e-12)] * len(both.block_gains)
    assert both.gain == pytest.approx(gain, rel=1e-12)
    static_first = compare_arms(marked[:1], period, 0, period, both_orders=False)
    assert static_first is None  # one block: no pair
    one_order = adjacent_block_gains(marked[0][marked[0]["kept"]], period)[0::2]
    assert one_order == [pytest.approx(gain / 1.03)] * len(one_order)


def test_warmup_sets_aside_one_block_of_each_arm() -> None:
    """The first two blocks (one per arm, whichever leads) are in neither phase; the ramp gain
    comes from pairs taken in both orders."""
    period = 2
    times = [9.0, 9.0, 5.0, 5.0] + [1.2, 1.2, 1.0, 1.0] * 4
    marked = mark_steps(_steps(times, [1.0] * len(times), period), [])
    figures = ABRunFigures(
        marked=marked,
        ceilings={},
        losses=[0.0] * len(times),
        period_steps=period,
        steady_from_step=12,
        num_steps=len(times),
        tokens_per_step=100,
        num_migrations=0,
        wall_s=1.0,
    )
    assert figures.phase_bounds("ramp") == (4, 12)
    assert figures.phase_bounds("steady") == (12, 20)
    ramp, steady = ab_rows("plain", "uniform", "optimal", [figures])
    assert ramp.comparison is not None and steady.comparison is not None
    assert ramp.comparison.block_gains == [pytest.approx(1.2)] * 2  # blocks 2-5: A B A B
    assert ramp.comparison.gain == pytest.approx(1.2)
    assert steady.comparison.gain == pytest.approx(1.2)
    short = dataclasses.replace(figures, steady_from_step=2)
    assert short.phase_bounds("ramp") == (4, 4) and short.phase_bounds("steady") == (4, 20)


def test_the_bench_alternates_the_leading_arm_over_repeats(tmp_path: Path) -> None:
    order = ab_order(["plain"], ["uniform", "optimal"], 4)
    assert [p.lead for p in order] == ["static", "dynmo", "static", "dynmo"]
    cfg = tiny_config(tmp_path, "balance.ab_lead=dynmo")
    assert cfg.balance.ab_lead == "dynmo"
    with pytest.raises(ConfigError, match="ab_lead"):
        tiny_config(tmp_path, "balance.ab_lead=b")


@pytest.mark.mpi
def test_bench_profiles_each_job_once_for_the_profiled_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``profiled``: one short static run per job measures the layers' costs, and the static
    split is the best one for them (on this tiny model the measured costs decide whether that is
    uniform's split or moves the wide last block; either way the bench reports it as such)."""
    from dynmo_hpc.cli import main
    from tests.helpers.jobs import ROOT, TINY

    out = tmp_path / "bench"
    skip = ("train.steps", "balance.algorithm", "balance.interval")
    sets = [s for item in TINY if not item.startswith(skip) for s in ("--set", item)]
    sets += ["--set", IMBALANCED[0], "--set", "balance.interval=2"]
    argv = ["bench", "--schemes", "plain", "--algorithms", "uniform,profiled,optimal"]
    argv += ["--steps", "16", "--ab-period", "4", "--out", str(out)]
    argv += ["--jobs-dir", str(ROOT / "jobs" / "stress"), *sets]
    assert main(argv) == 0
    capsys.readouterr()
    profile = load(out / "runs" / "profile_plain" / "run.h5")
    assert len(profile.steps) == 4
    assert sorted(profile.layer_costs["step"].unique()) == [1, 3]  # two reports
    assert profile.events[profile.events["kind"] == "migrate"].empty  # static: it only measures
    # The profiled split is the best one for the profiling run's last report, whatever this
    # machine measured there.
    from dynmo_hpc.balance import partition

    costs = profile.layer_costs[profile.layer_costs["step"] == 3].sort_values("layer")
    costs_s = (costs["forward_s"] + costs["backward_s"]).tolist()
    want = partition(costs_s, 2, "optimal", current=[0, 3, 6])
    text = (out / "results.md").read_text()
    if want == [0, 3, 6]:
        assert "profiled = uniform (the same split" in text, text
    else:
        assert f"profiled {want}" in text and "uniform [0, 3, 6]" in text, text
        ab = load(out / "runs" / "bench_ab_plain_optimal_vs_profiled_r0" / "run.h5")
        assert ab.config["pipeline"]["partition"] == want  # arm A: the profiled split


@pytest.mark.mpi
def test_a_static_baseline_places_the_layers_once_in_training(tmp_path: Path) -> None:
    """``balance.algorithm=profiled`` in a job: the first load report places the layers by the
    costs measured so far (when the move pays), and no later report moves them."""
    cfg = tiny_config(
        tmp_path, *IMBALANCED, "balance.algorithm=profiled", "balance.margin=0", "job.name=p"
    )
    run_job(cfg)
    run = load(cfg.run_dir / "run.h5")
    # The first report decides (a move that does not pay on the costs measured so far, on a
    # loaded machine, is not made); no later report moves anything.
    plans = run.events[run.events["kind"] == "rebalance"]
    assert plans["step"].tolist() in ([], [1])
    migrations = run.events[run.events["kind"] == "migrate"]
    assert all(step <= 1 for step in migrations["step"])
    if len(plans):
        assert plans["detail"].iloc[0]["new_parts"] == [0, 4, 6]
        assert run.parts_at(7) == [0, 4, 6]


@pytest.mark.mpi
def test_a_run_alternating_two_schedules_is_read_per_arm(tmp_path: Path) -> None:
    """``balance.ab_schedule``: a real A/B run alternating 1F1B and 1F1B-slack in pairs of
    blocks; ``benchmarks/ab_schedule.py`` reads each arm's speedup of the second schedule."""
    import subprocess
    import sys

    from tests.helpers.jobs import ROOT

    cfg = tiny_config(
        tmp_path,
        *IMBALANCED,
        "train.steps=72",
        "train.steady_state_step=8",
        "job.name=bench_ab_plain_optimal_vs_uniform_r0",
        "balance.algorithm=optimal",
        "balance.ab_period_steps=8",  # the first and last step of a block time the moves
        "balance.ab_schedule=1f1b-slack",
    )
    run_job(cfg)
    script = ROOT / "benchmarks" / "ab_schedule.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(cfg.run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| plain |")]
    assert [row.split("|")[3].strip() for row in rows] == ["A static", "B balancer"], proc.stdout
    for row in rows:
        assert "1f1b-slack over 1f1b" in row
        speedup = float(row.split("|")[4].split()[0])
        assert 0.2 < speedup < 5.0  # a ratio of step times, whatever this machine's noise
