"""The ``megatron`` static baseline: Megatron-LM's placement of blocks, embedding and head.

Layer 0 is the embedding, the last layer the head, the rest blocks; the partitions below are
worked out by hand from the rule in :func:`dynmo_hpc.balance.static.megatron`'s docstring."""

from __future__ import annotations

import itertools
import json

import pytest

from dynmo_hpc.balance import ALGORITHMS, optimal_bottleneck, partition, stage_loads
from dynmo_hpc.bench.algorithms import algorithm_overrides
from dynmo_hpc.cli import main
from dynmo_hpc.sim.replay import replay_algorithms


def _blocks_per_stage(parts: list[int]) -> list[int]:
    """Blocks on each stage: its layers less the embedding (stage 0) and the head (last)."""
    counts = [b - a for a, b in itertools.pairwise(parts)]
    counts[0] -= 1
    counts[-1] -= 1
    return counts


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "expected", "blocks"),
    [
        # 3P+2 layers: 3 blocks on every stage (uniform gives some stages 4).
        (26, 8, [0, 4, 7, 10, 13, 16, 19, 22, 26], [3] * 8),
        (14, 4, [0, 4, 7, 10, 14], [3, 3, 3, 3]),
        # 10 blocks on 4 stages: middle 3 and 3, edges 2 and 2.
        (12, 4, [0, 3, 6, 9, 12], [2, 3, 3, 2]),
        # 7 blocks on 4 stages: middle 2 and 2, first 2, last (the head's stage) 1.
        (9, 4, [0, 3, 5, 7, 9], [2, 2, 2, 1]),
        # 26 blocks on 8 stages: middle 4 each, the two left over one per edge stage.
        (28, 8, [0, 2, 6, 10, 14, 18, 22, 26, 28], [1, 4, 4, 4, 4, 4, 4, 1]),
        # 16 blocks on 10 stages: no first/last counts fit; edges 1, middle 14 spread.
        (18, 10, [0, 2, 3, 5, 7, 9, 10, 12, 14, 16, 18], [1, 1, 2, 2, 2, 1, 2, 2, 2, 1]),
        # Fewer blocks than stages: the head alone on the last stage, then the embedding too.
        (5, 4, [0, 2, 3, 4, 5], [1, 1, 1, 0]),
        (6, 6, [0, 1, 2, 3, 4, 5, 6], [0, 1, 1, 1, 1, 0]),
        # Two stages: the first takes the odd block.
        (9, 2, [0, 5, 9], [4, 3]),
        (2, 2, [0, 1, 2], [0, 0]),
        (7, 1, [0, 7], [5]),
    ],
)
def test_exact_partitions(
    num_layers: int, num_stages: int, expected: list[int], blocks: list[int]
) -> None:
    parts = partition([1.0] * num_layers, num_stages, "megatron")
    assert parts == expected
    if num_stages > 1:
        assert _blocks_per_stage(parts) == blocks


def test_costs_do_not_move_it() -> None:
    """A static baseline: the split depends on the layer count alone."""
    assert partition([9.0, 1, 1, 1, 1, 1, 1, 0.1], 3, "megatron") == partition(
        [0.0] * 8, 3, "megatron"
    )


def test_every_stage_contiguous_non_empty_and_edges_never_heavier() -> None:
    """All layer and stage counts up to 70: contiguous non-empty stages, no stage with more than
    ceil(B/P) blocks, the edge stages with no more blocks than any middle stage."""
    for num_layers in range(1, 71):
        for num_stages in range(1, num_layers + 1):
            parts = partition([1.0] * num_layers, num_stages, "megatron")
            assert parts[0] == 0 and parts[-1] == num_layers
            assert len(parts) == num_stages + 1
            assert all(a < b for a, b in itertools.pairwise(parts)), (num_layers, parts)
            if num_stages < 3:
                continue
            blocks = _blocks_per_stage(parts)
            most = -(-(num_layers - 2) // num_stages)
            assert max(blocks) == most, (num_layers, num_stages, blocks)
            assert max(blocks[0], blocks[-1]) <= min(blocks[1:-1]), (num_layers, blocks)


@pytest.mark.parametrize("num_stages", [2, 4, 8, 16, 32, 64])
def test_plain_model_has_nothing_to_gain_over_megatron(num_stages: int) -> None:
    """The issue's observation: equal block costs on 3P blocks, an embedding and a head each
    cheaper than a block, leave the exact min-max split no better than megatron (ceiling 1.000),
    whereas uniform's 3P+2-layer spread is a baseline artefact at P >= 4."""
    costs = [0.1, *([1.0] * (3 * num_stages)), 0.6]
    best = optimal_bottleneck(costs, num_stages)
    ceiling = max(stage_loads(costs, partition(costs, num_stages, "megatron"))) / best
    assert ceiling == pytest.approx(1.0)
    uniform_ceiling = max(stage_loads(costs, partition(costs, num_stages, "uniform"))) / best
    if num_stages >= 4:
        assert uniform_ceiling > 1.1


def test_registered_as_a_static_baseline_everywhere() -> None:
    """The registry entry alone puts it in the simulator, the bench and the plan."""
    assert not ALGORITHMS["megatron"].rebalances
    assert "megatron" in replay_algorithms()
    assert algorithm_overrides("megatron", 4, [1] * 12) == [
        "balance.algorithm=static",
        "pipeline.partition=[0, 3, 6, 9, 12]",
    ]


def test_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    costs = ",".join(["0.1", *(["1"] * 24), "0.6"])
    assert main(["plan", "--costs", costs, "--stages", "8", "--algorithm", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["parts"] == [0, 4, 7, 10, 13, 16, 19, 22, 26], err


def test_simulate_cli_beside_uniform_and_optimal(capsys: pytest.CaptureFixture[str]) -> None:
    """24 equal blocks on 8 stages: megatron's step as fast as optimal's, uniform's 3 % slower."""
    costs = ",".join(["0.1", *(["1"] * 24), "0.6"])
    argv = ["simulate", "--costs", costs, "--stages", "8", "--microbatches", "16", "--json"]
    assert main([*argv, "--algorithms", "uniform,megatron,optimal"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert list(summary) == ["uniform", "megatron", "optimal"], err
    step = {name: row["step_time_s"] for name, row in summary.items()}
    assert step["megatron"] == pytest.approx(step["optimal"])
    assert step["uniform"] > 1.02 * step["megatron"]
