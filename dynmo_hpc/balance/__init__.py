"""Pipeline balancing as pure functions: costs in, partition out; no MPI, no torch, no clock.

Why pure: the balancer runs on rank 0 between training steps, but everything it decides is a
function of a few lists of numbers. Keeping it free of communication makes every rule testable in
milliseconds against brute force, and lets ``dynmo-hpc plan`` answer "what would it do?" offline.

Entry point: :func:`partition` with one of :data:`ALGORITHMS` (:mod:`.registry`, the one place
an algorithm is declared: its function, options, trainer inputs and config check):

- ``"uniform"``: equal counts of all layers (the trainer's default split; Megatron-LM with the
  embedding and the loss counted as layers); ignores costs.
- ``"megatron"``: Megatron-LM's default placement: blocks split evenly, the embedding on the
  first stage and the head on the last, the edge stages taking fewer blocks when they do not
  divide.
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

from dynmo_hpc.balance.common import bottleneck, stage_loads
from dynmo_hpc.balance.decision import Decision, rank_bytes, should_follow, should_rebalance
from dynmo_hpc.balance.diffusion import diffusion, diffusion_step, diffusion_trace
from dynmo_hpc.balance.moves import Move, plan_moves
from dynmo_hpc.balance.optimal import min_capacity, optimal, optimal_bottleneck
from dynmo_hpc.balance.registry import (
    ALGORITHMS,
    INITIAL_ALGORITHM,
    STATIC,
    Algorithm,
    BalanceState,
    Proposal,
    algorithm_options,
    partition,
    propose,
)
from dynmo_hpc.balance.static import parameters, uniform

__all__ = [
    "ALGORITHMS",
    "INITIAL_ALGORITHM",
    "STATIC",
    "Algorithm",
    "BalanceState",
    "Decision",
    "Move",
    "Proposal",
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
    "propose",
    "rank_bytes",
    "should_follow",
    "should_rebalance",
    "stage_loads",
    "uniform",
]
