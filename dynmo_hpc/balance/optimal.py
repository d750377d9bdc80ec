"""Exact min-max ("chains-on-chains") partitioning, optionally under a per-stage memory capacity.

Why min-max: a pipeline's steady-state step time is set by its heaviest stage, so the partition
to pick is the one minimising the maximum stage load over contiguous, order-preserving splits.
Minimising variance or max-minus-min is a different objective and can pick a slower pipeline
(DeepSpeed's own tests skip a case where its variance program does).

How (exact, no tolerance):

1. **Probe.** For a bound ``B``, the greedy probe fills stage 0 with as many layers as fit under
   ``B`` (and under the memory capacity), then stage 1, and so on. ``B`` is feasible iff the probe
   covers all layers in at most ``num_stages`` stages; greedy is optimal for this test because any
   feasible partition can be shifted right, stage by stage, onto the greedy one.
2. **Bisection with snapping.** Keep ``lo <= B* <= hi``. Probe the midpoint. On success, ``hi``
   drops to the bottleneck the probe actually achieved (a real stage load, ``<= mid``). On
   failure, ``lo`` jumps to the smallest bound at which any greedy stage could grow (a real stage
   load, ``> mid``): every bound below it fails the same way. Both ends move strictly on every
   probe and both are stage loads, so the loop ends with ``lo == hi == B*`` exactly. Without a
   capacity the bracket starts within a factor 2 and at least halves per probe, so it takes at
   most ~55 probes (4-12 in the benchmark) of O(P log N) each (bisect on prefix sums). This is
   the parametric search of Pinar & Aykanat (JPDC 2004) with the bracket snapped to realisable
   values.
3. **Construction with a tie-break.** Many partitions usually reach ``B*``. Boundary ``p`` may lie
   anywhere between the right-to-left greedy's start of stage ``p`` (``lo_p``, the leftmost
   position that still lets the suffix fit) and the left-to-right greedy's reach from the previous
   boundary (``hi_p``). Without ``current`` we take ``hi_p``: the lexicographically largest
   optimal partition (what DeepSpeed's test cases expect), holding one layer back for each later
   stage so none is empty. With ``current`` we take the position nearest ``current[p]``, so a
   rebalance moves few layers, and an already optimal ``current`` comes back unchanged.

Optimality certificate (used by the tests): the probe succeeds at ``B*`` and fails at the largest
stage load below ``B*``.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

from dynmo_hpc.balance.common import (
    CostsLike,
    check_num_stages,
    check_parts,
    check_values,
    loads_from_prefix,
    memory_values,
    prefix_sums,
)

#: ``lo`` starts just below ``total / num_stages``: the rounded stage loads of any partition sum to
#: the total within ``num_stages`` half-ulps, so this slack keeps ``lo`` a true lower bound.
_AVERAGE_SLACK = 1e-9


class Chain:
    """Prefix sums of one cost vector (plus memory reach when capped): the probe's data.

    Why a class: the probe runs a few dozen times per solve, and precomputing the memory reach of
    every start position (vectorised with numpy) keeps each probe a tight loop of bisects.
    """

    def __init__(self, costs: Sequence[float], mem: tuple[list[float], float] | None) -> None:
        self.prefix = prefix_sums(costs)
        self.num_layers = len(costs)
        self.mem_reach: list[int] | None = None
        self.mem_back: list[int] | None = None
        if mem is not None:
            self.mem_reach, self.mem_back = _memory_reach(prefix_sums(mem[0]), mem[1])

    def probe(self, bound_s: float, num_stages: int) -> tuple[bool, float, float]:
        """Greedy left-to-right fill under ``bound_s``: ``(fits, achieved_s, jump_s)``.

        ``achieved_s`` is the heaviest stage the probe built; ``jump_s`` the smallest load above
        ``bound_s`` at which some stage it built could take one more layer (``inf`` if none).
        """
        prefix, n, mem_reach = self.prefix, self.num_layers, self.mem_reach
        start, achieved_s, jump_s = 0, 0.0, math.inf
        for _ in range(num_stages):
            base = prefix[start]
            end = bisect_right(prefix, base + bound_s, start) - 1
            # Rounding of ``base + bound_s`` can disagree with ``prefix[end] - base`` by an ulp.
            while end < n and prefix[end + 1] - base <= bound_s:
                end += 1
            while end > start and prefix[end] - base > bound_s:
                end -= 1
            if mem_reach is not None and mem_reach[start] <= end:
                end = mem_reach[start]  # memory binds: a larger bound would not grow this stage
            elif end < n:
                jump_s = min(jump_s, prefix[end + 1] - base)
            if end == start:
                return False, achieved_s, jump_s
            achieved_s = max(achieved_s, prefix[end] - base)
            start = end
            if start == n:
                return True, achieved_s, jump_s
        return False, achieved_s, jump_s

    def solve(self, num_stages: int) -> float:
        """The exact optimal bottleneck ``B*`` (a stage load, in the shared prefix arithmetic)."""
        prefix, n = self.prefix, self.num_layers
        total_s = prefix[n]
        largest_s = max(map(operator.sub, prefix[1:], prefix[:-1]))  # heaviest single layer
        lo = max(largest_s, total_s / num_stages * (1.0 - _AVERAGE_SLACK))
        fits, hi, _ = self.probe(min(total_s, total_s / num_stages + largest_s), num_stages)
        if not fits:  # only a memory capacity can make the classic upper bound fail
            fits, hi, _ = self.probe(total_s, num_stages)
        if not fits:
            raise RuntimeError("internal error: memory-feasible chain failed the probe at total")
        while lo < hi:
            mid = lo + (hi - lo) * 0.5
            if mid >= hi:
                mid = lo
            fits, achieved_s, jump_s = self.probe(mid, num_stages)
            if fits:
                hi = achieved_s
            else:
                lo = min(jump_s, hi)
        return hi

    def build(self, bound_s: float, num_stages: int, target: Sequence[int] | None) -> list[int]:
        """A partition with every stage ``<= bound_s``, each boundary nearest ``target[p]``.

        ``bound_s`` must be feasible. Without ``target`` each boundary takes its rightmost allowed
        position (left-to-right greedy).
        """
        prefix, n = self.prefix, self.num_layers
        lowest = [0] * (num_stages + 1)
        end = n
        for p in range(num_stages - 1, 0, -1):
            end = self.back(end, bound_s)
            lowest[p] = end
        parts = [0]
        for p in range(1, num_stages):
            prev = parts[-1]
            highest = min(self.reach(prev, bound_s), n - (num_stages - p))
            low = max(lowest[p], prev + 1)
            want = highest if target is None else target[p]
            parts.append(min(max(want, low), highest))
        parts.append(n)
        if max(loads_from_prefix(prefix, parts)) > bound_s:
            raise RuntimeError(f"internal error: built {parts} exceeds bound {bound_s!r}")
        return parts

    def reach(self, start: int, bound_s: float) -> int:
        """Largest ``end`` with stage ``[start, end)`` within ``bound_s`` and the capacity."""
        prefix, n = self.prefix, self.num_layers
        base = prefix[start]
        end = bisect_right(prefix, base + bound_s, start) - 1
        while end < n and prefix[end + 1] - base <= bound_s:
            end += 1
        while end > start and prefix[end] - base > bound_s:
            end -= 1
        return end if self.mem_reach is None else min(end, self.mem_reach[start])

    def back(self, end: int, bound_s: float) -> int:
        """Smallest ``start`` with stage ``[start, end)`` within ``bound_s`` and the capacity."""
        prefix = self.prefix
        top = prefix[end]
        start = bisect_left(prefix, top - bound_s, 0, end)
        while start > 0 and top - prefix[start - 1] <= bound_s:
            start -= 1
        while start < end and top - prefix[start] > bound_s:
            start += 1
        return start if self.mem_back is None else max(start, self.mem_back[end])


def _memory_reach(mem_prefix: list[float], capacity: float) -> tuple[list[int], list[int]]:
    """For every start ``s``: the furthest end under ``capacity``; for every end: the nearest start.

    Vectorised searchsorted plus ulp-level fix-ups, so the per-probe loop only indexes a list.
    """
    mp = np.asarray(mem_prefix)
    n = len(mp) - 1
    idx = np.arange(n + 1)
    reach = np.searchsorted(mp, mp + capacity, side="right") - 1
    while True:
        grow = (reach < n) & (mp[np.minimum(reach + 1, n)] - mp <= capacity)
        shrink = (reach > idx) & (mp[reach] - mp > capacity)
        if not (grow.any() or shrink.any()):
            break
        reach = reach + grow - shrink
    back = np.searchsorted(mp, mp - capacity, side="left")
    while True:
        grow = (back > 0) & (mp - mp[np.maximum(back - 1, 0)] <= capacity)
        shrink = (back < idx) & (mp - mp[back] > capacity)
        if not (grow.any() or shrink.any()):
            break
        back = back - grow + shrink
    return reach.tolist(), back.tolist()


def min_capacity(memory: CostsLike, num_stages: int) -> float:
    """The smallest per-stage capacity (bytes) under which ``memory`` fits on ``num_stages``.

    This is the min-max partition of the memory itself: it answers "how few stages could hold
    this model?".
    """
    mem = check_values(memory, "memory")
    return Chain(mem, None).solve(check_num_stages(num_stages, len(mem)))


def checked_chain(
    costs: CostsLike,
    num_stages: int,
    memory: CostsLike | None,
    capacity: float | None,
) -> tuple[list[float], int, Chain, tuple[list[float], float] | None]:
    """Validated costs, stage count, :class:`Chain` and memory pair; ValueError if nothing fits.

    The capacity check names the minimum capacity that would work, so the fix is one edit.
    """
    values = check_values(costs)
    num_stages = check_num_stages(num_stages, len(values))
    mem = memory_values(memory, capacity, len(values))
    if mem is not None:
        needed = Chain(mem[0], None).solve(num_stages)
        if mem[1] < needed:
            raise ValueError(
                f"capacity={mem[1]:.6g} bytes per stage is too small: {len(values)} layers on "
                f"{num_stages} stages need at least {needed:.6g} bytes per stage (largest layer "
                f"{max(mem[0]):.6g}); raise the capacity to >= {needed:.6g} or use more stages"
            )
    return values, num_stages, Chain(values, mem), mem


def optimal_bottleneck(
    costs: CostsLike,
    num_stages: int,
    *,
    memory: CostsLike | None = None,
    capacity: float | None = None,
) -> float:
    """The minimum over contiguous partitions of the heaviest stage's load (seconds per step)."""
    _, num_stages, chain, _ = checked_chain(costs, num_stages, memory, capacity)
    return chain.solve(num_stages)


def optimal(
    costs: CostsLike,
    num_stages: int,
    *,
    current: Sequence[int] | None = None,
    memory: CostsLike | None = None,
    capacity: float | None = None,
    rel_tol: float = 1e-12,
) -> list[int]:
    """A partition whose heaviest stage is as light as possible (see the module docstring).

    Args:
        costs: seconds per layer per step, finite and >= 0.
        num_stages: pipeline stages; 1 <= num_stages <= len(costs).
        current: the partition in use. It is returned unchanged when its bottleneck is within
            ``rel_tol`` of the optimum and it fits the capacity; otherwise each new boundary is
            the optimal position nearest the current one, to limit migration.
        memory: bytes per layer; with ``capacity`` (bytes per stage) every stage must fit.
        rel_tol: relative slack for "already optimal" (float noise only, not a policy margin:
            whether a gain is worth migrating is :func:`should_rebalance`'s call).

    Example: ``optimal([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]`` (every stage costs 3).
    """
    values, num_stages, chain, mem = checked_chain(costs, num_stages, memory, capacity)
    best_s = chain.solve(num_stages)
    target = None
    if current is not None:
        target = check_parts(current, len(values), "current")
        if len(target) != num_stages + 1:
            raise ValueError(
                f"current={target} has {len(target) - 1} stages but num_stages={num_stages}"
            )
        fits = mem is None or max(loads_from_prefix(prefix_sums(mem[0]), target)) <= mem[1]
        if fits and max(loads_from_prefix(chain.prefix, target)) <= best_s * (1.0 + rel_tol):
            return target
    return chain.build(best_s, num_stages, target)
