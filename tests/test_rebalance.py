"""Rank 0's decision glue and the cost smoothing, as pure functions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dynmo_hpc.balance import (
    bottleneck,
    diffusion,
    diffusion_step,
    diffusion_trace,
    optimal,
    plan_moves,
)
from dynmo_hpc.config import BalanceSection
from dynmo_hpc.pipeline.costs import CostTracker, IntervalAccumulator, LayerSize, LoadReport
from dynmo_hpc.train.rebalance import decide, forced_partition


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


def report_of(num_layers, layer_bytes=None):
    """A load report as the trainer assembles it: 10 parameters and 1000 bytes per layer."""
    bytes_each = layer_bytes or [1000] * num_layers
    return LoadReport(
        step=0,
        forward_s=[0.0] * num_layers,
        backward_s=[0.0] * num_layers,
        sizes=[LayerSize(10, b, 0, 0) for b in bytes_each],
        peak_mem_bytes=[],
    )


def kwargs(costs, parts, bandwidth=1e12, steps_left=100, report_index=0):
    return {
        "report": report_of(len(costs)),
        "costs_s": costs,
        "parts": parts,
        "bandwidth_bytes_per_s": bandwidth,
        "report_index": report_index,
        "steps_left": steps_left,
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


def test_gain_counts_only_the_steps_the_new_partition_will_run():
    """Interval 100, but training ends sooner: the gain accrues only over the steps left.

    [0,2,4] -> [0,3,4] saves 1 s/step (bottleneck 6 -> 5); one 1000-byte layer at 1000 B/s costs
    1 s (its sender's and its receiver's bytes), so it pays from 2 steps on, not after 1.
    """
    costs = [1.0, 1.0, 1.0, 5.0]
    section = BalanceSection(algorithm="optimal", interval=100)
    one_left = decide(section, **kwargs(costs, [0, 2, 4], bandwidth=1000.0, steps_left=1))
    assert one_left.parts_to_enact is None and "over 1 steps" in one_left.reason
    assert one_left.predicted_gain_s == 1.0 and one_left.predicted_migration_s == 1.0
    two_left = decide(section, **kwargs(costs, [0, 2, 4], bandwidth=1000.0, steps_left=2))
    assert two_left.parts_to_enact == [0, 3, 4] and two_left.predicted_gain_s == 2.0
    # Many steps left: the next check (the interval) bounds the gain.
    many = decide(section, **kwargs(costs, [0, 2, 4], bandwidth=1000.0, steps_left=10**6))
    assert many.predicted_gain_s == 100.0


@pytest.mark.parametrize("algorithm", ["optimal", "diffusion", "parameters"])
@pytest.mark.parametrize("force_moves", [False, True])
def test_no_migration_after_the_last_step(algorithm, force_moves):
    section = BalanceSection(algorithm=algorithm, force_moves=force_moves)
    plan = decide(section, **kwargs([1.0, 1.0, 1.0, 9.0], [0, 2, 4], steps_left=0))
    assert plan.parts_to_enact is None and "no steps left" in plan.reason


def diffusion_kwargs(costs, parts, report_index, layer_bytes=None, steps_left=10**4):
    args = kwargs(costs, parts, steps_left=steps_left, report_index=report_index)
    if layer_bytes is not None:
        args["report"] = report_of(len(costs), layer_bytes)
    return args


def test_diffusion_decision_moves_every_layer_at_most_one_stage():
    """From [0,1,2,10] diffusion's fixed point [0,3,6,10] takes layer 2 from stage 2 to stage 0;
    a decision enacts one phase of it: pair (0,1) cannot gain, so pair (1,2) re-splits."""
    costs, start = [1.0] * 10, [0, 1, 2, 10]
    assert diffusion(costs, 3, current=start) == [0, 3, 6, 10]
    plan = decide(BalanceSection(algorithm="diffusion"), **diffusion_kwargs(costs, start, 0))
    assert plan.enact and plan.algorithm == "diffusion"
    assert plan.parts_to_enact == diffusion_step(costs, start, phase=1) == [0, 1, 5, 10]
    assert all(abs(m.src - m.dst) == 1 for m in plan_moves(start, plan.new_parts))


def random_cases(seed, count=60):
    """Lognormal costs on 4-39 layers and a valid start partition on 2-8 stages."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(4, 40))
        num_stages = int(rng.integers(2, min(n, 8) + 1))
        costs = rng.lognormal(0.0, 1.0, n).tolist()
        yield costs, optimal(rng.random(n).tolist(), num_stages), num_stages


def test_diffusion_decisions_are_neighbour_phases_of_alternating_parity():
    section = BalanceSection(algorithm="diffusion")
    for trial, (costs, parts, _) in enumerate(random_cases(11)):
        report = trial % 2
        plan = decide(section, **diffusion_kwargs(costs, parts, report))
        if not plan.enact:
            continue
        first = diffusion_step(costs, parts, phase=report)
        expected = first if first != parts else diffusion_step(costs, parts, phase=1 - report)
        assert plan.new_parts == expected
        assert all(abs(m.src - m.dst) == 1 for m in plan_moves(parts, plan.new_parts))


def test_diffusion_decision_respects_the_capacity():
    """Stage 0 could take layer 3 (loads 3, 6 -> 4, 5) but would then hold 13 bytes > 12."""
    costs, memory, start = [1.0, 1.0, 1.0, 1.0, 1.0, 4.0], [1, 1, 1, 10, 1, 1], [0, 3, 6]
    free = decide(
        BalanceSection(algorithm="diffusion"), **diffusion_kwargs(costs, start, 0, memory)
    )
    assert free.parts_to_enact == [0, 4, 6]
    capped = BalanceSection(algorithm="diffusion", capacity_bytes=12)
    plan = decide(capped, **diffusion_kwargs(costs, start, 0, memory))
    assert plan.parts_to_enact is None
    over = decide(capped, **diffusion_kwargs(costs, [0, 4, 6], 0, memory))
    assert over.parts_to_enact is None and "stage 0 holds 13 bytes" in over.reason


def walk(costs, start, section, steps_left=10**4, reports=40):
    """Decide at reports 0, 1, 2, ..., enacting what each decision enacts."""
    parts, visited = list(start), [list(start)]
    for report in range(reports):
        plan = decide(section, **diffusion_kwargs(costs, parts, report, steps_left=steps_left))
        if plan.enact:
            parts = plan.new_parts
            visited.append(parts)
    return visited


def test_repeated_diffusion_decisions_reach_the_fixed_point():
    """Loads (4, 1, 4): relieving either heavy stage alone leaves the other at the old pace, so
    the first phase gains nothing by itself; it is enacted for the second, which does."""
    costs, start = [1.0] * 9, [0, 4, 5, 9]
    section = BalanceSection(algorithm="diffusion")
    first = decide(section, **diffusion_kwargs(costs, start, 0))
    assert first.enact and first.new_bottleneck_s == first.old_bottleneck_s == 4.0
    assert first.judged_hops == 2 and first.predicted_gain_s == 5.0  # 1 s/step for 5 steps
    assert walk(costs, start, section) == diffusion_trace(costs, 3, current=start)
    assert walk(costs, start, section)[-1] == diffusion(costs, 3, current=start) == [0, 3, 6, 9]


def test_repeated_diffusion_decisions_walk_the_trace_to_its_bottleneck():
    section = BalanceSection(algorithm="diffusion")
    for costs, start, num_stages in random_cases(12):
        trace = diffusion_trace(costs, num_stages, current=start)
        visited = walk(costs, start, section, reports=len(trace) + 4)
        assert visited == trace[: len(visited)]  # one phase per decision, in the trace's order
        # It stops only where the rest of the trace would not lower the bottleneck.
        assert bottleneck(costs, visited[-1]) == bottleneck(costs, trace[-1])
