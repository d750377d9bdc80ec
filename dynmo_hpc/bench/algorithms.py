"""The runs a bench makes: each algorithm's job overrides, and the interleaved order they go in.

What is compared comes from :data:`dynmo_hpc.balance.ALGORITHMS`: every entry, in its table
order (the static baselines, then DynMo's balancers), labelled with its ``label``.

Why interleave: this machine is shared, and its speed drifts by tens of percent over minutes.
Runs of one scheme under each algorithm go back to back, and the order rotates from one repeat
to the next, so drift and warm-up affect every algorithm alike instead of favouring whichever
ran in a quiet spell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynmo_hpc.balance import INITIAL_ALGORITHM, STATIC, BalanceState, partition
from dynmo_hpc.balance.registry import lookup


def algorithm_overrides(
    algorithm: str,
    num_stages: int,
    layer_params: Sequence[int],
    costs_s: Sequence[float] | None = None,
) -> list[str]:
    """The ``--set`` overrides that make a job run under ``algorithm``.

    A static baseline (``rebalances=False``) fixes its split at the start and never moves a
    layer (``balance.algorithm=static``); its split is computed from the layers as built, so
    ``parameters`` balances the parameter counts of experts, pruned widths and all, which is
    DeepSpeed's default ``partition_method``. :data:`~dynmo_hpc.balance.INITIAL_ALGORITHM`'s
    split is the trainer's own default (``pipeline.partition=null``). A rebalancing algorithm
    starts from that default, as a Megatron user would, and re-partitions from measured costs.
    """
    entry = lookup(algorithm)
    if entry.rebalances:
        return [f"balance.algorithm={algorithm}", "pipeline.partition=null"]
    if algorithm == INITIAL_ALGORITHM:
        return [f"balance.algorithm={STATIC}", "pipeline.partition=null"]
    parts = static_split(algorithm, num_stages, layer_params, costs_s)
    return [f"balance.algorithm={STATIC}", f"pipeline.partition=[{', '.join(map(str, parts))}]"]


def static_split(
    algorithm: str,
    num_stages: int,
    layer_params: Sequence[int],
    costs_s: Sequence[float] | None = None,
) -> list[int]:
    """The split a static baseline fixes at the start: computed once from the layers as built
    (``layer_params`` for the options that need parameter counts) and, for a ``profiled``
    baseline, from ``costs_s``, the per-layer seconds a profiling run measured (required)."""
    entry = lookup(algorithm)
    if entry.profiled:
        if costs_s is None or len(costs_s) != len(layer_params):
            raise ValueError(
                f"{algorithm} places layers by measured costs: need one cost per layer "
                f"({len(layer_params)}), got {None if costs_s is None else len(costs_s)}"
            )
        costs = [float(c) for c in costs_s]
    else:
        costs = [1.0] * len(layer_params)
    state = BalanceState(
        parts=partition(costs, num_stages, INITIAL_ALGORITHM),
        num_params=list(layer_params),
        layer_bytes=[0] * len(layer_params),
    )
    return partition(costs, num_stages, algorithm, **entry.trainer_options(state))


def shared_splits(splits: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Static baseline -> the baseline whose runs it reports: the first one, in ``splits``'
    order, with the same split (itself when none before it has). Two names with one split
    train the same job, so the bench runs it once and reports it under both.

    Example: ``shared_splits({"uniform": [0, 9, 18], "megatron": [0, 9, 18],
    "parameters": [0, 8, 18]}) == {"uniform": "uniform", "megatron": "uniform",
    "parameters": "parameters"}``.
    """
    first: dict[tuple[int, ...], str] = {}
    out = {}
    for name, parts in splits.items():
        out[name] = first.setdefault(tuple(int(p) for p in parts), name)
    return out


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the bench."""

    repeat: int
    scheme: str
    algorithm: str

    @property
    def name(self) -> str:
        """The run's job name (and run directory name)."""
        return f"bench_{self.scheme}_{self.algorithm}_r{self.repeat}"


def run_order(schemes: Sequence[str], algorithms: Sequence[str], repeats: int) -> list[PlannedRun]:
    """Every run, interleaved: repeat by repeat, scheme by scheme, the algorithms rotated.

    Example: with algorithms ``a b c d``, repeat 0 runs ``a b c d`` and repeat 1 runs
    ``b c d a``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if not schemes or not algorithms:
        raise ValueError("need at least one scheme and one algorithm")
    order: list[PlannedRun] = []
    for repeat in range(repeats):
        shift = repeat % len(algorithms)
        rotated = [*algorithms[shift:], *algorithms[:shift]]
        for scheme in schemes:
            order.extend(PlannedRun(repeat, scheme, algorithm) for algorithm in rotated)
    return order
