"""Scheme sections: one optional sub-section per dynamic scheme under ``schemes:`` (absent = off).

Layer lists name global layer indices of blocks (1..num_blocks; 0 is the embedding and
num_blocks + 1 the head), so they mean the same thing on any partition.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from dynmo_hpc.config.bounds import (
    MAX_CAPACITY_FACTOR,
    MAX_EXPERTS,
    MAX_LOSS_WEIGHT,
    MAX_STEPS,
    MAX_WIDTH,
    at_most,
)
from dynmo_hpc.config.sections import ModelSection
from dynmo_hpc.errors import ConfigError


def _check_block_layers(key: str, layers: list[int] | None, num_blocks: int) -> None:
    """Scheme layer lists name global layer indices of blocks: 1..num_blocks."""
    if layers is None:
        return
    if not layers:
        raise ConfigError(f"{key}=[] selects no block; list block indices or use null for all")
    bad = [i for i in layers if not 1 <= i <= num_blocks]
    if bad:
        raise ConfigError(
            f"{key} has {bad} outside the blocks 1..{num_blocks} (0 is the embedding, "
            f"{num_blocks + 1} the head); list global layer indices of blocks"
        )
    if len(set(layers)) != len(layers) or sorted(layers) != layers:
        raise ConfigError(f"{key}={layers} must be strictly increasing, without repeats")


def _num_selected(layers: list[int] | None, default: list[int]) -> int:
    return len(layers) if layers is not None else len(default)


def every_other_block(num_blocks: int) -> list[int]:
    """Blocks 2, 4, ...: the Mixture-of-Depths default (Raposo et al. route every other block)."""
    return list(range(2, num_blocks + 1, 2)) or [1]


@dataclass(frozen=True, kw_only=True)
class MoESection:
    layers: list[int] | None = None
    """Global layer indices (1..num_blocks) of blocks whose feed-forward is a mixture of
    experts; null = every block."""
    num_experts: int = 4
    """Experts per MoE block (E)."""
    top_k: int = 2
    """Experts each token is routed to (k <= E)."""
    capacity_factor: float = 1.25
    """Expert capacity = ceil(capacity_factor * top_k * tokens / num_experts), where tokens is
    the number of tokens the block sees in one microbatch."""
    overflow: Literal["drop", "reroute"] = "drop"
    """Assignments over an expert's capacity: drop (the residual carries the token) or reroute to
    the token's next-ranked expert that still has room (dropped only when none has)."""
    dispatch: Literal["gather", "padded"] = "gather"
    """How experts compute: gather (each expert runs on exactly its routed rows) or padded (every
    expert runs on as many rows as the busiest expert serves, its own rows plus zero padding, as
    a batched (E, capacity, C) dispatch with capacity set to the largest load computes, e.g.
    DeepSpeed-MoE without token dropping). Padded, a block's cost is proportional to its busiest
    expert's load, as its time is under expert parallelism. Routing and outputs are the same."""
    d_ff_expert: int | None = None
    """Hidden width of each expert; null = the block's dense width (model.d_ff / layer_d_ff)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss E * sum_e f_e * P_e added per MoE block."""

    def validate(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"schemes.moe.top_k={self.top_k}, num_experts={self.num_experts}: "
                "need 1 <= top_k <= num_experts"
            )
        if self.capacity_factor <= 0:
            raise ConfigError(
                f"schemes.moe.capacity_factor={self.capacity_factor} must be > 0 "
                "(1.0 = exactly an even share per expert)"
            )
        if self.d_ff_expert is not None and self.d_ff_expert < 1:
            raise ConfigError(f"schemes.moe.d_ff_expert={self.d_ff_expert} must be >= 1 or null")
        if self.aux_loss_weight < 0:
            raise ConfigError(f"schemes.moe.aux_loss_weight={self.aux_loss_weight} must be >= 0")
        at_most("schemes.moe.num_experts", self.num_experts, MAX_EXPERTS, "a typo? try 8")
        at_most(
            "schemes.moe.capacity_factor",
            self.capacity_factor,
            MAX_CAPACITY_FACTOR,
            "num_experts / top_k already fits every token; try 1.25",
        )
        if self.d_ff_expert is not None:
            at_most("schemes.moe.d_ff_expert", self.d_ff_expert, MAX_WIDTH, "a typo? try 512")
        at_most(
            "schemes.moe.aux_loss_weight",
            self.aux_loss_weight,
            MAX_LOSS_WEIGHT,
            "it would drown the language-model loss; try 0.01",
        )

    def validate_for(self, model: ModelSection) -> None:
        _check_block_layers("schemes.moe.layers", self.layers, model.num_blocks)


PRUNING_SCOPES = ("global", "layer")
"""``schemes.pruning.scope`` values: where the magnitude ranking runs."""


@dataclass(frozen=True, kw_only=True)
class PruningSection:
    final_sparsity: float = 0.75
    """Fraction of the prunable structures (feed-forward neurons, attention heads) removed by
    end_step (s_f in Zhu & Gupta 2017)."""
    initial_sparsity: float = 0.0
    """Sparsity of the first pruning step at start_step (s_i)."""
    start_step: int = 0
    """First optimizer step after which pruning runs (t_0)."""
    end_step: int = 40
    """Step at which the final sparsity is reached (t_0 + n * interval_steps)."""
    interval_steps: int = 5
    """Steps between pruning events (delta t)."""
    layers: list[int] | None = None
    """Blocks that may be pruned (global indices 1..num_blocks); null = every block."""
    prune_heads: bool = True
    """Prune whole attention heads (global ranking of heads by weight magnitude)."""
    prune_neurons: bool = True
    """Prune whole feed-forward neurons, experts' included (global ranking of neurons)."""
    min_heads: int = 1
    """Heads every pruned block keeps."""
    min_neurons: int = 1
    """Neurons every feed-forward (or expert) keeps."""
    scope: str = "global"
    """``global``: one magnitude ranking per kind across every eligible block (each block's
    sparsity emerges from its weights); ``layer``: every block pruned to the target sparsity by
    its own ranking."""

    def validate(self) -> None:
        if self.scope not in PRUNING_SCOPES:
            raise ConfigError(
                f"schemes.pruning.scope={self.scope!r}: choose one of {', '.join(PRUNING_SCOPES)}"
            )
        if not 0.0 <= self.initial_sparsity <= self.final_sparsity < 1.0:
            raise ConfigError(
                f"schemes.pruning.initial_sparsity={self.initial_sparsity}, "
                f"final_sparsity={self.final_sparsity}: need 0 <= initial <= final < 1"
            )
        if self.start_step < 0 or self.interval_steps < 1 or self.end_step < self.start_step:
            raise ConfigError(
                f"schemes.pruning.start_step={self.start_step}, end_step={self.end_step}, "
                f"interval_steps={self.interval_steps}: need 0 <= start_step <= end_step and "
                "interval_steps >= 1"
            )
        if (self.end_step - self.start_step) % self.interval_steps:
            raise ConfigError(
                f"schemes.pruning: end_step({self.end_step}) - start_step({self.start_step}) "
                f"is not a multiple of interval_steps({self.interval_steps}); the schedule "
                "reaches final_sparsity at start_step + n * interval_steps"
            )
        if not (self.prune_heads or self.prune_neurons):
            raise ConfigError(
                "schemes.pruning: prune_heads and prune_neurons are both false; enable one "
                "or remove the pruning section"
            )
        if self.min_heads < 1 or self.min_neurons < 1:
            raise ConfigError(
                f"schemes.pruning.min_heads={self.min_heads}, min_neurons={self.min_neurons}: "
                "both must be >= 1; HINT: a block keeps at least one head and one neuron"
            )
        at_most("schemes.pruning.end_step", self.end_step, MAX_STEPS, "a step index")

    def validate_for(self, model: ModelSection) -> None:
        _check_block_layers("schemes.pruning.layers", self.layers, model.num_blocks)
        heads, what = (
            (model.kv_heads, "key/value groups (llama prunes whole groups)")
            if model.arch == "llama"
            else (model.num_heads, "heads")
        )
        if self.min_heads > heads:
            raise ConfigError(
                f"schemes.pruning.min_heads({self.min_heads}) > the {heads} {what} of a block "
                "(model.num_heads); lower min_heads"
            )


@dataclass(frozen=True, kw_only=True)
class FreezingSection:
    threshold: float = 0.05
    """A layer has converged when its gradient norm changed by less than this fraction between
    two checks (AutoFreeze's criterion)."""
    interval_steps: int = 5
    """Steps between convergence checks."""
    start_step: int = 10
    """No layer freezes before this many steps have run."""
    max_layers_per_check: int = 1
    """At most this many more layers join the frozen prefix per check."""
    max_frozen_layers: int | None = None
    """Cap on the frozen prefix length; null = every layer but the head."""

    def validate(self) -> None:
        if self.threshold < 0 or self.interval_steps < 1 or self.start_step < 0:
            raise ConfigError(
                f"schemes.freezing.threshold={self.threshold}, interval_steps="
                f"{self.interval_steps}, start_step={self.start_step}: need threshold >= 0, "
                "interval_steps >= 1, start_step >= 0"
            )
        if self.max_layers_per_check < 1:
            raise ConfigError(
                f"schemes.freezing.max_layers_per_check={self.max_layers_per_check} must be >= 1"
            )
        at_most("schemes.freezing.start_step", self.start_step, MAX_STEPS, "a step index")
        at_most("schemes.freezing.interval_steps", self.interval_steps, MAX_STEPS, "a step count")
        if self.max_frozen_layers is not None and self.max_frozen_layers < 0:
            raise ConfigError(
                f"schemes.freezing.max_frozen_layers={self.max_frozen_layers} must be >= 0"
            )

    def validate_for(self, model: ModelSection) -> None:
        n = model.num_blocks
        if self.max_frozen_layers is not None and self.max_frozen_layers > n + 1:
            raise ConfigError(
                f"schemes.freezing.max_frozen_layers({self.max_frozen_layers}) > "
                f"model.num_blocks + 1 ({n + 1}); the head never freezes"
            )


@dataclass(frozen=True, kw_only=True)
class SparseAttentionSection:
    block_size: int = 16
    """Tokens per attention block; must divide model.seq_len."""
    density: float = 0.5
    """Fraction of the causal key blocks each query block keeps (its own block always counts)."""
    layer_density: list[float] | None = None
    """One density per selected block (per entry of layers, or per block when layers is null);
    overrides density."""
    layers: list[int] | None = None
    """Blocks with sparse attention (global indices 1..num_blocks); null = every block."""
    drift_factor: float = 1.0
    """Every layer's density is multiplied by a factor moving linearly from 1 at
    drift_start_step to drift_factor at drift_end_step (1 = no drift)."""
    drift_start_step: int = 0
    """Step at which the density starts to drift."""
    drift_end_step: int = 0
    """Step at which the drift reaches drift_factor."""
    initial_density: float | None = None
    """Density every selected layer starts at instead of its own; it then moves linearly to the
    layer's own density x drift_factor between drift_start_step and drift_end_step (e.g. 1.0: a
    dense start that sparsifies to per-layer densities); null = start at the layer's own."""

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"schemes.sparse_attention.block_size={self.block_size} must be >= 1")
        densities = [self.density, *(self.layer_density or [])]
        if self.initial_density is not None:
            densities.append(self.initial_density)
        if any(not 0.0 < d <= 1.0 for d in densities):
            raise ConfigError(f"schemes.sparse_attention densities {densities} must be in (0, 1]")
        at_most("schemes.sparse_attention.drift_end_step", self.drift_end_step, MAX_STEPS, "a step")
        if self.drift_factor <= 0 or not 0 <= self.drift_start_step <= self.drift_end_step:
            raise ConfigError(
                f"schemes.sparse_attention.drift_factor={self.drift_factor}, drift_start_step="
                f"{self.drift_start_step}, drift_end_step={self.drift_end_step}: need "
                "drift_factor > 0 and 0 <= drift_start_step <= drift_end_step"
            )

    def validate_for(self, model: ModelSection) -> None:
        _check_block_layers("schemes.sparse_attention.layers", self.layers, model.num_blocks)
        if model.seq_len % self.block_size:
            raise ConfigError(
                f"model.seq_len({model.seq_len}) % schemes.sparse_attention.block_size"
                f"({self.block_size}) != 0; choose a block size dividing seq_len"
            )
        count = _num_selected(self.layers, list(range(1, model.num_blocks + 1)))
        if self.layer_density is not None and len(self.layer_density) != count:
            raise ConfigError(
                f"schemes.sparse_attention.layer_density has {len(self.layer_density)} "
                f"entries for {count} selected blocks; give one per selected block"
            )


@dataclass(frozen=True, kw_only=True)
class EarlyExitSection:
    layers: list[int] | None = None
    """Blocks with an exit head (global indices 1..num_blocks); null = every block but the last."""
    threshold: float = 0.9
    """A token exits after an exit block when the exit head's top softmax probability is at least
    this (CALM's softmax-response confidence)."""
    start_step: int = 0
    """Tokens start to exit once this many steps have run (exit heads train from step 0)."""
    exit_loss_weight: float = 0.1
    """Weight of each exit head's cross-entropy over the tokens that reach it."""

    def validate(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"schemes.early_exit.threshold={self.threshold} must be in [0, 1]")
        if self.start_step < 0 or self.exit_loss_weight < 0:
            raise ConfigError(
                f"schemes.early_exit.start_step={self.start_step}, exit_loss_weight="
                f"{self.exit_loss_weight}: both must be >= 0"
            )
        at_most("schemes.early_exit.start_step", self.start_step, MAX_STEPS, "a step index")
        at_most(
            "schemes.early_exit.exit_loss_weight",
            self.exit_loss_weight,
            MAX_LOSS_WEIGHT,
            "it would drown the language-model loss; try 0.1",
        )

    def validate_for(self, model: ModelSection) -> None:
        _check_block_layers("schemes.early_exit.layers", self.layers, model.num_blocks)


@dataclass(frozen=True, kw_only=True)
class MoDSection:
    layers: list[int] | None = None
    """Blocks with a Mixture-of-Depths router (global indices 1..num_blocks); null = every
    other block (2, 4, ...)."""
    capacity: float = 0.125
    """Fraction of each sequence's tokens a routed block processes (the rest skip it)."""
    layer_capacity: list[float] | None = None
    """One capacity per selected block (per entry of layers, or per block of the default);
    overrides capacity."""
    initial_capacity: float | None = None
    """Capacity every routed block starts at instead of its own; it then moves linearly to the
    block's own capacity between anneal_start_step and anneal_end_step (e.g. 1.0: routed blocks
    start dense and thin out); null = the block's own capacity from the first step."""
    anneal_start_step: int = 0
    """Step at which the capacities start to move from initial_capacity."""
    anneal_end_step: int = 0
    """Step at which every routed block has reached its own capacity."""

    def validate(self) -> None:
        capacities = [self.capacity, *(self.layer_capacity or [])]
        if self.initial_capacity is not None:
            capacities.append(self.initial_capacity)
        if any(not 0.0 < c <= 1.0 for c in capacities):
            raise ConfigError(f"schemes.mod capacities {capacities} must be in (0, 1]")
        at_most("schemes.mod.anneal_end_step", self.anneal_end_step, MAX_STEPS, "a step index")
        if not 0 <= self.anneal_start_step <= self.anneal_end_step:
            raise ConfigError(
                f"schemes.mod.anneal_start_step={self.anneal_start_step}, anneal_end_step="
                f"{self.anneal_end_step}: need 0 <= anneal_start_step <= anneal_end_step"
            )

    def validate_for(self, model: ModelSection) -> None:
        _check_block_layers("schemes.mod.layers", self.layers, model.num_blocks)
        count = _num_selected(self.layers, every_other_block(model.num_blocks))
        if self.layer_capacity is not None and len(self.layer_capacity) != count:
            raise ConfigError(
                f"schemes.mod.layer_capacity has {len(self.layer_capacity)} entries "
                f"for {count} selected blocks; give one per selected block"
            )


# --------------------------------------------------------------------------------------------
# The section table and the ``schemes:`` container
# --------------------------------------------------------------------------------------------

SCHEME_SECTIONS: dict[str, type[Any]] = {
    "moe": MoESection,
    "pruning": PruningSection,
    "freezing": FreezingSection,
    "sparse_attention": SparseAttentionSection,
    "early_exit": EarlyExitSection,
    "mod": MoDSection,
}
"""Scheme name -> its config section, in declaration order (the order of ``enabled``, of the
step-end hooks and of the run log). The built-in sections are listed here so that a config loads
without importing torch; :func:`dynmo_hpc.model.schemes.registry.register` adds any other scheme's
section (do not edit the table directly). A section is a frozen keyword-only dataclass with
``validate()`` and ``validate_for(model)``."""


def register_section(name: str, section_type: type[Any]) -> None:
    """Make ``schemes.<name>`` a valid YAML key whose mapping loads into ``section_type``."""
    known = SCHEME_SECTIONS.get(name)
    if known is not None and known is not section_type:
        raise ConfigError(
            f"scheme '{name}' is already registered with section {known.__name__}, not "
            f"{section_type.__name__}; HINT: choose another scheme name"
        )
    if not dataclasses.is_dataclass(section_type):
        raise ConfigError(f"scheme '{name}': section {section_type!r} must be a dataclass")
    SCHEME_SECTIONS[name] = section_type
    _describe_fields()


def unregister_section(name: str) -> None:
    """Remove a registered scheme's section (tests that register a scheme of their own)."""
    SCHEME_SECTIONS.pop(name, None)
    _describe_fields()


def _describe_fields() -> None:
    """Give :class:`SchemesSection` the dataclass fields and annotations of the table, so the
    strict loader, ``dataclasses.asdict`` and ``typing.get_type_hints`` treat it as the
    dataclass ``{name: Section | None = None, ...}`` of the registered schemes."""
    shape = dataclasses.make_dataclass(
        "SchemesSection",
        [(n, t | None, dataclasses.field(default=None)) for n, t in SCHEME_SECTIONS.items()],
        frozen=True,
        kw_only=True,
    )
    SchemesSection.__dataclass_fields__ = shape.__dataclass_fields__  # type: ignore[attr-defined]
    SchemesSection.__annotations__ = {n: t | None for n, t in SCHEME_SECTIONS.items()}


class SchemesSection:
    """The ``schemes:`` section: one optional sub-section per registered scheme (absent = off).

    Immutable. ``schemes.<name>`` (or ``schemes["<name>"]``) is that scheme's section, or None
    when the scheme is off; the names are the keys of :data:`SCHEME_SECTIONS`, so a registered
    scheme is a valid YAML key without any edit here. It presents itself as the frozen
    dataclass of those names (``dataclasses.fields``, ``asdict`` and ``get_type_hints`` see one
    ``Section | None`` field per registered scheme), so the strict loader parses ``schemes:``
    through the table and ``JobConfig.to_dict`` lists every registered name, None when off.
    """

    __slots__ = ("_sections",)

    def __init__(self, **sections: Any) -> None:
        unknown = [name for name in sections if name not in SCHEME_SECTIONS]
        if unknown:
            raise ConfigError(
                f"unknown scheme {', '.join(unknown)}; valid schemes are: "
                f"{', '.join(SCHEME_SECTIONS)}"
            )
        on = {name: value for name, value in sections.items() if value is not None}
        object.__setattr__(self, "_sections", {n: on[n] for n in SCHEME_SECTIONS if n in on})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in SCHEME_SECTIONS:
            return self._sections.get(name)
        raise AttributeError(f"no scheme '{name}'; valid schemes are: {', '.join(SCHEME_SECTIONS)}")

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to schemes.{name}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SchemesSection) and self._sections == other._sections

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={value!r}" for name, value in self._sections.items())
        return f"SchemesSection({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_schemes, (dict(self._sections),))

    def __deepcopy__(self, memo: dict[int, Any]) -> SchemesSection:
        return self  # immutable, and its sections are frozen

    @property
    def enabled(self) -> list[str]:
        """Names of the schemes switched on, in registration order."""
        return list(self._sections)

    def validate(self) -> None:
        for section in self._sections.values():
            section.validate()
        if self.early_exit is not None:
            for other in ("mod", "sparse_attention"):
                if getattr(self, other) is not None:
                    raise ConfigError(
                        f"schemes.early_exit and schemes.{other} are both on; early-exit blocks "
                        "attend with a ragged set of queries, which neither composes with; "
                        "enable one of them"
                    )

    def validate_for(self, model: ModelSection) -> None:
        """Checks that need the model: each section's own, then the ones across schemes."""
        for section in self._sections.values():
            if hasattr(section, "validate_for"):
                section.validate_for(model)
        n = model.num_blocks
        sa, routed = self.sparse_attention, self.mod
        if sa is not None and routed is not None:
            both = set(routed.layers or every_other_block(n)) & set(sa.layers or range(1, n + 1))
            if both:
                raise ConfigError(
                    f"blocks {sorted(both)} are in both schemes.mod.layers and "
                    "schemes.sparse_attention.layers; routed blocks attend densely over "
                    "their selected tokens: make the two layer lists disjoint"
                )


def _rebuild_schemes(sections: dict[str, Any]) -> SchemesSection:
    return SchemesSection(**sections)


_describe_fields()
