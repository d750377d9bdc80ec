"""The balancing algorithms by name: the one place an algorithm is declared.

Why a registry: the config (``balance.algorithm``), the trainer's decision at a load report
(:func:`dynmo_hpc.train.rebalance.decide`), ``dynmo-hpc plan``, ``dynmo-hpc simulate`` and the
bench all need the same facts about an algorithm: its function, the options it takes, what it is
told at a load report, whether it re-runs while training, and how its proposal is judged. Each
reads them from :data:`ALGORITHMS`, so adding an algorithm is one :class:`Algorithm` entry and
nothing else.

Vocabulary: an *algorithm* (or balancer) is an entry here; ``static`` is not one, it is the
``balance.algorithm`` value that turns rebalancing off. The elastic *pack policy*
(``elastic.policy``) is a different thing: the rule :mod:`dynmo_hpc.balance.packing` uses to
choose a smaller stage count.

Pure: no config, no MPI; the config layer passes its settings as a mapping.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynmo_hpc.balance.common import CostsLike, stage_loads
from dynmo_hpc.balance.diffusion import diffusion, diffusion_trace
from dynmo_hpc.balance.optimal import optimal
from dynmo_hpc.balance.static import megatron, parameters, uniform

STATIC = "static"
"""The ``balance.algorithm`` value that never moves a layer (not an algorithm: no entry)."""
INITIAL_ALGORITHM = "uniform"
"""The trainer's first partition without ``pipeline.partition``: where a rebalancing algorithm
starts in the simulator and the bench, as in a real run."""


@dataclass(frozen=True, kw_only=True)
class BalanceState:
    """What rank 0 knows at a load report besides the costs: an algorithm's options come from it.

    ``layer_bytes`` per layer is what migration moves (weights, gradients, optimizer state); it
    is also the per-layer memory that ``balance.capacity_bytes`` caps.
    """

    parts: list[int]
    """The partition in force."""
    num_params: list[int]
    """Parameters per layer."""
    layer_bytes: list[int]
    """Bytes per layer that migration moves and the capacity is checked against."""
    capacity_bytes: float | None = None
    """``balance.capacity_bytes``: the per-stage cap, or None."""
    report_index: int = 0
    """Load reports before this one (diffusion alternates its phase parity with it)."""

    def memory_options(self) -> dict[str, Any]:
        """``memory=`` and ``capacity=`` when a capacity is set, else nothing."""
        if self.capacity_bytes is None:
            return {}
        return {"memory": self.layer_bytes, "capacity": self.capacity_bytes}


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """An algorithm's answer at a load report, before the decision rule judges it."""

    path: list[list[int]] = field(default_factory=list)
    """Partitions to walk, one per decision: the start (the partition in force) then each hop.
    A whole-partition algorithm's path is ``[parts, candidate]``. Empty: nothing proposed."""
    keep_reason: str = ""
    """Why nothing is proposed (only when ``path`` is empty)."""


def _no_options(state: BalanceState) -> dict[str, Any]:
    return {}


def _no_check(settings: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """One balancing algorithm and everything the rest of the package needs to know about it."""

    function: Callable[..., list[int]]
    """``(costs, num_stages, **options) -> parts``; its keyword-only parameters are the options
    it takes (:func:`dynmo_hpc.balance.algorithm_options`)."""
    label: str
    """What it stands for, in words (tables, ``--help``)."""
    rebalances: bool = True
    """True: re-run from measured costs at every load report (a DynMo balancer; the simulator
    and the bench start it from :data:`INITIAL_ALGORITHM`'s split). False: a static baseline,
    computed once at the start and never re-run (the bench runs it as ``balance.algorithm:
    static`` with ``pipeline.partition`` set to its split)."""
    trainer_options: Callable[[BalanceState], dict[str, Any]] = _no_options
    """The options the trainer passes at a load report, from what it knows then."""
    propose_path: Callable[[Sequence[float], BalanceState], Proposal] | None = None
    """None: the algorithm proposes one whole partition, judged by
    :func:`~dynmo_hpc.balance.should_rebalance`. Otherwise it proposes a path walked one hop
    per decision, judged by :func:`~dynmo_hpc.balance.should_follow` (diffusion's phases)."""
    check_settings: Callable[[Mapping[str, Any]], None] = _no_check
    """Validates the job's ``balance`` section (as a mapping of its fields) for this algorithm;
    raises ValueError saying what was expected, what was found, and a HINT."""
    profiled: bool = False
    """A static baseline placed from measured costs (``profiled``): the bench measures them in a
    short profiling run first; the trainer places it at the first load report."""
    benched: bool = True
    """Whether ``dynmo-hpc bench`` runs it when ``--algorithms`` is not given (False for an
    entry kept for ``plan`` and the simulator only). Two static baselines that place a job's
    layers alike cost one set of runs either way: the bench runs the split once and reports it
    under both names (:func:`dynmo_hpc.bench.algorithms.shared_splits`)."""


def _optimal_options(state: BalanceState) -> dict[str, Any]:
    return {"current": state.parts, **state.memory_options()}


def _parameters_options(state: BalanceState) -> dict[str, Any]:
    return {"params": state.num_params}


def _diffusion_path(costs_s: Sequence[float], state: BalanceState) -> Proposal:
    """The path to diffusion's fixed point from the partition in force, starting with the phase
    parity of the report index, so successive decisions walk it one phase at a time (every layer
    moves at most one stage per migration). A partition over the capacity is kept: diffusion
    never crosses the capacity, nor repairs it."""
    parts = state.parts
    cap = state.capacity_bytes
    if cap is not None:
        loads = stage_loads(state.layer_bytes, parts)
        stage = max(range(len(loads)), key=loads.__getitem__)
        if loads[stage] > cap:
            return Proposal(
                keep_reason=f"stage {stage} holds {loads[stage]:.6g} bytes > "
                f"balance.capacity_bytes={cap:.6g}: diffusion never breaks the capacity, nor "
                "repairs it (balance.algorithm=optimal does)"
            )
    path = diffusion_trace(
        list(costs_s),
        len(parts) - 1,
        current=parts,
        first_phase=state.report_index % 2,
        **state.memory_options(),
    )
    return Proposal(path=path)


ALGORITHMS: dict[str, Algorithm] = {
    "uniform": Algorithm(
        function=uniform,
        label="Megatron-LM, embedding and loss counted as layers",
        rebalances=False,
    ),
    "megatron": Algorithm(
        function=megatron,
        label="Megatron-LM (even blocks)",
        rebalances=False,
    ),
    "parameters": Algorithm(
        function=parameters,
        label="DeepSpeed (balanced parameter counts)",
        rebalances=False,
        trainer_options=_parameters_options,
    ),
    "profiled": Algorithm(
        function=optimal,
        label="profiled once (the best split for the first steps' measured costs)",
        rebalances=False,
        trainer_options=_optimal_options,
        profiled=True,
    ),
    "optimal": Algorithm(function=optimal, label="DynMo optimal", trainer_options=_optimal_options),
    "diffusion": Algorithm(
        function=diffusion, label="DynMo diffusion", propose_path=_diffusion_path
    ),
}
"""Algorithm name -> :class:`Algorithm`, in table order: the static baselines, then DynMo's
balancers."""


def lookup(algorithm: str) -> Algorithm:
    """The entry named ``algorithm``; ValueError listing the valid names otherwise."""
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; valid algorithms: {', '.join(ALGORITHMS)}"
        ) from None


def config_algorithms() -> tuple[str, ...]:
    """The values ``balance.algorithm`` accepts: :data:`STATIC` and every algorithm."""
    return (STATIC, *ALGORITHMS)


def static_baselines() -> tuple[str, ...]:
    """Algorithms computed once and never re-run, in table order."""
    return tuple(name for name, entry in ALGORITHMS.items() if not entry.rebalances)


def rebalancing() -> tuple[str, ...]:
    """Algorithms re-run at every load report, in table order."""
    return tuple(name for name, entry in ALGORITHMS.items() if entry.rebalances)


def bench_algorithms() -> tuple[str, ...]:
    """What ``dynmo-hpc bench`` runs by default, in table order (:attr:`Algorithm.benched`)."""
    return tuple(name for name, entry in ALGORITHMS.items() if entry.benched)


def algorithm_options(algorithm: str) -> list[str]:
    """The keyword options ``algorithm`` accepts, e.g. ``["current", "memory", ...]``."""
    return [
        name
        for name, param in inspect.signature(lookup(algorithm).function).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    ]


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
    function = lookup(algorithm).function
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


def propose(algorithm: str, costs_s: Sequence[float], state: BalanceState) -> Proposal:
    """What ``algorithm`` proposes at a load report: its path (``propose_path``), else
    ``[parts, its partition with the trainer's options]``."""
    entry = lookup(algorithm)
    if entry.propose_path is not None:
        return entry.propose_path(costs_s, state)
    options = entry.trainer_options(state)
    candidate = partition(costs_s, len(state.parts) - 1, algorithm, **options)
    return Proposal(path=[list(state.parts), candidate])


def check_balance_settings(settings: Mapping[str, Any]) -> None:
    """Validate a ``balance`` section (its fields as a mapping) against the registry: the
    algorithm is :data:`STATIC` or an entry, and the entry's own check passes. ValueError
    otherwise, naming the key."""
    name = settings.get("algorithm")
    if name == STATIC:
        return
    if name not in ALGORITHMS:
        raise ValueError(
            f"balance.algorithm={name!r} is not valid; choose one of {list(config_algorithms())}"
        )
    ALGORITHMS[name].check_settings(settings)
