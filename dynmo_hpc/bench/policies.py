"""The four policies a bench compares, and the interleaved order their runs go in.

Why interleave: this machine is shared, and its speed drifts by tens of percent over minutes. Runs
of one scheme under the four policies go back to back, and the order of the four rotates from one
repeat to the next, so drift and warm-up affect every policy alike instead of favouring whichever
ran in a quiet spell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynmo_hpc.balance import partition


@dataclass(frozen=True)
class Policy:
    """One way to place layers on stages for the whole run."""

    name: str
    """Short key used in file names, tables and ``--policies``."""
    label: str
    """What it stands for, in words."""
    dynamic: bool
    """True: DynMo re-partitions from measured costs while training."""


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("uniform", "static uniform (Megatron-LM)", dynamic=False),
        Policy("parameters", "static by parameters (DeepSpeed)", dynamic=False),
        Policy("optimal", "DynMo optimal", dynamic=True),
        Policy("diffusion", "DynMo diffusion", dynamic=True),
    )
}
"""The policies in table order: the two static baselines, then DynMo's two balancers."""

STATIC = ("uniform", "parameters")
DYNAMIC = ("optimal", "diffusion")


def policy_overrides(policy: str, num_stages: int, layer_params: Sequence[int]) -> list[str]:
    """The ``--set`` overrides that make a job run under ``policy``.

    The static policies fix the partition at the start and never move a layer (``static``);
    ``parameters`` balances the parameter counts of the layers as built (experts, pruned widths
    and all), which is DeepSpeed's default ``partition_method``. The dynamic ones start from the
    uniform split, as a Megatron user would, and re-partition from measured costs.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy == "uniform":
        return ["balance.algorithm=static", "pipeline.partition=null"]
    if policy == "parameters":
        costs = [1.0] * len(layer_params)
        parts = partition(costs, num_stages, "parameters", params=list(layer_params))
        return ["balance.algorithm=static", f"pipeline.partition=[{', '.join(map(str, parts))}]"]
    return [f"balance.algorithm={policy}", "pipeline.partition=null"]


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the bench."""

    repeat: int
    scheme: str
    policy: str

    @property
    def name(self) -> str:
        """The run's job name (and run directory name)."""
        return f"bench_{self.scheme}_{self.policy}_r{self.repeat}"


def run_order(schemes: Sequence[str], policies: Sequence[str], repeats: int) -> list[PlannedRun]:
    """Every run, interleaved: repeat by repeat, scheme by scheme, the policies rotated.

    Example: with policies ``a b c d``, repeat 0 runs ``a b c d`` and repeat 1 runs ``b c d a``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if not schemes or not policies:
        raise ValueError("need at least one scheme and one policy")
    order: list[PlannedRun] = []
    for repeat in range(repeats):
        shift = repeat % len(policies)
        rotated = [*policies[shift:], *policies[:shift]]
        for scheme in schemes:
            order.extend(PlannedRun(repeat, scheme, policy) for policy in rotated)
    return order
