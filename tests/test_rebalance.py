"""Rank 0's decision glue and the cost smoothing, as pure functions."""

from __future__ import annotations

import itertools

import pytest

from dynmo_hpc.config import BalanceSection
from dynmo_hpc.pipeline.costs import CostTracker, IntervalAccumulator
from dynmo_hpc.pipeline.rebalance import decide, forced_partition


def test_interval_accumulator_means_per_layer_steps():
    acc = IntervalAccumulator()
    acc.add({0: 1.0, 1: 2.0}, {0: 2.0, 1: 4.0})
    acc.add({0: 3.0}, {0: 4.0})  # layer 1 migrated away after one step
    fwd, bwd = acc.mean_per_step()
    assert fwd == {0: 2.0, 1: 2.0} and bwd == {0: 3.0, 1: 4.0}
    assert acc.mean_per_step() == ({}, {})


def test_cost_tracker_smooths_by_global_layer():
    tracker = CostTracker(num_layers=2, smoothing=0.5)
    assert tracker.update([1.0, 1.0], [1.0, 1.0]) == [2.0, 2.0]
    assert tracker.update([3.0, 1.0], [3.0, 1.0]) == [4.0, 2.0]
    with pytest.raises(ValueError, match="all 2 layers"):
        tracker.update([1.0], [1.0])


@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_forced_partition_always_valid_and_different(num_stages):
    parts = [0, *range(2, 2 * num_stages, 2), 2 * num_stages]
    for report in range(12):
        new = forced_partition(parts, report)
        assert new != parts and new[0] == 0 and new[-1] == parts[-1]
        assert all(b > a for a, b in itertools.pairwise(new))
        parts = new


def kwargs(costs, parts, bandwidth=1e12):
    return {
        "costs_s": costs,
        "num_params": [10] * len(costs),
        "layer_bytes": [1000] * len(costs),
        "parts": parts,
        "bandwidth_bytes_per_s": bandwidth,
        "report_index": 0,
    }


def test_decide_moves_when_it_pays_and_keeps_balanced_input():
    costs = [1.0, 1.0, 1.0, 5.0]
    plan = decide(BalanceSection(algorithm="optimal"), **kwargs(costs, [0, 2, 4]))
    assert plan.parts_to_enact == [0, 3, 4] and plan.enact
    assert plan.new_bottleneck_s < plan.old_bottleneck_s
    balanced = decide(BalanceSection(algorithm="optimal"), **kwargs([1.0] * 4, [0, 2, 4]))
    assert balanced.parts_to_enact is None


def test_decide_refuses_when_migration_costs_more_than_it_gains():
    costs = [1.0, 1.0, 1.0, 1.1]
    slow_link = decide(
        BalanceSection(algorithm="optimal", interval=1), **kwargs(costs, [0, 1, 4], bandwidth=1.0)
    )
    assert slow_link.parts_to_enact is None and "keep" in slow_link.reason


def test_static_never_plans():
    plan = decide(BalanceSection(algorithm="static"), **kwargs([1.0, 9.0], [0, 1, 2]))
    assert plan.parts_to_enact is None


@pytest.mark.parametrize("algorithm", ["uniform", "parameters", "optimal", "diffusion"])
def test_one_stage_never_plans_even_with_no_measured_bandwidth(algorithm):
    """P = 1 has no link to measure (bandwidth inf): the decision says so instead of raising."""
    plan = decide(
        BalanceSection(algorithm=algorithm), **kwargs([1.0, 9.0], [0, 2], bandwidth=float("inf"))
    )
    assert plan.parts_to_enact is None and "one stage" in plan.reason
