"""The packing decision with replicas (pure, synthetic costs): fewer replicas at the same stage
count is a candidate beside fewer stages, priced by the step model (each replica trains more
microbatches; the all-reduce shrinks or goes), and judged by the same bound and pays-off rule.

Worked numbers: 4 layers costing 1 s per step in each of 2 replicas (M = 4, so 2 microbatches
per replica) are 2 s per layer for the whole global batch on one pipeline. On [0, 2, 4]:

- 2 replicas x 2 stages: (4/2 + 2 - 1) * (4 / 4) = 3 s, plus the all-reduce;
- 1 replica x 2 stages: (4 + 2 - 1) * (4 / 4) = 5 s, no all-reduce;
- 2 replicas x 1 stage: (4/2 + 1 - 1) * (8 / 4) = 4 s, plus the all-reduce of twice the bytes.
"""

from __future__ import annotations

import math

import pytest

from dynmo_hpc.balance.packing import (
    PackCandidate,
    PackPlan,
    PackRequest,
    plan_pack,
    predict_step_time_s,
    ring_allreduce_factor,
    smaller_sizes,
)

PER_REPLICA = [1.0, 1.0, 1.0, 1.0]
"""One replica's measured seconds per layer per step (2 of the 4 microbatches)."""


def _plan(costs=PER_REPLICA, parts=(0, 2, 4), **kw) -> PackPlan:
    args = {
        "num_microbatches": 4,
        "tokens_per_step": 1000.0,
        "ranks_per_node": 1,
        "steps_left": 100,
        "restart_overhead_s": 10.0,
        "num_replicas": 2,
        "min_stages": 2,
    }
    args.update(kw)
    return plan_pack(list(costs), list(parts), PackRequest(**args))


def _at(plan: PackPlan, replicas: int, stages: int) -> PackCandidate:
    (found,) = [c for c in plan.candidates if (c.num_replicas, c.num_stages) == (replicas, stages)]
    return found


def test_step_model_with_replicas_by_hand():
    whole = [2.0, 2.0, 2.0, 2.0]
    assert predict_step_time_s(whole, [0, 2, 4], 4, num_replicas=2) == 3.0
    assert predict_step_time_s(whole, [0, 2, 4], 4, num_replicas=1) == 5.0
    assert predict_step_time_s(whole, [0, 2, 4], 4, num_replicas=2, allreduce_s=0.5) == 3.5
    # 4 ranks sharing 2 cores: the 8 s of work over 2 cores, not the pipeline, is the limit
    assert predict_step_time_s(whole, [0, 2, 4], 4, num_replicas=2, num_cpu_slots=2) == 4.0
    with pytest.raises(ValueError, match="divisible by num_replicas=3"):
        predict_step_time_s(whole, [0, 2, 4], 4, num_replicas=3)
    assert ring_allreduce_factor(1) == 0.0 and ring_allreduce_factor(2) == 1.0
    assert ring_allreduce_factor(4) == 1.5


def test_sizes_keep_the_global_batch_and_release_whole_nodes():
    request = PackRequest(
        num_microbatches=6,
        tokens_per_step=1.0,
        ranks_per_node=1,
        steps_left=1,
        restart_overhead_s=0.0,
        num_replicas=3,
        min_stages=2,
    )

    def sizes(replicas, stages, request):
        return smaller_sizes(
            replicas,
            stages,
            num_microbatches=request.num_microbatches,
            min_stages=request.min_stages,
            ranks_per_node=request.ranks_per_node,
            num_layers=8,
        )

    assert sizes(3, 2, request) == [(2, 2), (1, 2)]
    # 9 microbatches do not split over 2 replicas: 3 x 2 -> 1 x 2 only
    odd = PackRequest(**{**request.__dict__, "num_microbatches": 9})
    assert sizes(3, 2, odd) == [(1, 2)]
    # two ranks per node: 2 x 2 holds 2 nodes; 1 x 2 and 2 x 1 hold 1
    paired = PackRequest(**{**request.__dict__, "num_microbatches": 4, "ranks_per_node": 2})
    assert sizes(2, 2, paired) == [(1, 2)]
    loose = PackRequest(**{**paired.__dict__, "min_stages": 1})
    assert sizes(2, 2, loose) == [(2, 1), (1, 2), (1, 1)]
    with pytest.raises(ValueError, match="num_replicas=4 must be >= 1 and divide"):
        PackRequest(**{**request.__dict__, "num_replicas": 4}).check()


def test_dropping_a_replica_wins_when_the_all_reduce_costs_more_than_the_bubble():
    """The all-reduce (3 s at 2 replicas) makes 2 x 2 take 6 s; 1 x 2 takes 5 s on half the
    nodes: faster and smaller, so even the throughput policy with no slowdown allowed packs."""
    plan = _plan(allreduce_s=3.0, max_slowdown=0.0)
    assert plan.current.step_time_s == 6.0 and plan.current.num_nodes == 4
    one = _at(plan, 1, 2)
    assert one.step_time_s == 5.0 and one.num_nodes == 2 and one.parts == [0, 2, 4]
    assert plan.pack, plan.reason
    assert (plan.chosen.num_replicas, plan.chosen.num_stages) == (1, 2)
    assert plan.reason.startswith("pack 2 replicas x 2 stages -> 2 stages (4 -> 2 nodes)")
    event = plan.to_event()
    assert (event["from_replicas"], event["to_replicas"]) == (2, 1)
    assert (event["from_stages"], event["to_stages"]) == (2, 2)
    # 100 steps x (4 nodes x 6 s - 2 nodes x 5 s) against 10 s x 4 nodes
    assert plan.saving_node_s == pytest.approx(1400.0) and plan.overhead_node_s == 40.0


def test_dropping_a_replica_wins_per_node_hour_within_a_wide_bound():
    """No all-reduce cost: 1 x 2 is 40 % slower (5 s against 3 s) but gives more tokens per
    node-hour (1 / (2 x 5) against 1 / (4 x 3)); node_hours with max_slowdown 0.5 packs."""
    plan = _plan(pack_policy="node_hours", max_slowdown=0.5)
    assert plan.pack, plan.reason
    assert (plan.chosen.num_replicas, plan.chosen.num_stages) == (1, 2)
    assert plan.chosen.tokens_per_node_hour > plan.rebalanced.tokens_per_node_hour


def test_dropping_a_replica_must_not_win_when_it_halves_throughput():
    """No all-reduce cost and the throughput policy's 10 % bound: 1 x 2 (5 s) and 2 x 1 (4 s)
    are both too slow against 2 x 2 (3 s): keep."""
    plan = _plan(max_slowdown=0.1, min_stages=1)
    assert _at(plan, 1, 2).step_time_s == 5.0
    assert _at(plan, 2, 1).step_time_s == 4.0
    assert not plan.pack and plan.chosen is plan.current
    assert plan.reason.startswith("keep 2 replicas x 2 stages: the best smaller one")


def test_the_all_reduce_is_scaled_by_replicas_and_stage_bytes():
    """2 x 1 keeps 2 replicas (ring factor unchanged) but each rank now reduces every layer:
    twice the heaviest stage's bytes, so twice the measured all-reduce; 1 x anything has none.
    The calibration (measured 7 s against the predicted 3 + 1) scales every size alike."""
    plan = _plan(
        allreduce_s=1.0,
        memory_bytes=[1.0] * 4,
        capacity_bytes=100.0,
        measured_step_s=7.0,
        min_stages=1,
        max_slowdown=0,
    )
    calibration = 7.0 / 4.0
    assert plan.calibration == pytest.approx(calibration)
    assert _at(plan, 2, 1).step_time_s == pytest.approx((4.0 + 2.0) * calibration)
    assert _at(plan, 1, 2).step_time_s == pytest.approx(5.0 * calibration)
    assert _at(plan, 1, 1).step_time_s == pytest.approx(8.0 * calibration)


def test_the_bound_is_against_the_original_replicas():
    """After 2 x 2 -> 1 x 2, a later decision at 1 x 2 judges against 2 x 2's prediction (3 s
    on the current costs), not against 1 x 2 itself: 1 x 1 (8 s) is past any 10 % bound, and
    so is staying put; the reference is the original size's tokens/s."""
    whole = [2.0, 2.0, 2.0, 2.0]  # what one replica measures at R = 1
    plan = _plan(
        costs=whole,
        num_replicas=1,
        original_replicas=2,
        original_stages=2,
        min_stages=1,
        max_slowdown=0.1,
    )
    assert plan.reference_tokens_per_s == pytest.approx(1000.0 / 3.0)
    assert not plan.pack and "keep 2 stages" in plan.reason
    assert math.isclose(plan.current.step_time_s, 5.0)
