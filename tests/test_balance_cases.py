"""Exact cases for the balancers: DeepSpeed's unit-test cases, the reference code's defects,
input validation, the migration planner and the decision rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynmo_hpc.balance import (
    ALGORITHMS,
    Decision,
    Move,
    algorithm_options,
    bottleneck,
    min_capacity,
    optimal,
    partition,
    plan_moves,
    rank_bytes,
    should_follow,
    should_rebalance,
    stage_loads,
)

# --- DeepSpeed's unit-test cases (facts about its partitioner; see docs/balancing.md) ------


def test_eight_equal_layers_on_four_stages_cost_two_each() -> None:
    parts = partition([1] * 8, 4)
    assert stage_loads([1] * 8, parts) == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("costs", "num_stages", "expected"),
    [
        ([0, 1, 2, 3, 3, 3], 4, [0, 3, 4, 5, 6]),
        ([0, 1.1, 30, 3], 3, [0, 2, 3, 4]),
        ([0, 1.1, 1.9, 3, 30], 2, [0, 4, 5]),
    ],
)
def test_deepspeed_cases(costs: list[float], num_stages: int, expected: list[int]) -> None:
    assert partition(costs, num_stages) == expected
    assert partition(costs, num_stages, "optimal") == expected


def test_two_layers_on_four_stages_is_a_clear_error_not_a_hang() -> None:
    for algorithm in ALGORITHMS:
        options = {"params": [1, 1]} if algorithm == "parameters" else {}
        with pytest.raises(ValueError, match=r"num_stages=4 > number of layers=2.*at most 2"):
            partition([1, 1], 4, algorithm, **options)


def test_five_equal_layers_on_four_stages_leave_no_stage_empty() -> None:
    """Old DeepSpeed returned [0, 2, 4, 5, 5] (an empty stage)."""
    parts = partition([1] * 5, 4)
    assert parts == [0, 2, 3, 4, 5]
    assert max(stage_loads([1] * 5, parts)) == 2.0


# --- every algorithm: shape, order, errors ------------------------------------------------------


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("num_stages", [1, 2, 3, 7])
def test_every_algorithm_returns_contiguous_non_empty_stages(
    algorithm: str, num_stages: int
) -> None:
    costs = [0.5, 0.0, 3.0, 1.0, 0.0, 0.0, 2.0, 9.0]
    options = {"params": [1, 2, 3, 4, 5, 6, 7, 8]} if algorithm == "parameters" else {}
    parts = partition(costs, num_stages, algorithm, **options)
    assert len(parts) == num_stages + 1 and parts[0] == 0 and parts[-1] == len(costs)
    assert all(parts[p] < parts[p + 1] for p in range(num_stages))
    assert all(isinstance(b, int) for b in parts)


def test_all_zero_costs_still_partition() -> None:
    for algorithm in ("uniform", "optimal", "diffusion"):
        parts = partition([0.0] * 6, 3, algorithm)
        assert len(parts) == 4 and all(parts[p] < parts[p + 1] for p in range(3))
    assert optimal([0.0] * 6, 3, current=[0, 1, 2, 6]) == [0, 1, 2, 6]


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        ([1.0, -1.0], r"costs\[1\]=-1.0 is invalid.*>= 0"),
        ([1.0, math.nan], r"costs\[1\]=nan is invalid.*finite"),
        ([math.inf, 1.0], r"costs\[0\]=inf is invalid"),
        ([], r"costs is empty"),
        ([1e308, 1e308], r"overflows"),
    ],
)
def test_bad_costs_are_rejected(costs: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(costs, 1)


def test_unknown_algorithm_and_options_list_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match="valid algorithms: uniform, megatron, parameters, profiled, optimal"
    ):
        partition([1, 2], 1, "greedy")
    with pytest.raises(
        ValueError, match=r"does not take option\(s\) capacity; valid options: none"
    ):
        partition([1, 2], 1, "uniform", capacity=3)
    assert algorithm_options("optimal") == ["current", "memory", "capacity", "rel_tol"]


def test_num_stages_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match="num_stages=0 must be >= 1"):
        partition([1, 2], 0)
    with pytest.raises(ValueError, match="must be an int"):
        partition([1, 2], 1.5)  # type: ignore[arg-type]


def test_numpy_costs_are_accepted() -> None:
    num_stages: int = np.int64(4)  # type: ignore[assignment]
    for algorithm in ("uniform", "optimal", "diffusion"):
        parts = partition(np.array([0, 1, 2, 3, 3, 3]), num_stages, algorithm)
        assert all(type(b) is int for b in parts), parts
    assert partition(np.array([0, 1, 2, 3, 3, 3]), num_stages) == [0, 3, 4, 5, 6]


# --- static baselines -----------------------------------------------------------------------------


def test_uniform_spreads_the_remainder_and_ignores_costs() -> None:
    assert partition([1.0] * 10, 4, "uniform") == [0, 2, 5, 7, 10]
    assert partition([100.0, 1, 1, 1], 2, "uniform") == [0, 2, 4]


def test_parameters_balances_counts_not_time() -> None:
    costs = [5.0, 1.0, 1.0, 1.0]  # layer 0 is slow but small
    assert partition(costs, 2, "parameters", params=[10, 10, 10, 30]) == [0, 3, 4]
    with pytest.raises(ValueError, match="params has 3 entries but costs has 4"):
        partition(costs, 2, "parameters", params=[1, 2, 3])


# --- current partition: balanced input never moves (reference defect 2) ------------------------


def test_optimal_current_is_returned_unchanged() -> None:
    costs = [1.0, 1.0, 1.0, 1.0, 5.0, 1.0]
    # Bottleneck 5 is forced by layer 4; many partitions reach it; keep the one in use.
    for current in ([0, 1, 4, 5, 6], [0, 2, 4, 5, 6], [0, 3, 4, 5, 6]):
        assert optimal(costs, 4, current=current) == current
        assert partition(costs, 4, "diffusion", current=current) == current


def test_non_optimal_current_moves_to_the_nearest_optimal_boundaries() -> None:
    costs = [1.0] * 8
    assert optimal(costs, 4, current=[0, 1, 2, 3, 8]) == [0, 2, 4, 6, 8]
    # Costs changed after balancing: only the boundary next to the change moves.
    costs = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2]
    assert optimal(costs, 4, current=[0, 2, 4, 6, 8]) == [0, 2, 4, 6, 8]
    costs = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # layer 0 got 3x slower
    new = optimal(costs, 4, current=[0, 2, 4, 6, 8])
    assert new == [0, 1, 4, 6, 8] and bottleneck(costs, new) == 3.0
    assert plan_moves([0, 2, 4, 6, 8], new) == [Move(1, 0, 1)]


def test_current_must_match_the_problem() -> None:
    with pytest.raises(ValueError, match=r"current=\[0, 2, 4\] has 2 stages but num_stages=3"):
        optimal([1] * 4, 3, current=[0, 2, 4])
    with pytest.raises(ValueError, match="stage 1 is empty"):
        optimal([1] * 4, 3, current=[0, 2, 2, 4])
    with pytest.raises(ValueError, match="must start at 0 and end at the number of layers"):
        optimal([1] * 4, 2, current=[0, 2, 5])


# --- memory capacity ------------------------------------------------------------------------------


def test_capacity_constrains_the_optimum() -> None:
    costs = [1.0, 1.0, 1.0, 1.0]
    memory = [1.0, 1.0, 1.0, 3.0]
    assert optimal(costs, 2) == [0, 2, 4]  # memory 2 + 4 = 4 on stage 1
    parts = optimal(costs, 2, memory=memory, capacity=3.0)
    assert parts == [0, 3, 4] and max(stage_loads(memory, parts)) <= 3.0


def test_infeasible_capacity_names_the_minimum_needed() -> None:
    with pytest.raises(ValueError, match=r"capacity=2 bytes.*need at least 3 bytes per stage"):
        optimal([1.0] * 4, 2, memory=[1.0, 1.0, 1.0, 3.0], capacity=2.0)
    assert min_capacity([1.0, 1.0, 1.0, 3.0], 2) == 3.0
    with pytest.raises(ValueError, match="must be given together"):
        optimal([1.0] * 4, 2, capacity=2.0)


def test_current_over_capacity_is_repaired() -> None:
    memory = [1.0, 1.0, 1.0, 3.0]
    parts = optimal([1.0] * 4, 2, current=[0, 2, 4], memory=memory, capacity=3.0)
    assert parts == [0, 3, 4]


# --- migration planner --------------------------------------------------------------------------


def test_plan_moves_lists_layers_in_order_with_src_and_dst() -> None:
    assert plan_moves([0, 2, 4], [0, 3, 4]) == [Move(layer=2, src=1, dst=0)]
    assert plan_moves([0, 2, 4, 6], [0, 2, 4, 6]) == []
    assert plan_moves([0, 1, 2, 6], [0, 4, 5, 6]) == [
        Move(1, 1, 0),
        Move(2, 2, 0),
        Move(3, 2, 0),
        Move(4, 2, 1),
    ]


def test_plan_moves_supports_packing_onto_fewer_stages() -> None:
    assert plan_moves([0, 1, 2, 3], [0, 2, 3]) == [Move(1, 1, 0), Move(2, 2, 1)]
    with pytest.raises(ValueError, match="covers 4 layers but new_parts covers 5"):
        plan_moves([0, 2, 4], [0, 2, 5])


def test_move_is_frozen() -> None:
    move = Move(1, 0, 1)
    with pytest.raises(AttributeError):
        move.layer = 2  # type: ignore[misc]


def test_plan_moves_matches_a_per_layer_owner_map() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 30))
        old = [0, *sorted(rng.choice(np.arange(1, n), int(rng.integers(0, n - 1)), False)), n]
        new = [0, *sorted(rng.choice(np.arange(1, n), int(rng.integers(0, n - 1)), False)), n]
        owner_old = np.searchsorted(old, np.arange(n), side="right") - 1
        owner_new = np.searchsorted(new, np.arange(n), side="right") - 1
        expected = [
            Move(i, int(owner_old[i]), int(owner_new[i]))
            for i in range(n)
            if owner_old[i] != owner_new[i]
        ]
        assert plan_moves([int(b) for b in old], [int(b) for b in new]) == expected


# --- decision rule --------------------------------------------------------------------------------


def test_decision_enacts_when_gain_beats_migration_by_the_margin() -> None:
    costs = [1.0, 1.0, 1.0, 3.0]
    old, new = [0, 1, 4], [0, 3, 4]  # bottleneck 5 s/step -> 3 s/step
    decision = should_rebalance(costs, old, new, 1e9, 10e9, steps_until_next_check=100)
    assert isinstance(decision, Decision)
    assert decision.predicted_gain_s == pytest.approx(200.0)
    # Two layers go 1 -> 0: the busiest rank sends 2 GB at 10 GB/s.
    assert decision.predicted_migration_s == pytest.approx(0.2)
    assert decision.enact and decision.reason.startswith("enact")
    assert decision.num_moves == 2 and decision.bytes_moved == 2e9


def test_decision_keeps_when_the_interval_is_too_short() -> None:
    costs = [1.0, 1.0, 1.0, 3.0]
    decision = should_rebalance(costs, [0, 1, 4], [0, 3, 4], 1e9, 1e9, 1, margin=0.1)
    assert decision.predicted_gain_s == pytest.approx(2.0)
    assert decision.predicted_migration_s == pytest.approx(2.0)
    assert not decision.enact and decision.reason.startswith("keep")
    # Without margin it would still not enact: the gain must *exceed* the cost.
    assert not should_rebalance(costs, [0, 1, 4], [0, 3, 4], 1e9, 1e9, 1, margin=0).enact


def test_decision_never_enacts_without_change_or_gain() -> None:
    costs = [1.0, 1.0, 1.0, 1.0]
    same = should_rebalance(costs, [0, 2, 4], [0, 2, 4], 1e9, 1e9, 1000)
    assert not same.enact and same.reason.startswith("no change")
    worse = should_rebalance(costs, [0, 2, 4], [0, 1, 4], 0.0, 1e9, 1000)
    assert not worse.enact and worse.reason.startswith("no gain")


def test_decision_uses_the_busiest_rank_and_per_layer_bytes() -> None:
    costs = [1.0] * 6
    # Stage 0 -> 1 gets layer 1; stage 2 -> 1 gets layer 4: rank 1 receives both.
    decision = should_rebalance(costs, [0, 2, 4, 6], [0, 1, 5, 6], [0, 7, 0, 0, 5, 0], 1.0, 10)
    assert decision.busiest_rank_bytes == 12.0 and decision.bytes_moved == 12.0
    assert decision.predicted_migration_s == 12.0


@pytest.mark.parametrize(
    ("old_parts", "new_parts", "busiest_layers", "traffic_layers"),
    [
        # Layer 1 goes 0 -> 1 while layer 5 goes 2 -> 3: disjoint pairs run at once.
        ([0, 2, 4, 6, 8], [0, 1, 4, 5, 8], 1, [1, 1, 1, 1]),
        # Stage 0 sends layers 1 and 2 to stage 1: one rank's two layers, one after the other.
        ([0, 3, 4, 6, 8], [0, 1, 4, 6, 8], 2, [2, 2, 0, 0]),
        # Stage 1 receives layer 1 and sends layer 3: its own two transfers share its threads.
        ([0, 2, 4, 6, 8], [0, 1, 3, 6, 8], 2, [1, 2, 1, 0]),
    ],
)
def test_migration_is_priced_as_migrate_runs_it(
    old_parts: list[int], new_parts: list[int], busiest_layers: int, traffic_layers: list[int]
) -> None:
    """Moves between different pairs of ranks overlap; a rank's own sends and receives do not
    (migrate() drives them with one progress loop and one hashing thread per rank), so the
    time is the busiest rank's bytes sent plus received over one transfer's bandwidth."""
    layer_bytes = 1e9
    decision = should_rebalance([1.0] * 8, old_parts, new_parts, layer_bytes, 1e9, 10)
    assert decision.busiest_rank_bytes == busiest_layers * layer_bytes
    assert decision.predicted_migration_s == pytest.approx(busiest_layers)
    traffic = rank_bytes(plan_moves(old_parts, new_parts), [layer_bytes] * 8, 4)
    assert traffic == [n * layer_bytes for n in traffic_layers]


def test_a_path_is_judged_by_its_best_prefix() -> None:
    """Loads (4, 1, 4) on [1]*9: hop 1 relieves stage 0 only (no gain alone), hop 2 stage 2."""
    costs, path = [1.0] * 9, [[0, 4, 5, 9], [0, 3, 5, 9], [0, 3, 6, 9]]
    alone = should_rebalance(costs, path[0], path[1], 1.0, 1.0, 10)
    assert not alone.enact and alone.reason.startswith("no gain")
    walk = should_follow(costs, path, 1.0, 1.0, [10, 10])
    assert walk.enact and walk.new_parts == path[1] and walk.reason.startswith("enact: hop 1 of 2")
    assert walk.predicted_gain_s == 10.0  # 0 s/step for 10 steps, then 1 s/step for 10
    assert walk.predicted_migration_s == 1.0 and walk.judged_migration_s == 2.0
    assert walk.judged_hops == 2
    # Hops beyond the steps left are not judged: with one check left, the walk cannot pay.
    short = should_follow(costs, path, 1.0, 1.0, [10])
    assert not short.enact and short.reason.startswith("no gain")
    # Too dear: 2 s of gain for 2 x 1.1 s of migration.
    dear = should_follow(costs, path, 1.0, 1.0, [2, 2])
    assert not dear.enact and dear.reason.startswith("keep") and dear.predicted_gain_s == 2.0
    # One hop is the plain rule; an empty path is refused.
    assert should_follow(costs, path[:2], 1.0, 1.0, [10, 10]) == alone
    with pytest.raises(ValueError, match="path is empty"):
        should_follow(costs, [], 1.0, 1.0, [1])
    with pytest.raises(ValueError, match="steps_per_hop"):
        should_follow(costs, path, 1.0, 1.0, [1, -1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bandwidth_bytes_per_s": 0.0}, "bandwidth_bytes_per_s=0.0 must be finite and > 0"),
        ({"steps_until_next_check": -1}, "steps_until_next_check=-1"),
        ({"margin": -0.5}, "margin=-0.5"),
        ({"layer_bytes": [1.0]}, "layer_bytes has 1 entries"),
    ],
)
def test_decision_rejects_bad_inputs(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "costs": [1.0, 1.0],
        "old_parts": [0, 1, 2],
        "new_parts": [0, 1, 2],
        "layer_bytes": 1.0,
        "bandwidth_bytes_per_s": 1.0,
        "steps_until_next_check": 1,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        should_rebalance(**args)  # type: ignore[arg-type]
