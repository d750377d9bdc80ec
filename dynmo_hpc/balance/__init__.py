"""Pipeline balancing as pure functions: costs in, partition out; no MPI, no torch, no clock.

Why pure: the balancer runs on rank 0 between training steps, but everything it decides is a
function of a few lists of numbers. Keeping it free of communication makes every rule testable in
milliseconds against brute force, and lets ``dynmo-hpc plan`` answer "what would it do?" offline.

Entry point: :func:`partition` with one of :data:`ALGORITHMS`

- ``"uniform"``: equal layer counts (Megatron-LM); ignores costs.
- ``"parameters"``: min-max over per-layer parameter counts given as ``params=`` (DeepSpeed's
  default); ``costs`` stays in seconds and does not affect the split.
- ``"optimal"``: the exact minimum of the heaviest stage's cost (chains-on-chains), optionally
  under ``memory=`` (bytes per layer) and ``capacity=`` (bytes per stage).
- ``"diffusion"``: neighbouring stages re-split their boundary until no pair gains; monotone,
  terminating, but not always optimal (see :mod:`.diffusion` and ``docs/balancing.md``);
  :func:`diffusion_step` is one phase of it, what the trainer enacts per decision.

Every algorithm keeps layers in global order with one contiguous, non-empty range per stage,
rejects more stages than layers with a ValueError, and (``optimal``, ``diffusion``) returns
``current=`` unchanged when it cannot do better. Then :func:`plan_moves` lists the migration and
:func:`should_rebalance` decides whether it pays (:func:`should_follow` for a path of hops).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from dynmo_hpc.balance.common import CostsLike, bottleneck, stage_loads
from dynmo_hpc.balance.decision import Decision, rank_bytes, should_follow, should_rebalance
from dynmo_hpc.balance.diffusion import diffusion, diffusion_step, diffusion_trace
from dynmo_hpc.balance.moves import Move, plan_moves
from dynmo_hpc.balance.optimal import min_capacity, optimal, optimal_bottleneck
from dynmo_hpc.balance.static import parameters, uniform

#: Algorithm name -> function ``(costs, num_stages, **options) -> parts``.
ALGORITHMS: dict[str, Callable[..., list[int]]] = {
    "uniform": uniform,
    "parameters": parameters,
    "optimal": optimal,
    "diffusion": diffusion,
}


def algorithm_options(algorithm: str) -> list[str]:
    """The keyword options ``algorithm`` accepts, e.g. ``["current", "memory", ...]``."""
    function = _lookup(algorithm)
    return [
        name
        for name, param in inspect.signature(function).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def _lookup(algorithm: str) -> Callable[..., list[int]]:
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid algorithms: {', '.join(ALGORITHMS)}"
        ) from None


def partition(
    costs: CostsLike,
    num_stages: int,
    algorithm: str = "optimal",
    **options: object,
) -> list[int]:
    """Stage boundaries ``parts`` for ``costs`` (seconds per layer per step) on ``num_stages``.

    Returns ``num_stages + 1`` strictly increasing boundaries with ``parts[0] == 0`` and
    ``parts[-1] == len(costs)``; stage ``p`` runs layers ``parts[p] .. parts[p+1]-1``. An option
    the algorithm does not take is a ValueError listing those it does.

    Example: ``partition([0, 1.1, 30, 3], 3) == [0, 2, 3, 4]``.
    """
    function = _lookup(algorithm)
    valid = algorithm_options(algorithm)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"algorithm {algorithm!r} does not take option(s) {', '.join(unknown)}; "
            f"valid options: {', '.join(valid) if valid else 'none'}"
        )
    required = [
        name
        for name, param in inspect.signature(function).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is inspect.Parameter.empty
    ]
    missing = [name for name in required if name not in options]
    if missing:
        raise ValueError(
            f"algorithm {algorithm!r} needs option(s) {', '.join(missing)}, e.g. "
            f"partition(costs, num_stages, {algorithm!r}, {missing[0]}=[one value per layer])"
        )
    return function(costs, num_stages, **options)


__all__ = [
    "ALGORITHMS",
    "Decision",
    "Move",
    "algorithm_options",
    "bottleneck",
    "diffusion",
    "diffusion_step",
    "diffusion_trace",
    "min_capacity",
    "optimal",
    "optimal_bottleneck",
    "parameters",
    "partition",
    "plan_moves",
    "rank_bytes",
    "should_follow",
    "should_rebalance",
    "stage_loads",
    "uniform",
]
