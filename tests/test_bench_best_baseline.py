"""The bench's static baselines: one run per distinct split, and the best one as the headline's.

``shared_splits`` runs two baselines with the same split (``megatron`` and ``uniform`` when the
blocks divide evenly) once; ``best_baseline`` picks, per scheme, phase and balancer, the static
split whose arm A ran the most tokens/s in its own A/B runs, and the headline reports the
balancer's gain over it from those same runs. Synthetic figures only: no training.
"""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import pytest

from dynmo_hpc.bench.ab import ArmComparison
from dynmo_hpc.bench.ab_summary import (
    HEADLINE_COLUMNS,
    ABRow,
    best_baseline,
    best_baselines,
    render_ab_headline,
)
from dynmo_hpc.bench.algorithms import shared_splits, static_split
from dynmo_hpc.bench.output import write_ab_results_h5
from dynmo_hpc.bench.summary import algorithm_label
from dynmo_hpc.cli.bench_ab import ab_order


def test_megatron_and_uniform_share_a_split_only_when_the_blocks_divide_evenly() -> None:
    # 16 blocks + embedding + head = 18 layers: at 2 stages both put 8 blocks on each stage
    params = [100] + [10] * 16 + [300]  # a head with a wide vocabulary
    at2 = {name: static_split(name, 2, params) for name in ("uniform", "megatron", "parameters")}
    assert at2["uniform"] == at2["megatron"] == [0, 9, 18] != at2["parameters"]
    assert shared_splits(at2) == {
        "uniform": "uniform",
        "megatron": "uniform",
        "parameters": "parameters",
    }
    # at 4 stages uniform gives the first stage the embedding and 3 blocks, megatron 4 blocks
    at4 = {name: static_split(name, 4, params) for name in ("uniform", "megatron")}
    assert at4["uniform"] != at4["megatron"]
    assert shared_splits(at4) == {"uniform": "uniform", "megatron": "megatron"}
    # the first name in order runs; a later one with its split reports its runs
    assert shared_splits({"megatron": [0, 2, 4], "uniform": [0, 2, 4]}) == {
        "megatron": "megatron",
        "uniform": "megatron",
    }


def test_a_shared_split_gets_no_runs_of_its_own() -> None:
    runs_of = {"plain": {"uniform": "uniform", "megatron": "uniform", "parameters": "parameters"}}
    algorithms = ["uniform", "megatron", "parameters", "optimal"]
    order = ab_order(["plain", "pruning"], algorithms, 2, runs_of)
    plain = [(p.static, p.balancer) for p in order if p.scheme == "plain"]
    # two pairs per repeat on plain (rotated in the second), three on pruning (no sharing known)
    assert plain == [("uniform", "optimal"), ("parameters", "optimal")] * 1 + [
        ("parameters", "optimal"),
        ("uniform", "optimal"),
    ]
    assert sum(p.scheme == "pruning" for p in order) == 6
    assert all(p.static != "megatron" for p in order if p.scheme == "plain")


def _row(
    static: str,
    static_s: float | None,
    gains: list[float] | None = None,
    *,
    balancer: str = "optimal",
    phase: str = "steady",
    ceiling: float | None = 1.5,
    runs_of: str = "",
) -> ABRow:
    comparison = None
    if static_s is not None:
        comparison = ArmComparison(
            static_step_s=static_s,
            dynmo_step_s=static_s / 1.2,
            block_gains=gains or [1.1, 1.2, 1.3],
            kept=(8, 8),
            total=(10, 10),
        )
    return ABRow(
        scheme="pruning",
        static=static,
        balancer=balancer,
        phase=phase,
        steps=(25, 120) if phase == "steady" else (8, 25),
        repeats=1,
        comparison=comparison,
        ceiling=ceiling,
        tokens_per_step=1000,
        runs_of=runs_of,
    )


def test_the_best_of_three_static_splits_is_the_one_the_balancer_gains_least_over() -> None:
    rows = [
        _row("uniform", 0.5, [1.3, 1.4, 1.5], ceiling=1.6),  # 2000 tokens/s
        _row("megatron", 0.4, [1.2, 1.25, 1.3], ceiling=1.4),  # 2500 tokens/s
        _row("parameters", 0.8, [1.9, 2.0, 2.1], ceiling=2.2),  # 1250 tokens/s
    ]
    best = best_baseline(rows)
    assert best is not None
    assert best.static == "megatron" and best.tied == () and best.names == ("megatron",)
    assert best.row is rows[1]
    assert best.row.comparison is not None and best.row.comparison.gain == pytest.approx(1.25)
    assert best.row.ceiling == 1.4
    assert best.static_tokens_per_s == {
        "uniform": pytest.approx(2000),
        "megatron": pytest.approx(2500),
        "parameters": pytest.approx(1250),
    }


def test_the_gain_within_its_own_runs_decides_not_the_tokens_per_s_of_other_minutes() -> None:
    # megatron's arm ran faster, in runs that met faster minutes; the balancer gains less over
    # uniform within uniform's own runs, so uniform is the baseline that is hardest to beat.
    rows = [_row("uniform", 0.5, [1.05, 1.1, 1.15]), _row("megatron", 0.4, [1.2, 1.25, 1.3])]
    best = best_baseline(rows)
    assert best is not None and best.static == "uniform" and best.tied == ()


def test_a_shared_split_ties_and_names_both() -> None:
    # megatron reports uniform's runs (the same split): the same tokens/s and the same gain
    shared = [_row("uniform", 0.5), _row("megatron", 0.5, runs_of="uniform"), _row("parameters", 1)]
    best = best_baseline(shared)
    assert best is not None and best.names == ("uniform", "megatron")
    # the same tokens/s but different gains: not a tie, the lower gain wins
    rows = [_row("uniform", 0.5, [1.3]), _row("parameters", 0.5, [1.1])]
    best = best_baseline(rows)
    assert best is not None and best.names == ("parameters",)
    assert best.row.comparison is not None and best.row.comparison.gain == pytest.approx(1.1)


def test_a_baseline_without_a_comparison_in_a_phase_takes_no_part() -> None:
    rows = [
        _row("uniform", 0.5, phase="ramp"),
        _row("parameters", None, phase="ramp"),  # no pair of blocks in the ramp
        _row("uniform", 0.5),
        _row("parameters", 0.25, [1.0, 1.05, 1.1]),
    ]
    ramp, steady = best_baselines(rows).values()
    assert ramp is not None and ramp.static == "uniform"
    assert ramp.static_tokens_per_s == {"uniform": pytest.approx(2000), "parameters": None}
    assert steady is not None and steady.static == "parameters"
    assert best_baseline([_row("uniform", None), _row("parameters", None)]) is None
    with pytest.raises(ValueError, match="one scheme, phase and balancer"):
        best_baseline([_row("uniform", 0.5), _row("uniform", 0.5, balancer="diffusion")])
    with pytest.raises(ValueError, match="name twice"):
        best_baseline([_row("uniform", 0.5), _row("uniform", 0.4)])


def test_headline_names_the_best_baseline_and_reports_the_gain_over_it() -> None:
    rows = [
        _row("uniform", 0.5, [1.3, 1.4, 1.5], ceiling=1.6),
        _row("uniform", 0.5, [1.0, 1.1, 1.2], balancer="diffusion"),
        _row("megatron", 0.5, [1.3, 1.4, 1.5], ceiling=1.6, runs_of="uniform"),
        _row("megatron", 0.5, [1.0, 1.1, 1.2], balancer="diffusion", runs_of="uniform"),
        _row("parameters", 0.4, [1.2, 1.25, 1.3], ceiling=1.5),
        _row("parameters", None, balancer="diffusion"),
        _row("uniform", None, phase="ramp"),
        _row("megatron", None, phase="ramp", runs_of="uniform"),
        _row("parameters", None, phase="ramp"),
    ]
    lines = render_ab_headline(rows)
    header = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert header == [
        *HEADLINE_COLUMNS,
        "uniform tokens/s",
        "megatron tokens/s",
        "parameters tokens/s",
    ]
    body = [line for line in lines if line.startswith("| pruning |")]
    assert body == [
        "| pruning | ramp 8-24 | DynMo optimal | no static baseline with a comparison in this "
        "phase | - | - | - | - | - | - | - | - |",
        "| pruning | steady 25-119 | DynMo optimal | parameters | 2500 | 3000 | "
        "1.25x (1.23-1.27) | 1.50 | 0.50 | 2000 | 2000 | 2500 |",
        "| pruning | steady 25-119 | DynMo diffusion | uniform = megatron | 2000 | 2400 | "
        "1.10x (1.05-1.15) | 1.50 | 0.20 | 2000 | 2000 | - |",
    ]
    legend = lines[-2]
    assert legend.startswith("Static baselines: uniform = ")
    assert f"megatron = {algorithm_label('megatron')}" in legend
    assert algorithm_label("megatron") == "Megatron-LM (even blocks)"
    assert algorithm_label("uniform") == "Megatron-LM, embedding and loss counted as layers"


def test_results_h5_carries_the_best_baseline_per_headline_line(tmp_path: Path) -> None:
    rows = [
        _row("uniform", 0.5, [1.3, 1.4, 1.5], ceiling=1.6),
        _row("megatron", 0.5, [1.3, 1.4, 1.5], ceiling=1.6, runs_of="uniform"),
        _row("parameters", 0.4, [1.2, 1.25, 1.3], ceiling=1.5),
        _row("uniform", None, phase="ramp"),
        _row("megatron", None, phase="ramp", runs_of="uniform"),
        _row("parameters", None, phase="ramp"),
    ]
    path = tmp_path / "results.h5"
    write_ab_results_h5(path, [], rows, {"mode": "ab"})
    with h5py.File(path, "r") as f:
        assert [v.decode() for v in f["rows/runs_of"][()]] == ["", "uniform", ""] * 2
        best = f["best"]
        assert [v.decode() for v in best["phase"][()]] == ["ramp", "steady"]
        assert [v.decode() for v in best["static"][()]] == ["", "parameters"]
        assert [v.decode() for v in best["tied"][()]] == ["", ""]
        assert best["first_step"][()].tolist() == [8, 25]
        assert best["end_step"][()].tolist() == [25, 120]
        assert math.isnan(best["gain"][0]) and best["gain"][1] == pytest.approx(1.25)
        assert best["gain_q25"][1] == pytest.approx(1.225)
        assert best["ceiling"][1] == pytest.approx(1.5)
        assert best["capture"][1] == pytest.approx(0.5)
        assert best["static_tokens_per_s"][1] == pytest.approx(2500)
        assert best["dynmo_tokens_per_s"][1] == pytest.approx(3000)
        speeds = best["tokens_per_s"]
        assert sorted(speeds) == ["megatron", "parameters", "uniform"]
        assert speeds["uniform"][1] == pytest.approx(2000) == speeds["megatron"][1]
        assert all(math.isnan(speeds[name][0]) for name in speeds)
