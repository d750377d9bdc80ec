"""The algorithm registry is the only seam: an algorithm registered in ``balance.ALGORITHMS``
alone is accepted by the config, decided with by the trainer's rule, planned by ``dynmo-hpc
plan``, replayed by ``dynmo-hpc simulate`` and run by the bench, with no other edit."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from dynmo_hpc.balance import ALGORITHMS, Algorithm, algorithm_options, partition
from dynmo_hpc.balance.common import CostsLike, check_num_stages, check_values
from dynmo_hpc.bench.algorithms import algorithm_overrides
from dynmo_hpc.cli import main
from dynmo_hpc.config import BalanceSection
from dynmo_hpc.config.loader import from_dict
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.pipeline.costs import LayerSize, LoadReport
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, replay, replay_algorithms
from dynmo_hpc.train.rebalance import decide

TOY = "front-loaded"


def front_loaded(costs: CostsLike, num_stages: int) -> list[int]:
    """A fixed split: one layer on each stage but the last, which runs the rest."""
    num_layers = len(check_values(costs))
    num_stages = check_num_stages(num_stages, num_layers)
    return [*range(num_stages), num_layers]


def no_capacity(settings: Mapping[str, Any]) -> None:
    if settings.get("capacity_bytes") is not None:
        raise ValueError(
            f"balance.algorithm={TOY} ignores balance.capacity_bytes="
            f"{settings['capacity_bytes']}; HINT: set it to null"
        )


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the toy algorithm for one test: one registry entry, nothing else."""
    entry = Algorithm(function=front_loaded, label="toy front-loaded", check_settings=no_capacity)
    monkeypatch.setitem(ALGORITHMS, TOY, entry)


def _report(num_layers: int) -> LoadReport:
    return LoadReport(
        step=0,
        forward_s=[0.0] * num_layers,
        backward_s=[0.0] * num_layers,
        sizes=[LayerSize(10, 1000, 0, 0)] * num_layers,
        peak_mem_bytes=[],
    )


def test_partition_and_options_come_from_the_entry(toy: None) -> None:
    assert partition([1.0] * 5, 3, TOY) == [0, 1, 2, 5]
    assert algorithm_options(TOY) == []
    with pytest.raises(ValueError, match="does not take option"):
        partition([1.0] * 5, 3, TOY, current=[0, 2, 5])


def test_config_accepts_it_and_runs_its_own_check(toy: None) -> None:
    cfg = from_dict({"balance": {"algorithm": TOY}}, "job.yaml")
    assert cfg.balance.algorithm == TOY
    with pytest.raises(ConfigError, match=f"balance.algorithm={TOY} ignores"):
        BalanceSection(algorithm=TOY, capacity_bytes=1e9).validate()
    with pytest.raises(ConfigError, match=r"choose one of \['static', .*'front-loaded'\]"):
        BalanceSection(algorithm="reverse").validate()


def test_unregistered_it_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=f"balance.algorithm='{TOY}' is not valid"):
        from_dict({"balance": {"algorithm": TOY}}, "job.yaml")


def test_the_trainer_decision_proposes_and_judges_it(toy: None) -> None:
    """Costs that make the toy split the best: it is enacted when it pays, with its name."""
    costs = [4.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    plan = decide(
        BalanceSection(algorithm=TOY),
        _report(len(costs)),
        costs_s=costs,
        parts=[0, 2, 4, 6],
        bandwidth_bytes_per_s=1e12,
        report_index=0,
        steps_left=100,
    )
    assert plan.enact and plan.parts_to_enact == [0, 1, 2, 6]
    assert plan.algorithm == TOY and plan.predicted_gain_s > 0


def test_plan_cli_accepts_it(toy: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--costs", "4,4,1,1,1,1", "--stages", "3", "--algorithm", TOY])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    assert result["algorithm"] == TOY and result["parts"] == [0, 1, 2, 6]


def test_simulate_replays_it(toy: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A rebalancing algorithm starts from the trainer's uniform split and migrates once."""
    assert TOY in replay_algorithms()
    costs = [4.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    report = CostReport(
        forward_s=[c / 3 for c in costs],
        backward_s=[2 * c / 3 for c in costs],
        num_params=[1] * 6,
        layer_bytes=[0] * 6,
    )
    result = replay([report], ReplaySetup(num_stages=3, num_microbatches=4, num_steps=20), TOY)
    assert result.algorithm == TOY and result.migrations == 1
    assert result.final_parts == [0, 1, 2, 6]
    argv = ["simulate", "--costs", "4,4,1,1,1,1", "--stages", "3", "--microbatches", "4"]
    rc = main([*argv, "--algorithms", f"uniform,{TOY}", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads(out)
    assert list(summary) == ["uniform", TOY]
    assert summary[TOY]["step_time_s"] < summary["uniform"]["step_time_s"]


def test_bench_runs_it(toy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rebalancing: the trainer's default start and the algorithm. A static baseline: its split,
    never moved."""
    assert algorithm_overrides(TOY, 3, [1] * 6) == [
        f"balance.algorithm={TOY}",
        "pipeline.partition=null",
    ]
    baseline = Algorithm(function=front_loaded, label="toy baseline", rebalances=False)
    monkeypatch.setitem(ALGORITHMS, "front-baseline", baseline)
    assert algorithm_overrides("front-baseline", 3, [1] * 6) == [
        "balance.algorithm=static",
        "pipeline.partition=[0, 1, 2, 6]",
    ]


def test_the_default_algorithm_lists_come_from_the_registry(toy: None) -> None:
    """``dynmo-hpc bench`` asks the registry for its default algorithms: a newly registered one
    is in it; one marked ``benched=False`` is left out."""
    from dynmo_hpc.balance.registry import bench_algorithms
    from dynmo_hpc.cli import build_parser

    assert TOY in bench_algorithms() and "megatron" in bench_algorithms()
    bench = build_parser().parse_args(["bench"])
    assert bench.algorithms == list(bench_algorithms())
    ALGORITHMS[TOY] = Algorithm(function=front_loaded, label="toy", benched=False)
    assert TOY not in bench_algorithms()
