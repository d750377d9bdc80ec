"""The packing decision, as a pure function: worked cases computed by hand, and properties on
random inputs (never over memory, never part of a node, never past the slowdown bound, never
when the steps left cannot pay for the restart)."""

from __future__ import annotations

import math
import random

import pytest

from dynmo_hpc.balance import stage_loads
from dynmo_hpc.balance.packing import PackRequest, nodes_for, plan_pack, predict_step_time_s

HEAVY = [1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0]
"""One layer no partition can split: it sets the pace on 3 stages as on 4."""


def _plan(costs=HEAVY, parts=(0, 2, 3, 4, 7), **kw):
    args = {
        "num_microbatches": 8,
        "tokens_per_step": 1000.0,
        "ranks_per_node": 1,
        "steps_left": 100,
        "restart_overhead_s": 5.0,
    }
    args.update(kw)
    return plan_pack(list(costs), list(parts), PackRequest(**args))


def test_step_time_model_by_hand():
    # (M + P - 1) * (max load / M): 4 layers of 1 s, 2 stages, M = 4 -> 5 * 0.5
    assert predict_step_time_s([1, 1, 1, 1], [0, 2, 4], 4) == 2.5
    # communication: two messages per microbatch slot, only with more than one stage
    assert predict_step_time_s([1, 1, 1, 1], [0, 2, 4], 4, comm_s=0.1) == pytest.approx(3.5)
    assert predict_step_time_s([1, 1, 1, 1], [0, 4], 4, comm_s=0.1) == 4.0
    # 4 stages sharing 2 cores: the cores bound it (total 4 s / 2), not the pipeline (7 * 0.25)
    assert predict_step_time_s([1, 1, 1, 1], [0, 1, 2, 3, 4], 4, num_cpu_slots=2) == 2.0


def test_heavy_layer_packs_four_to_three():
    plan = _plan()
    # 4 stages: 11 * 6/8 = 8.25 s; 3 stages [0,3,4,7]: 10 * 6/8 = 7.5 s (faster: smaller bubble);
    # 2 stages [0,4,7]: 9 * 9/8 = 10.125 s (18.5 % slower than now: beyond the 10 % bound).
    assert plan.current.step_time_s == pytest.approx(8.25)
    by_stages = {c.num_stages: c for c in plan.candidates}
    assert by_stages[3].step_time_s == pytest.approx(7.5) and by_stages[3].parts == [0, 3, 4, 7]
    assert by_stages[2].step_time_s == pytest.approx(10.125)
    assert plan.pack and plan.chosen.num_stages == 3 and plan.chosen.num_nodes == 3
    # saving 100 * (4 * 8.25 - 3 * 7.5) = 1050 node-s > overhead 5 s * 4 nodes = 20 node-s
    assert plan.saving_node_s == pytest.approx(1050.0) and plan.overhead_node_s == 20.0


def test_a_looser_bound_packs_further():
    plan = _plan(max_slowdown=0.2)  # 2 stages: 98.8 tokens/s >= 0.8 * 121.2
    assert plan.pack and plan.chosen.num_stages == 2


def test_balanced_work_does_not_pack():
    plan = _plan(costs=[1.0] * 8, parts=[0, 2, 4, 6, 8])
    # 4 stages: 11 * 2/8 = 2.75 s; 3 stages: 10 * 3/8 = 3.75 s (27 % slower): keep
    assert not plan.pack and plan.chosen is plan.current and "keep 4 stages" in plan.reason


def test_too_few_steps_left_never_pack():
    plan = _plan(steps_left=1)  # saves 10.5 node-s < 20 node-s of restart
    assert not plan.pack and "restart overhead" in plan.reason
    assert not _plan(steps_left=0).pack


def test_memory_rules_out_a_candidate():
    # Each layer holds 10 bytes; 25 bytes per stage: 7 layers need 3 stages at least (30 > 25 on
    # any 2-stage split), and the 3-stage optimum [0,3,4,7] holds 30 bytes: over too.
    plan = _plan(memory_bytes=[10.0] * 7, capacity_bytes=25.0, max_slowdown=0.5)
    assert not plan.pack
    assert all(not c.fits_memory for c in plan.candidates)
    roomy = _plan(memory_bytes=[10.0] * 7, capacity_bytes=30.0, max_slowdown=0.5)
    assert roomy.pack and roomy.chosen.num_stages == 3  # 2 stages would need 40 bytes


def test_whole_nodes_only():
    # 2 ranks per node: 4 stages hold 2 nodes; 3 stages would still hold 2, so only 2 and 1 count.
    plan = _plan(ranks_per_node=2, max_slowdown=0.3)
    assert sorted(c.num_stages for c in plan.candidates) == [1, 2]
    assert plan.pack and plan.chosen.num_stages == 2 and plan.chosen.num_nodes == 1


def test_min_stages_is_respected():
    plan = _plan(max_slowdown=0.5, min_stages=3)
    assert [c.num_stages for c in plan.candidates] == [3]


def test_node_hours_policy():
    # tokens per node-hour: 4 stages 121.2 * 3600 / 4 = 109 k; 1 stage 83.3 * 3600 = 300 k
    plan = _plan(pack_policy="node_hours")
    assert plan.pack and plan.chosen.num_stages == 1
    assert plan.chosen.tokens_per_node_hour == pytest.approx(1000 / 12 * 3600)


def test_calibration_scales_every_prediction_alike():
    plan = _plan(measured_step_s=16.5)  # twice the model's 8.25 s
    assert plan.calibration == pytest.approx(2.0)
    assert plan.chosen.step_time_s == pytest.approx(15.0)
    assert plan.chosen.num_stages == 3  # the choice is the same: the ratio cancels


def test_oversubscribed_cores_pack_without_loss():
    # 4 equal stages on 2 cores: bound by the cores (8 s / 2 = 4 s), as 3 stages are
    # (max(10 * 3/8, 4) = 4 s); 2 stages take 9 * 4/8 = 4.5 s, 11 % slower.
    plan = _plan(costs=[1.0] * 8, parts=[0, 2, 4, 6, 8], num_cpu_slots=2)
    assert plan.pack and plan.chosen.num_stages == 3 and plan.chosen.step_time_s == 4.0
    assert (
        _plan(
            costs=[1.0] * 8, parts=[0, 2, 4, 6, 8], num_cpu_slots=2, max_slowdown=0.15
        ).chosen.num_stages
        == 2
    )
    # with a core per stage the same work would not pack at all
    assert not _plan(costs=[1.0] * 8, parts=[0, 2, 4, 6, 8]).pack


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="policy"):
        _plan(pack_policy="fastest")
    with pytest.raises(ValueError, match="max_slowdown"):
        _plan(max_slowdown=1.5)
    with pytest.raises(ValueError, match="restart_overhead_s"):
        _plan(restart_overhead_s=math.nan)


@pytest.mark.parametrize("seed", range(300))
def test_properties_on_random_inputs(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(2, 14)
    costs = [
        rng.choice([0.0, rng.uniform(0.01, 1.0), rng.uniform(1, 10)]) for _ in range(num_layers)
    ]
    memory = [rng.uniform(1, 10) for _ in range(num_layers)]
    num_stages = rng.randint(1, num_layers)
    cuts = sorted(rng.sample(range(1, num_layers), num_stages - 1))
    parts = [0, *cuts, num_layers]
    capacity = max(stage_loads(memory, parts)) * rng.uniform(1.0, 2.0)
    rpn = rng.choice([1, 1, 2, 4])
    max_slowdown = rng.choice([0.0, 0.05, 0.1, 0.3])
    steps_left = rng.choice([0, 1, 10, 1000])
    overhead_s = rng.uniform(0, 20)
    policy = rng.choice(["throughput", "node_hours"])
    request = PackRequest(
        num_microbatches=rng.randint(1, 16),
        tokens_per_step=1000.0,
        ranks_per_node=rpn,
        steps_left=steps_left,
        restart_overhead_s=overhead_s,
        pack_policy=policy,
        max_slowdown=max_slowdown,
        memory_bytes=memory,
        capacity_bytes=capacity,
        comm_s=rng.choice([0.0, 0.01]),
    )
    plan = plan_pack(costs, parts, request)
    for c in plan.candidates:  # whole nodes only: every candidate frees at least one node
        assert c.num_nodes == nodes_for(c.num_stages, rpn) < plan.current.num_nodes
    if not plan.pack:
        assert plan.chosen is plan.current
        return
    chosen = plan.chosen
    assert chosen.num_stages < num_stages and chosen.fits_memory
    assert len(chosen.parts) == chosen.num_stages + 1 and chosen.parts[-1] == num_layers
    assert all(a < b for a, b in zip(chosen.parts, chosen.parts[1:], strict=False))
    assert max(stage_loads(memory, chosen.parts)) <= capacity * (1 + 1e-9)  # never over memory
    if policy == "throughput":  # never past the slowdown bound
        assert chosen.tokens_per_s >= (1 - max_slowdown) * plan.current.tokens_per_s * (1 - 1e-12)
    else:
        assert chosen.tokens_per_node_hour > plan.current.tokens_per_node_hour
    # only when the steps left pay for the restart
    assert steps_left > 0 and plan.saving_node_s > overhead_s * plan.current.num_nodes
