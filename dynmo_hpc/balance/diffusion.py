"""Diffusion: neighbouring stages re-split their shared boundary, with no central view.

Why: the exact balancer in :mod:`.optimal` needs every stage's costs on one rank. Diffusion needs
only what two neighbours already exchange in a pipeline (their own layer costs), so each rank can
decide its own boundaries, and a rebalance can proceed in small steps between training steps.

The scheme (dimension exchange on a chain). A *round* has two *phases*: first the pairs
``(0,1), (2,3), ...`` act, then ``(1,2), (3,4), ...``. Pairs acting in one phase share no stage,
so they can run concurrently. A pair ``(p, p+1)`` re-splits the layers the two of them hold: it
picks the boundary minimising the heavier of the two loads (within the memory capacity, both
stages non-empty) and moves only if that *strictly* lowers the pair's heavier load; among equally
good boundaries it keeps the one nearest the old, to move as few layers as possible.

Guarantees (the tests check each):

- *Neighbour-only*: in a phase a boundary moves only inside ``(parts[p], parts[p+2])``, so every
  layer that moves goes from stage ``p`` to ``p+1`` or back.
- *Monotone*: a pair's heavier load strictly drops and no other stage changes, so the heaviest
  stage never gets heavier.
- *Terminating*: each accepted move replaces two loads by two loads below their old maximum, so
  the loads sorted in decreasing order fall lexicographically. There are finitely many partitions,
  so the rounds end (with exact float arithmetic on one shared prefix-sum list, no tolerance).
- *Order and contiguity*: only boundaries move, so every stage stays one non-empty range.

Two ways to use it: :func:`diffusion` runs the rounds to the fixed point (what ``partition`` and
``dynmo-hpc plan`` return), and :func:`diffusion_step` applies a single phase. The trainer
enacts one phase per balancing decision (``first_phase`` of :func:`diffusion_trace` gives the
path it walks), so each layer moves at most one stage per migration; repeated decisions walk
the trace until the rest of it would no longer lower the bottleneck.

What it does not guarantee: reaching the optimum. A pair only sees its own two loads, so it will
not push load "uphill" into a neighbour that is lighter than the bottleneck but would have to pass
layers further down the chain first. At a fixed point, neighbouring loads differ by at most one
layer's cost (<= the optimum ``B*``) wherever the heavier side could give a layer, which bounds
the bottleneck by about ``sqrt(2 * num_stages) * B*``; a "staircase" input attains nearly that.
``docs/balancing.md`` gives the 4-layer counterexample (gap 2x from the uniform start), the
staircase, the proof sketch and the gaps measured on random and adversarial inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynmo_hpc.balance.common import (
    CostsLike,
    check_parts,
    check_values,
    loads_from_prefix,
    prefix_sums,
)
from dynmo_hpc.balance.optimal import Chain, checked_chain
from dynmo_hpc.balance.static import uniform


def _first_crossing(prefix: list[float], a: int, c: int, lo: int, hi: int) -> int:
    """Smallest ``m`` in ``[lo, hi]`` with ``load(a, m) >= load(m, c)``; ``hi + 1`` if none.

    An integer bisection in the shared arithmetic, so ulp-level noise cannot skip the crossing.
    """
    while lo <= hi:
        mid = (lo + hi) // 2
        if prefix[mid] - prefix[a] >= prefix[c] - prefix[mid]:
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def resplit(chain: Chain, a: int, b: int, c: int) -> int:
    """The new boundary between stages ``[a, b)`` and ``[b, c)``: ``b`` unless strictly better.

    Minimises ``max(load(a, m), load(m, c))`` over ``a < m < c`` with both stages within the
    memory capacity; moves only on a strict improvement, and then to the optimal ``m`` nearest
    ``b``. Requires the current split to fit the capacity (the caller's invariant).
    """
    prefix = chain.prefix
    old_s = max(prefix[b] - prefix[a], prefix[c] - prefix[b])
    lo, hi = a + 1, c - 1
    if chain.mem_reach is not None and chain.mem_back is not None:
        lo, hi = max(lo, chain.mem_back[c]), min(hi, chain.mem_reach[a])
    cross = _first_crossing(prefix, a, c, lo, hi)
    best_s = old_s
    for m in (cross - 1, cross):
        if lo <= m <= hi:
            best_s = min(best_s, max(prefix[m] - prefix[a], prefix[c] - prefix[m]))
    if best_s >= old_s:
        return b
    # Every m in [first, last] keeps both sides <= best_s (and within memory): all are optimal.
    first = max(lo, chain.back(c, best_s))
    last = min(hi, chain.reach(a, best_s))
    return min(max(b, first), last)


def _start(
    values: list[float],
    num_stages: int,
    mem: tuple[list[float], float] | None,
    current: Sequence[int] | None,
) -> list[int]:
    """The partition diffusion starts from: ``current``, else uniform, else memory-balanced."""
    if current is not None:
        parts = check_parts(current, len(values), "current")
        if len(parts) != num_stages + 1:
            raise ValueError(
                f"current={parts} has {len(parts) - 1} stages but num_stages={num_stages}"
            )
    else:
        parts = uniform(values, num_stages)
    if mem is None:
        return parts
    mem_loads = loads_from_prefix(prefix_sums(mem[0]), parts)
    if max(mem_loads) <= mem[1]:
        return parts
    if current is not None:
        stage = max(range(num_stages), key=mem_loads.__getitem__)
        raise ValueError(
            f"current={parts} puts {mem_loads[stage]:.6g} bytes on stage {stage}, over "
            f"capacity={mem[1]:.6g}; diffusion never breaks the capacity so it needs a start "
            "that fits: use algorithm='optimal' (it repairs capacity violations)"
        )
    mem_chain = Chain(mem[0], None)
    return mem_chain.build(mem_chain.solve(num_stages), num_stages, None)


def _check_phase(phase: int, name: str) -> int:
    if isinstance(phase, bool) or phase not in (0, 1):
        raise ValueError(
            f"{name}={phase!r} must be 0 (pairs (0,1), (2,3), ...) or 1 (pairs (1,2), (3,4), ...)"
        )
    return int(phase)


def _phase(chain: Chain, parts: list[int], phase: int) -> bool:
    """Re-split every pair ``(p, p+1)`` with ``p = phase, phase + 2, ...`` in place; whether
    any boundary moved. The pairs share no stage, so their order does not matter."""
    moved = False
    for p in range(phase, len(parts) - 2, 2):
        boundary = resplit(chain, parts[p], parts[p + 1], parts[p + 2])
        if boundary != parts[p + 1]:
            parts[p + 1] = boundary
            moved = True
    return moved


def _run(
    costs: CostsLike,
    num_stages: int,
    current: Sequence[int] | None,
    memory: CostsLike | None,
    capacity: float | None,
    max_rounds: int | None,
    first_phase: int = 0,
) -> tuple[list[list[int]], Chain]:
    values, num_stages, chain, mem = checked_chain(costs, num_stages, memory, capacity)
    if max_rounds is not None and max_rounds < 0:
        raise ValueError(f"max_rounds={max_rounds} must be >= 0 (or None for no cap)")
    first_phase = _check_phase(first_phase, "first_phase")
    parts = _start(values, num_stages, mem, current)
    trace = [parts.copy()]
    rounds = 0
    while max_rounds is None or rounds < max_rounds:
        rounds += 1
        moved_in_round = False
        for phase in (first_phase, 1 - first_phase):
            if _phase(chain, parts, phase):
                trace.append(parts.copy())
                moved_in_round = True
        if not moved_in_round:
            break
    return trace, chain


def diffusion_step(
    costs: CostsLike,
    current: Sequence[int],
    *,
    phase: int,
    memory: CostsLike | None = None,
    capacity: float | None = None,
) -> list[int]:
    """One phase from ``current``: pairs ``(phase, phase+1), (phase+2, phase+3), ...`` re-split.

    Why a single phase: it is what neighbouring stages can do between two training steps with
    only each other's costs, and every layer it moves goes to a neighbouring stage (no layer
    crosses two stages at once). Returns ``current`` when no pair of that parity gains; applying
    the same phase twice moves nothing the second time. ``current`` must fit ``capacity``.

    Example: ``diffusion_step([3, 1, 1, 1], [0, 2, 3, 4], phase=0) == [0, 1, 3, 4]`` (loads 4, 1,
    1 become 3, 2, 1); with ``phase=1`` the pair (1, 2) cannot gain and nothing moves.
    """
    parts = check_parts(current, len(check_values(costs)), "current")
    num_stages = len(parts) - 1
    values, num_stages, chain, mem = checked_chain(costs, num_stages, memory, capacity)
    parts = _start(values, num_stages, mem, parts)
    _phase(chain, parts, _check_phase(phase, "phase"))
    return parts


def diffusion_trace(
    costs: CostsLike,
    num_stages: int,
    *,
    current: Sequence[int] | None = None,
    memory: CostsLike | None = None,
    capacity: float | None = None,
    max_rounds: int | None = None,
    first_phase: int = 0,
) -> list[list[int]]:
    """Every partition diffusion passes through: the start, then one per phase that moved layers.

    The start is ``current``, else the uniform split (else, if that breaks the memory capacity,
    the memory-balanced split). ``max_rounds`` caps the rounds (``None``: run to the fixed point,
    which always exists, see the module docstring). ``first_phase`` (0 or 1) is the parity each
    round starts with. Consecutive entries differ only by moves between neighbouring stages: each
    is one :func:`diffusion_step` of the one before.
    """
    return _run(costs, num_stages, current, memory, capacity, max_rounds, first_phase)[0]


def diffusion(
    costs: CostsLike,
    num_stages: int,
    *,
    current: Sequence[int] | None = None,
    memory: CostsLike | None = None,
    capacity: float | None = None,
    max_rounds: int | None = None,
    rel_tol: float = 1e-12,
) -> list[int]:
    """The fixed point of neighbour-only re-splitting (see the module docstring).

    Returns ``current`` unchanged when diffusion cannot lower its bottleneck by more than
    ``rel_tol`` (relative): smoothing loads that do not set the pace is not worth a migration.

    Example: ``diffusion([0, 1, 1, 1], 3) == [0, 1, 2, 4]`` (loads 0, 1, 2). The optimum is
    ``[0, 2, 3, 4]`` (loads 1, 1, 1), but reaching it needs stage 1 to take layer 1 from stage 0
    *and* pass its own layer to stage 2 in one step; each pair alone sees no gain.
    """
    trace, chain = _run(costs, num_stages, current, memory, capacity, max_rounds)
    if current is None or len(trace) == 1:
        return trace[-1]
    prefix = chain.prefix
    before_s = max(loads_from_prefix(prefix, trace[0]))
    after_s = max(loads_from_prefix(prefix, trace[-1]))
    return trace[-1] if after_s < before_s * (1.0 - rel_tol) else trace[0]
