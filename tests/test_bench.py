"""``dynmo-hpc bench``: the interleaved run order, the algorithm overrides, the ideal, the
same-model check, and one real bench end to end on a tiny setting (two algorithms, one repeat)."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import pandas as pd
import pytest

from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.bench.algorithms import PlannedRun, algorithm_overrides, run_order
from dynmo_hpc.bench.measure import RunFigures, ideal_step_s, ideal_train_s, run_figures
from dynmo_hpc.bench.summary import (
    LossMismatchError,
    Spread,
    algorithm_label,
    check_same_losses,
    max_loss_difference,
    speedup,
    summarize,
)
from dynmo_hpc.cli import main
from tests.helpers.jobs import ROOT, TINY


def test_run_order_interleaves_and_rotates_algorithms() -> None:
    order = run_order(["plain", "moe"], ["a", "b", "c"], 2)
    assert [(r.repeat, r.scheme, r.algorithm) for r in order] == [
        (0, "plain", "a"), (0, "plain", "b"), (0, "plain", "c"),
        (0, "moe", "a"), (0, "moe", "b"), (0, "moe", "c"),
        (1, "plain", "b"), (1, "plain", "c"), (1, "plain", "a"),
        (1, "moe", "b"), (1, "moe", "c"), (1, "moe", "a"),
    ]  # fmt: skip
    assert PlannedRun(1, "moe", "a").name == "bench_moe_a_r1"
    with pytest.raises(ValueError, match="repeats=0"):
        run_order(["plain"], ["a"], 0)


def test_algorithm_overrides() -> None:
    assert algorithm_overrides("uniform", 2, [1, 1, 1, 1]) == [
        "balance.algorithm=static",
        "pipeline.partition=null",
    ]
    # DeepSpeed's split balances parameters: the one big layer gets a stage of its own.
    assert algorithm_overrides("parameters", 2, [10, 10, 10, 30]) == [
        "balance.algorithm=static",
        "pipeline.partition=[0, 3, 4]",
    ]
    assert algorithm_overrides("diffusion", 2, [1, 1])[0] == "balance.algorithm=diffusion"
    with pytest.raises(ValueError, match="unknown algorithm"):
        algorithm_overrides("fastest", 2, [1, 1])


def test_ideal_step_time_by_hand() -> None:
    # 4 microbatches on 2 stages: fill and drain 5/4; total 8 over 2 stages = 4 > heaviest 3.
    assert ideal_step_s([1, 3, 2, 2], 2, 4) == pytest.approx(5 / 4 * 4)
    # A layer heavier than the even share bounds every partition.
    assert ideal_step_s([1, 6, 1], 2, 4) == pytest.approx(5 / 4 * 6)
    assert ideal_step_s([2, 2], 1, 3) == pytest.approx(4)
    with pytest.raises(ValueError):
        ideal_step_s([], 2, 4)


def _costs(rows: list[tuple[int, list[float]]]) -> pd.DataFrame:
    records = [
        {"step": step, "layer": layer, "forward_s": c / 2, "backward_s": c / 2}
        for step, vector in rows
        for layer, c in enumerate(vector)
    ]
    return pd.DataFrame.from_records(records)


def test_ideal_train_time_prices_each_step_with_its_report() -> None:
    # Reports after steps 1 and 3 (interval 2) and after the last step 4.
    costs = _costs([(1, [1.0, 1.0]), (3, [2.0, 2.0]), (4, [4.0, 0.0])])
    total_s = ideal_train_s(costs, 5, 2, 1)
    # M=1, P=2: fill 2. Steps 0-1: 2 * max(1, 1) each; 2-3: 2 * 2; 4: 2 * 4.
    assert total_s == pytest.approx(2 * (2 * 1) + 2 * (2 * 2) + 1 * (2 * 4))


def test_run_figures_count_moves_and_migration_seconds() -> None:
    steps = pd.DataFrame({"step": [0, 1, 2, 3], "step_time_s": [1.0, 1.0, 2.0, 1.0]})
    steps["loss"] = [4.0, 3.0, 2.0, 1.0]
    events = pd.DataFrame(
        {
            "step": [1, 3],
            "kind": ["migrate", "rebalance"],
            "detail": [{"num_moves": 2, "seconds": 0.5}, {"num_moves": 9}],
        }
    )
    figures = run_figures(
        steps=steps,
        layer_costs=_costs([(1, [0.25, 0.25]), (3, [0.25, 0.25])]),
        events=events,
        tokens_per_step=100,
        num_stages=2,
        num_microbatches=1,
        wall_s=9.0,
    )
    assert figures.tokens == 400 and figures.train_s == 5.0
    assert figures.tokens_per_s == pytest.approx(80.0)
    assert figures.num_moves == 2 and figures.num_migrations == 1 and figures.migration_s == 0.5
    # Ideal step: 2 * 0.25 = 0.5 s, so 400 tokens in 2 s.
    assert figures.ideal_tokens_per_s == pytest.approx(200.0)
    assert figures.efficiency == pytest.approx(0.4)
    assert figures.final_loss == 1.0
    # the steady state defaults to the second half: steps 2-3, 200 tokens in 3 s; ramp 200 in 2 s
    assert figures.steady_tokens_per_s == pytest.approx(200 / 3)
    assert figures.ramp_tokens_per_s == pytest.approx(100.0)
    late = run_figures(
        steps=steps,
        layer_costs=_costs([(1, [0.25, 0.25]), (3, [0.25, 0.25])]),
        events=events,
        tokens_per_step=100,
        num_stages=2,
        num_microbatches=1,
        wall_s=9.0,
        steady_from_step=3,
    )
    assert late.steady_tokens_per_s == pytest.approx(100.0)  # step 3 alone
    assert late.ramp_tokens_per_s == pytest.approx(300 / 4)


def test_same_model_check() -> None:
    same = {"uniform": [3.0, 2.0], "optimal": [3.0, 2.0]}
    assert check_same_losses("moe", 0, same, 1e-6) == 0.0
    drifted = {"uniform": [3.0, 2.0], "optimal": [3.0, 2.1]}
    assert max_loss_difference(drifted) == pytest.approx(0.05)
    with pytest.raises(LossMismatchError, match="moe, repeat 1: the algorithms' losses differ"):
        check_same_losses("moe", 1, drifted, 1e-6)
    with pytest.raises(LossMismatchError, match="did not train the same steps"):
        max_loss_difference({"uniform": [3.0, 2.0], "optimal": [3.0]})


def _figures(tokens_per_s: float) -> RunFigures:
    return RunFigures(
        steps=1,
        tokens=int(tokens_per_s),
        train_s=1.0,
        wall_s=2.0,
        tokens_per_s=tokens_per_s,
        ideal_tokens_per_s=400.0,
        num_moves=0,
        num_migrations=0,
        migration_s=0.0,
        final_loss=1.0,
        losses=[1.0],
    )


def test_speedup_spread_is_pessimistic_and_optimistic() -> None:
    fast = summarize("moe", "optimal", [_figures(v) for v in (180.0, 200.0, 220.0)])
    slow = summarize("moe", "uniform", [_figures(v) for v in (110.0, 90.0, 100.0)])
    assert fast.tokens_per_s == Spread(median=200.0, low=180.0, high=220.0)
    assert fast.efficiency.median == pytest.approx(0.5)
    ratio = speedup({"optimal": fast, "uniform": slow}, "optimal", "uniform")
    assert ratio is not None
    assert ratio.median == pytest.approx(2.0)
    assert ratio.low == pytest.approx(180 / 110) and ratio.high == pytest.approx(220 / 90)
    assert speedup({"optimal": fast}, "optimal", "uniform") is None


def test_bench_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two algorithms, one repeat, 3 steps of the tiny model: the three files, same losses.
    ``megatron`` places the 4 blocks as ``uniform`` does: it reports uniform's run, no run of
    its own."""
    out = tmp_path / "bench"
    sets = [s for item in TINY if not item.startswith(("train.steps", "balance.algorithm"))
            for s in ("--set", item)]  # fmt: skip
    argv = ["bench", "--whole", "--schemes", "plain", "--algorithms", "uniform,megatron,optimal"]
    argv += ["--repeats", "1"]
    argv += ["--steps", "3", "--out", str(out), "--jobs-dir", str(ROOT / "jobs" / "stress"), *sets]
    assert main(argv) == 0
    text = (out / "results.md").read_text()
    assert f"| plain | {algorithm_label('uniform')} |" in text
    if "megatron" not in ALGORITHMS:
        assert algorithm_label("uniform") == "static uniform (Megatron-style)"
    assert "| plain | DynMo optimal |" in text
    assert "megatron = uniform (the same split: run once, reported under both names)" in text
    uniform_row, megatron_row = (
        next(line for line in text.splitlines() if line.startswith(f"| plain | {label} |"))
        for label in (algorithm_label("uniform"), algorithm_label("megatron"))
    )
    assert uniform_row.split("|")[3:] == megatron_row.split("|")[3:]
    assert "optimal / uniform" in text and "optimal / megatron" in text
    assert "| scheme | balancer | static split | ramp speedup | steady speedup | ceiling |" in text
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with h5py.File(out / "results.h5", "r") as f:
        policies = [p.decode() for p in f["runs/policy"][()]]
        assert policies == ["uniform", "optimal"]
        tokens_per_s = f["runs/tokens_per_s"][()]
        assert all(math.isfinite(v) and v > 0 for v in tokens_per_s)
        uniform, optimal = (f[f"losses/bench_plain_{p}_r0"][()] for p in ("uniform", "optimal"))
        assert len(uniform) == 3 and list(uniform) == list(optimal)
    assert "results.md" in capsys.readouterr().out


def test_bench_refuses_a_missing_jobs_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", "--schemes", "plain", "--jobs-dir", str(tmp_path), "--out", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "plain.yaml: no such job file" in err and "--jobs-dir" in err


def test_steady_table_has_ceiling_and_capture() -> None:
    """Steady speedup 1.2 against a ceiling of 1.25 over the uniform split: capture 0.8."""
    from dataclasses import replace

    from dynmo_hpc.bench.summary import render_markdown

    base = _figures(100.0)
    slow = replace(base, steady_tokens_per_s=100.0, ramp_tokens_per_s=90.0,
                   steady_ceilings={"uniform": 1.25})  # fmt: skip
    fast = replace(base, steady_tokens_per_s=120.0, ramp_tokens_per_s=90.0,
                   steady_ceilings={"uniform": 1.25})  # fmt: skip
    rows = {"moe": {"uniform": summarize("moe", "uniform", [slow]),
                    "optimal": summarize("moe", "optimal", [fast])}}  # fmt: skip
    text = render_markdown(rows, {"moe": 0.0}, command="c", setting="s")
    steady = text.split("| ramp speedup |")[1].splitlines()
    line = next(x for x in steady if x.startswith("| moe | DynMo optimal |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[2:] == [
        algorithm_label("uniform"),
        "1.00",
        "1.20 (1.20-1.20)",
        "1.25",
        "0.80",
    ]
