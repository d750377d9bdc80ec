"""Diffusion: neighbour-only moves, monotone bottleneck, termination, and its gap to the optimum.

The gap facts checked here are the ones docs/balancing.md states: the 4-layer counterexample,
the staircase family, and the bound ``bottleneck <= (sqrt(8P + 1) - 1) / 2 * B*`` at any fixed
point (no memory capacity).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dynmo_hpc.balance import (
    diffusion,
    diffusion_step,
    diffusion_trace,
    optimal,
    optimal_bottleneck,
    partition,
    plan_moves,
    stage_loads,
)


def _gap_bound(num_stages: int) -> float:
    return (math.sqrt(8 * num_stages + 1) - 1) / 2


def _instances(seed: int, count: int) -> list[tuple[list[float], int, list[int] | None]]:
    """Random costs; half start from uniform, half from the optimum of perturbed costs."""
    rng = np.random.default_rng(seed)
    out: list[tuple[list[float], int, list[int] | None]] = []
    for i in range(count):
        n = int(rng.integers(2, 80))
        num_stages = int(rng.integers(2, min(n, 16) + 1))
        kind = i % 3
        if kind == 0:
            costs = rng.random(n)
        elif kind == 1:
            costs = rng.lognormal(0.0, 1.5, n)
        else:
            costs = rng.integers(0, 6, n).astype(float)
        start = None
        if i % 2:
            start = optimal(costs.tolist(), num_stages)
            a, b = sorted(rng.integers(0, n + 1, 2))
            costs[a:b] *= float(rng.choice([0.2, 3.0]))
        out.append((costs.tolist(), num_stages, start))
    return out


def test_moves_are_neighbour_only_and_bottleneck_never_grows() -> None:
    for costs, num_stages, start in _instances(seed=1, count=150):
        trace = diffusion_trace(costs, num_stages, current=start)
        for before, after in itertools.pairwise(trace):
            moves = plan_moves(before, after)
            assert moves, "a recorded phase must move something"
            assert all(abs(m.src - m.dst) == 1 for m in moves), (before, after)
            assert max(stage_loads(costs, after)) <= max(stage_loads(costs, before))
            assert all(after[p] < after[p + 1] for p in range(num_stages))


def test_terminates_at_a_fixed_point() -> None:
    for costs, num_stages, start in _instances(seed=2, count=100):
        final = diffusion_trace(costs, num_stages, current=start)[-1]
        assert diffusion_trace(costs, num_stages, current=final) == [final]


def test_each_accepted_phase_lowers_the_sorted_loads() -> None:
    """The termination argument: loads sorted high-to-low fall lexicographically each phase."""
    for costs, num_stages, start in _instances(seed=3, count=100):
        trace = diffusion_trace(costs, num_stages, current=start)
        keys = [sorted(stage_loads(costs, parts), reverse=True) for parts in trace]
        assert all(a > b for a, b in itertools.pairwise(keys))


def test_fixed_point_obeys_the_neighbour_lemma_and_the_gap_bound() -> None:
    """At a fixed point neighbours differ by at most the heaviest layer, hence the sqrt bound."""
    for costs, num_stages, start in _instances(seed=4, count=200):
        final = diffusion_trace(costs, num_stages, current=start)[-1]
        loads = stage_loads(costs, final)
        largest_layer = max(costs)
        assert all(abs(x - y) <= largest_layer for x, y in itertools.pairwise(loads))
        best = optimal_bottleneck(costs, num_stages)
        assert max(loads) >= best
        assert max(loads) <= _gap_bound(num_stages) * best + 1e-9


def test_two_stages_always_reach_the_optimum() -> None:
    """With one pair the local re-split is the global problem."""
    for costs, _, start in _instances(seed=5, count=100):
        if len(costs) < 2:
            continue
        current = None if start is None else optimal(costs, 2)
        parts = diffusion(costs, 2, current=current)
        assert max(stage_loads(costs, parts)) == optimal_bottleneck(costs, 2)


def test_counterexample_four_layers_three_stages_gap_two() -> None:
    """From the uniform start every pair is locally optimal, yet the optimum is half as heavy."""
    costs = [0.0, 1.0, 1.0, 1.0]
    assert diffusion(costs, 3) == [0, 1, 2, 4]
    assert stage_loads(costs, [0, 1, 2, 4]) == [0.0, 1.0, 2.0]
    assert optimal(costs, 3) == [0, 2, 3, 4]
    assert optimal_bottleneck(costs, 3) == 1.0
    assert _gap_bound(3) == 2.0  # the bound is attained


@pytest.mark.parametrize("r", [2, 3, 4, 6])
def test_staircase_attains_the_bound(r: int) -> None:
    """Zero-cost layers, then stages of 1, 2, ..., r unit layers: gap r = bound at P = r(r+1)/2."""
    num_stages = r * (r + 1) // 2
    light = num_stages - r
    costs = [0.0] * light + [1.0] * num_stages
    start = list(range(light + 1))
    for k in range(1, r + 1):
        start.append(start[-1] + k)
    assert diffusion_trace(costs, num_stages, current=start) == [start]
    assert max(stage_loads(costs, start)) == r
    assert optimal_bottleneck(costs, num_stages) == 1.0
    assert _gap_bound(num_stages) == r


def test_measured_gap_on_random_inputs() -> None:
    """Regression guard on the figures in docs/balancing.md (seeded; loose bounds)."""
    ratios = []
    for costs, num_stages, start in _instances(seed=6, count=200):
        best = optimal_bottleneck(costs, num_stages)
        got = max(stage_loads(costs, diffusion(costs, num_stages, current=start)))
        ratios.append(1.0 if got == best else got / best)
    reached = sum(r == 1.0 for r in ratios) / len(ratios)
    assert reached > 0.4
    assert sum(ratios) / len(ratios) < 1.15
    assert max(ratios) < 2.5


def test_balanced_current_never_moves() -> None:
    costs = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    current = optimal(costs, 3)
    assert diffusion(costs, 3, current=current) == current
    # Smoothing non-bottleneck stages is not worth a migration: [6 | 1+2 | 3] keeps 6.
    costs = [6.0, 1.0, 2.0, 0.5]
    assert diffusion(costs, 3, current=[0, 1, 2, 4]) == [0, 1, 2, 4]


def test_capacity_is_never_exceeded_and_bad_start_is_rejected() -> None:
    rng = np.random.default_rng(8)
    for _ in range(50):
        n = int(rng.integers(4, 40))
        num_stages = int(rng.integers(2, min(n, 8) + 1))
        costs = rng.random(n).tolist()
        memory = rng.integers(1, 5, n).astype(float).tolist()
        capacity = optimal_bottleneck(memory, num_stages) + float(rng.integers(0, 3))
        for parts in diffusion_trace(costs, num_stages, memory=memory, capacity=capacity):
            assert max(stage_loads(memory, parts)) <= capacity
    with pytest.raises(ValueError, match=r"5 bytes on stage 0, over capacity=4.*'optimal'"):
        diffusion([1.0] * 4, 2, current=[0, 3, 4], memory=[1, 1, 3, 1], capacity=4)
    # Without a start, diffusion begins from a split that fits (here not the uniform one).
    assert diffusion([1.0] * 4, 2, memory=[3, 1, 1, 1], capacity=3) == [0, 1, 4]


def test_max_rounds_caps_the_work() -> None:
    costs = [1.0] * 63 + [40.0]
    assert diffusion_trace(costs, 8, max_rounds=0) == [partition(costs, 8, "uniform")]
    capped = diffusion_trace(costs, 8, max_rounds=1)
    assert len(capped) <= 3  # the start plus at most two phases
    with pytest.raises(ValueError, match="max_rounds=-1"):
        diffusion(costs, 8, max_rounds=-1)


def test_one_step_is_one_phase_of_the_trace() -> None:
    """diffusion_step re-splits only the pairs of its parity (the other boundaries stay), moves
    layers to neighbours only, is idempotent, and chaining steps of alternating parity (skipping
    ones that move nothing) is exactly the trace from that parity."""
    for costs, num_stages, start in _instances(seed=9, count=120):
        current = start or partition(costs, num_stages, "uniform")
        for first in (0, 1):
            trace = diffusion_trace(costs, num_stages, current=current, first_phase=first)
            walked, parts, phase, idle = [current], current, first, 0
            while idle < 2:
                after = diffusion_step(costs, parts, phase=phase)
                fixed = [k for k in range(1, num_stages) if (k - 1) % 2 != phase]
                assert [after[k] for k in fixed] == [parts[k] for k in fixed]
                assert all(abs(m.src - m.dst) == 1 for m in plan_moves(parts, after))
                assert diffusion_step(costs, after, phase=phase) == after
                idle = idle + 1 if after == parts else 0
                if after != parts:
                    walked.append(after)
                parts, phase = after, 1 - phase
            assert walked == trace


def test_one_step_keeps_the_capacity() -> None:
    # Stage 0 could take layer 3 (loads 3, 6 -> 4, 5) but would then hold 13 bytes > 12.
    costs, memory = [1.0, 1.0, 1.0, 1.0, 1.0, 4.0], [1, 1, 1, 10, 1, 1]
    assert diffusion_step(costs, [0, 3, 6], phase=0) == [0, 4, 6]
    assert diffusion_step(costs, [0, 3, 6], phase=0, memory=memory, capacity=12) == [0, 3, 6]
    with pytest.raises(ValueError, match="13 bytes on stage 0, over capacity=12"):
        diffusion_step(costs, [0, 4, 6], phase=0, memory=memory, capacity=12)
    with pytest.raises(ValueError, match="phase=2 must be 0"):
        diffusion_step(costs, [0, 3, 6], phase=2)
