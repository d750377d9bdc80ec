"""`optimal` against brute force on every small shape, and against the optimality certificate on
larger random instances.

The brute force enumerates every partition with non-empty stages and measures loads with the
same prefix-sum arithmetic as the library (``prefix[j] - prefix[i]``), so optima compare exactly,
floats included.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from dynmo_hpc.balance import (
    ALGORITHMS,
    min_capacity,
    optimal,
    optimal_bottleneck,
    partition,
    stage_loads,
)


def _prefix(values: list[float]) -> np.ndarray:
    return np.array([0.0, *itertools.accumulate(values)])


@functools.cache
def _all_partitions(num_layers: int, num_stages: int) -> np.ndarray:
    """Every partition as a row of boundaries, shape (count, num_stages + 1), lexicographically
    descending (so the first optimal row is the lexicographically largest)."""
    cuts = sorted(itertools.combinations(range(1, num_layers), num_stages - 1), reverse=True)
    rows = np.zeros((len(cuts), num_stages + 1), dtype=np.int64)
    rows[:, -1] = num_layers
    if num_stages > 1:
        rows[:, 1:-1] = np.array(cuts)
    return rows


def _loads(prefix: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return prefix[rows[:, 1:]] - prefix[rows[:, :-1]]


def _brute(
    costs: list[float], num_stages: int, memory: list[float] | None = None, capacity: float = 0
) -> tuple[float, list[int]]:
    """(optimal bottleneck, lexicographically largest optimal partition) by enumeration."""
    rows = _all_partitions(len(costs), num_stages)
    worst = _loads(_prefix(costs), rows).max(axis=1)
    if memory is not None:
        worst = np.where(_loads(_prefix(memory), rows).max(axis=1) <= capacity, worst, math.inf)
    best = float(worst.min())
    return best, rows[int(np.argmax(worst == best))].tolist()


def _bottleneck(costs: list[float], parts: list[int]) -> float:
    return float(_loads(_prefix(costs), np.array([parts])).max())


def _random_costs(rng: np.random.Generator, n: int, kind: int) -> list[float]:
    if kind == 0:
        return rng.integers(0, 10, n).astype(float).tolist()  # ties and zeros
    if kind == 1:
        return rng.random(n).tolist()
    if kind == 2:
        return rng.lognormal(0.0, 2.0, n).tolist()  # heavy tail
    return rng.choice([0.0, 0.0, 1.0, 100.0], n).tolist()  # spikes and zero runs


def test_every_small_vector_over_0_1_3_matches_brute_force() -> None:
    """Exhaustive: all 3**n cost vectors over {0, 1, 3} for n <= 6, every stage count."""
    for n in range(1, 7):
        vectors = np.array(list(itertools.product([0.0, 1.0, 3.0], repeat=n)))
        prefix = np.concatenate([np.zeros((len(vectors), 1)), np.cumsum(vectors, axis=1)], axis=1)
        for num_stages in range(1, min(5, n) + 1):
            rows = _all_partitions(n, num_stages)
            worst = (prefix[:, rows[:, 1:]] - prefix[:, rows[:, :-1]]).max(axis=2)  # (V, R)
            best = worst.min(axis=1)
            lexmax = rows[np.argmax(worst == best[:, None], axis=1)]
            for v, costs in enumerate(vectors.tolist()):
                parts = optimal(costs, num_stages)
                assert _bottleneck(costs, parts) == best[v], (costs, num_stages, parts)
                assert parts == lexmax[v].tolist(), (costs, num_stages)  # documented tie-break


@pytest.mark.parametrize("n", range(7, 13))
def test_random_vectors_up_to_12_layers_and_5_stages_match_brute_force(n: int) -> None:
    rng = np.random.default_rng(n)
    for num_stages in range(1, 6):
        for trial in range(12):
            costs = _random_costs(rng, n, trial % 4)
            best, lexmax = _brute(costs, num_stages)
            assert optimal_bottleneck(costs, num_stages) == best
            parts = optimal(costs, num_stages)
            assert _bottleneck(costs, parts) == best and parts == lexmax


@pytest.mark.parametrize("n", [4, 7, 10, 12])
def test_memory_capacity_matches_brute_force(n: int) -> None:
    rng = np.random.default_rng(100 + n)
    for num_stages in range(1, min(5, n) + 1):
        for trial in range(10):
            costs = _random_costs(rng, n, trial % 4)
            memory = rng.integers(1, 10, n).astype(float).tolist()
            needed = min_capacity(memory, num_stages)
            assert needed == _brute(memory, num_stages)[0]
            capacity = needed + float(rng.integers(0, 6))
            best, _ = _brute(costs, num_stages, memory, capacity)
            parts = optimal(costs, num_stages, memory=memory, capacity=capacity)
            assert _bottleneck(costs, parts) == best
            assert max(stage_loads(memory, parts)) <= capacity
            if needed > 0:
                with pytest.raises(ValueError, match="too small"):
                    optimal(costs, num_stages, memory=memory, capacity=needed * (1 - 1e-9))


def test_current_is_kept_iff_optimal_and_result_is_always_optimal() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(2, 11))
        num_stages = int(rng.integers(1, min(5, n) + 1))
        costs = _random_costs(rng, n, int(rng.integers(4)))
        cuts = sorted(rng.choice(np.arange(1, n), num_stages - 1, replace=False).tolist())
        current = [0, *cuts, n]
        best, _ = _brute(costs, num_stages)
        parts = optimal(costs, num_stages, current=current)
        if parts == current:  # kept: optimal up to rel_tol (float noise)
            assert _bottleneck(costs, parts) <= best * (1 + 1e-12)
        else:
            assert _bottleneck(costs, parts) == best
        if _bottleneck(costs, current) == best:
            assert parts == current


def _probe(prefix: list[float], num_stages: int, bound: float) -> bool:
    """An independent greedy probe: can every stage stay <= bound? (plain loop, no bisect)."""
    start, n = 0, len(prefix) - 1
    for _ in range(num_stages):
        end = start
        while end < n and prefix[end + 1] - prefix[start] <= bound:
            end += 1
        if end == start:
            return False
        start = end
        if start == n:
            return True
    return False


@pytest.mark.parametrize("seed", range(6))
def test_certificate_on_random_medium_instances(seed: int) -> None:
    """Probe succeeds at B* and fails at the largest stage load below B* (dynmo.md)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 300))
    num_stages = int(rng.integers(2, 40))
    costs = _random_costs(rng, n, seed % 4)
    parts = optimal(costs, num_stages)
    prefix = [0.0, *itertools.accumulate(costs)]
    best = max(stage_loads(costs, parts))
    assert best == optimal_bottleneck(costs, num_stages)
    assert _probe(prefix, num_stages, best)
    p = np.array(prefix)
    all_loads = (p[None, :] - p[:, None])[np.triu_indices(n + 1, k=1)]
    below = all_loads[all_loads < best]
    if below.size:
        assert not _probe(prefix, num_stages, float(below.max()))


@pytest.mark.parametrize(("n", "num_stages"), [(2_000, 64), (5_000, 500), (3_000, 3_000)])
def test_certificate_on_random_large_instances(n: int, num_stages: int) -> None:
    """Probe succeeds at B* and fails at the next float below it: nothing below B* is feasible."""
    rng = np.random.default_rng(n + num_stages)
    for kind in range(4):
        costs = _random_costs(rng, n, kind)
        parts = optimal(costs, num_stages)
        prefix = [0.0, *itertools.accumulate(costs)]
        best = max(stage_loads(costs, parts))
        assert _probe(prefix, num_stages, best)
        assert not _probe(prefix, num_stages, math.nextafter(best, -math.inf))


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_keeps_order_contiguity_and_non_empty_stages(algorithm: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(100):
        n = int(rng.integers(1, 60))
        num_stages = int(rng.integers(1, n + 1))
        costs = _random_costs(rng, n, int(rng.integers(4)))
        options = {"params": rng.integers(1, 100, n).tolist()} if algorithm == "parameters" else {}
        parts = partition(costs, num_stages, algorithm, **options)
        assert len(parts) == num_stages + 1 and parts[0] == 0 and parts[-1] == n
        assert all(parts[p] < parts[p + 1] for p in range(num_stages))
        assert max(stage_loads(costs, parts)) >= optimal_bottleneck(costs, num_stages)
