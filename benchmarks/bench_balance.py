"""Benchmark the balancers: `optimal`'s speed, and how far `diffusion` lands from the optimum.

Not a test: it prints numbers and asserts nothing about time (machines differ). Usage::

    .venv/bin/python benchmarks/bench_balance.py              # both parts
    .venv/bin/python benchmarks/bench_balance.py --part speed
    .venv/bin/python benchmarks/bench_balance.py --part diffusion --seed 0

Speed: median wall time of ``optimal`` on 1,000 layers x 64 stages (budget 10 ms) and 10,000
layers x 1,000 stages (budget 1 s), per cost distribution, with the ratio to the budget.

Diffusion: on seeded random and adversarial families, the share of runs that reach the optimal
bottleneck, and the ratio ``diffusion bottleneck / optimal bottleneck`` (mean, 95th percentile,
max), plus the phases (half-rounds) it took. docs/balancing.md quotes this output.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np

from dynmo_hpc.balance import (
    bottleneck,
    diffusion,
    diffusion_trace,
    optimal,
    optimal_bottleneck,
)

SIZES = ((1_000, 64, 0.010), (10_000, 1_000, 1.0))  # layers, stages, budget in seconds


def _distributions(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "uniform(0,1)": rng.random(n),
        "lognormal(s=2)": rng.lognormal(0.0, 2.0, n),
        "ints 0..9": rng.integers(0, 10, n).astype(float),
        "one heavy layer": np.where(np.arange(n) == n // 3, float(n), 1.0),
    }


def _median_s(function: Callable[[], object], repeats: int) -> float:
    function()  # warm-up
    times_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        function()
        times_s.append(time.perf_counter() - t0)
    return statistics.median(times_s)


def bench_speed(seed: int) -> None:
    rng = np.random.default_rng(seed)
    print("optimal: median wall time (time.perf_counter)")
    header = ("layers", "stages", "distribution", "median", "budget", "ratio")
    print("{:>7} {:>6} {:<16} {:>10} {:>8} {:>6}".format(*header))
    for num_layers, num_stages, budget_s in SIZES:
        repeats = 51 if num_layers <= 1_000 else 9
        for name, costs in _distributions(rng, num_layers).items():
            values = costs.tolist()
            median_s = _median_s(lambda v=values, p=num_stages: optimal(v, p), repeats)
            print(
                f"{num_layers:>7} {num_stages:>6} {name:<16} {median_s * 1e3:>8.2f}ms "
                f"{budget_s * 1e3:>6.0f}ms {median_s / budget_s:>6.3f}"
            )
    values = rng.random(1_000).tolist()
    median_s = _median_s(lambda: diffusion(values, 64), 11)
    print(f"for scale, diffusion (no budget) 1000 x 64 uniform(0,1): {median_s * 1e3:.2f}ms")


Instance = tuple[list[float], int, list[int] | None]  # costs, stages, start (None: uniform)


def _random_family(rng: np.random.Generator, trials: int, drift: bool) -> Iterator[Instance]:
    """Random costs; with ``drift`` the start is the optimum for costs before a change."""
    for _ in range(trials):
        num_layers = int(rng.choice([16, 32, 64, 128, 256]))
        num_stages = int(rng.choice([s for s in (2, 3, 4, 8, 16, 32) if s <= num_layers // 2]))
        kind = int(rng.integers(3))
        if kind == 0:
            costs = rng.random(num_layers)
        elif kind == 1:
            costs = rng.lognormal(0.0, 1.0, num_layers)
        else:
            costs = rng.integers(1, 10, num_layers).astype(float)
        if not drift:
            yield costs.tolist(), num_stages, None
            continue
        start = optimal(costs.tolist(), num_stages)
        # A dynamic-model event: a contiguous block of layers gets cheaper (pruning, freezing,
        # early exit) or dearer (expert imbalance), by a random factor.
        a, b = sorted(rng.integers(0, num_layers + 1, 2))
        factor = float(rng.choice([0.1, 0.3, 0.5, 2.0, 4.0]))
        changed = costs.copy()
        changed[a:b] *= factor
        yield changed.tolist(), num_stages, start


def _staircase(r: int) -> Instance:
    """Zero-cost layers, then stages of 1, 2, ..., r unit layers: every pair is locally stuck.

    ``num_stages = r (r + 1) / 2``; the optimum puts each unit layer on its own stage (B* = 1),
    diffusion from this start cannot move (gap r ~ sqrt(2 num_stages)).
    """
    num_stages = r * (r + 1) // 2
    num_light = num_stages - r
    costs = [0.0] * num_light + [1.0] * (r * (r + 1) // 2)
    start = list(range(num_light + 1))
    for k in range(1, r + 1):
        start.append(start[-1] + k)
    return costs, num_stages, start


def _worst_from_uniform(rng: np.random.Generator, iterations: int) -> Iterator[Instance]:
    """Hill-climb small integer instances to maximise the gap from the uniform start."""
    for num_layers, num_stages in ((6, 3), (8, 4), (12, 4), (12, 6)):
        costs = rng.integers(0, 10, num_layers).astype(float).tolist()
        best = _ratio(costs, num_stages, None)[0]
        for _ in range(iterations):
            trial = list(costs)
            trial[int(rng.integers(num_layers))] = float(rng.integers(0, 10))
            if sum(trial) == 0:
                continue
            ratio = _ratio(trial, num_stages, None)[0]
            if ratio >= best:
                costs, best = trial, ratio
        yield costs, num_stages, None


def _ratio(costs: list[float], num_stages: int, start: list[int] | None) -> tuple[float, int]:
    trace = diffusion_trace(costs, num_stages, current=start)
    best_s = optimal_bottleneck(costs, num_stages)
    got_s = bottleneck(costs, trace[-1])
    ratio = 1.0 if got_s == best_s else (math.inf if best_s == 0 else got_s / best_s)
    return ratio, len(trace) - 1


def _report(name: str, instances: list[Instance]) -> None:
    ratios, phases = [], []
    for costs, num_stages, start in instances:
        ratio, num_phases = _ratio(costs, num_stages, start)
        ratios.append(ratio)
        phases.append(num_phases)
    reached = sum(r <= 1.0 + 1e-12 for r in ratios) / len(ratios)
    print(
        f"{name:<36} {len(ratios):>5} {reached * 100:>8.1f}% {statistics.fmean(ratios):>7.4f} "
        f"{float(np.percentile(ratios, 95)):>7.4f} {max(ratios):>7.4f} "
        f"{statistics.fmean(phases):>7.1f}"
    )


def _report_by_stages(name: str, instances: list[Instance]) -> None:
    _report(name, instances)
    for num_stages in sorted({p for _, p, _ in instances}):
        group = [inst for inst in instances if inst[1] == num_stages]
        _report(f"  of which P={num_stages}", group)


def bench_diffusion(seed: int, trials: int) -> None:
    print("diffusion: bottleneck / optimal bottleneck")
    header = ("family", "runs", "optimal", "mean", "p95", "max", "phases")
    print("{:<36} {:>5} {:>9} {:>7} {:>7} {:>7} {:>7}".format(*header))
    rng = np.random.default_rng(seed)
    _report_by_stages("random costs, uniform start", list(_random_family(rng, trials, False)))
    _report_by_stages("cost change, start = old optimum", list(_random_family(rng, trials, True)))
    _report("[0,1,1,1] on 3, uniform start", [([0.0, 1.0, 1.0, 1.0], 3, None)])
    for r in (2, 3, 5, 8):
        _report(f"staircase r={r} (P={r * (r + 1) // 2}), stuck start", [_staircase(r)])
    _report("hill-climbed worst, uniform start", list(_worst_from_uniform(rng, 300)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["speed", "diffusion", "all"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=400, help="runs per random diffusion family")
    args = parser.parse_args()
    if args.trials < 1:
        raise SystemExit(f"bench_balance: --trials must be >= 1 for its shares, got {args.trials}")
    if args.part in ("speed", "all"):
        bench_speed(args.seed)
    if args.part in ("diffusion", "all"):
        bench_diffusion(args.seed, args.trials)


if __name__ == "__main__":
    main()
