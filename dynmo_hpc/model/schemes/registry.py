"""The scheme interface and its one registry: every consumer iterates :data:`SCHEMES`.

A scheme is a subclass of :class:`Scheme` registered with :func:`register`. Registration puts its
config section into :data:`dynmo_hpc.config.scheme_sections.SCHEME_SECTIONS` (so ``schemes.<name>:``
loads from YAML) and its class here; from then on the layer builder, the step-end controller,
the run log's ``scheme_stats`` events, the checkpoint's counters and ``dynmo-hpc bench`` pick it
up with no other edit. Nothing else lists the schemes.

One instance per enabled scheme and controller (or per :func:`build_layer` call): instances may
keep step-to-step state that every rank derives identically (the frozen prefix), but every
piece of per-layer state lives in the layer module (buffers, submodules, plain attributes), so
it travels with the layer when it migrates (the module object itself is shipped) and is saved
with it in a checkpoint (its state dict, plus the counters named by ``counter_attrs``).

Invariant: with no scheme enabled, no hook runs and every layer is the plain model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.scheme_sections import register_section, unregister_section
from dynmo_hpc.errors import ConfigError

AllGather = Callable[[Any], list[Any]]
"""Gathers one object from every rank, in rank order (``[obj]`` in one process)."""

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Slot(Protocol):
    """What a scheme may touch on an owned layer (``pipeline.stage.LayerSlot`` in the pipeline,
    ``pipeline.reference._Slot`` in one process)."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer


class Scheme:
    """One dynamic scheme: what it adds to a layer and what it decides at step boundaries.

    Subclasses set the class attributes and override the hooks they need; every hook's default
    does nothing. ``section`` is this job's ``schemes.<name>`` (never None: only enabled schemes
    are instantiated). Hooks run on every rank with the same arguments' shape; any hook that
    calls ``allgather`` must call it on every rank in the same order.
    """

    name: ClassVar[str]
    """The ``schemes:`` key (``schemes.<name>``)."""
    section_type: ClassVar[type[Any]]
    """Its config section: a frozen keyword-only dataclass with ``validate()`` and, when it
    needs the model, ``validate_for(model)``."""
    changes_block: ClassVar[bool] = False
    """Blocks are built as :class:`~.blocks.SchemeBlock` (and passed to ``configure_block``)."""
    counter_attrs: ClassVar[tuple[str, ...]] = ()
    """Names of plain ``dict[str, float]`` attributes that submodules count into between
    reports: gathered into ``scheme_stats`` events (then cleared) and saved in checkpoints."""

    def __init__(self, cfg: JobConfig, section: Any) -> None:
        self.cfg = cfg
        self.section = section

    # -- building a layer (a pure function of cfg, seed and index) ------------------------------
    def replace_layer(self, kind: str) -> nn.Module | None:
        """A module to use instead of the plain ``kind`` ("embedding", "head"), or None."""
        return None

    def configure_block(self, block: Any, index: int) -> None:
        """Change :class:`~.blocks.SchemeBlock` ``index`` before it is initialised (swap its
        feed-forward, add submodules, set ``block.forward_path``)."""

    def attach(self, module: nn.Module, index: int) -> None:
        """Add state to layer ``index`` after its deterministic initialisation (buffers)."""

    def payload_spec(self, micro_batch_size: int) -> Spec:
        """Tensors this scheme adds to the inter-stage payload (float: gradients travel back)."""
        return {}

    # -- restoring a layer from a state dict (checkpoint) ----------------------------------------
    def before_load(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Make a freshly built layer accept ``state`` (e.g. shrink it to pruned shapes)."""

    def after_load(self, module: nn.Module) -> None:
        """Re-derive attributes from loaded buffers (e.g. ``requires_grad`` from a flag)."""

    # -- step boundaries ---------------------------------------------------------------------
    def step_end(
        self, step: int, slots: Sequence[Slot], allgather: AllGather
    ) -> dict[str, Any] | None:
        """Decide after optimizer step ``step``; returns a run-log event (with ``kind``) or None."""
        return None

    def resume(self, slots: Sequence[Slot], allgather: AllGather) -> None:
        """Re-derive instance state from restored layers (after a checkpoint restore)."""

    def no_grad_below(self) -> int:
        """A layer index k such that no layer below k needs a backward pass (0: all do)."""
        return 0

    def layer_stats(self, slot: Slot) -> dict[str, float]:
        """A layer's figures for the ``scheme_stats`` event (besides its counters)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Run-wide figures for ``scheme_stats`` events and the checkpoint's run state."""
        return {}


SCHEMES: dict[str, type[Scheme]] = {}
"""Registered schemes by name, in the order of
:data:`~dynmo_hpc.config.scheme_sections.SCHEME_SECTIONS`."""


def register(scheme: type[Scheme]) -> type[Scheme]:
    """Register a scheme class (usable as a decorator); its section becomes valid YAML."""
    known = SCHEMES.get(scheme.name)
    if known is not None and known is not scheme:
        raise ConfigError(
            f"scheme '{scheme.name}' is already registered as {known.__qualname__}; "
            "HINT: choose another name"
        )
    register_section(scheme.name, scheme.section_type)
    SCHEMES[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme and its section (tests that register a scheme of their own)."""
    SCHEMES.pop(name, None)
    unregister_section(name)


def enabled_schemes(cfg: JobConfig) -> list[Scheme]:
    """One instance per scheme the job enables, in registration order."""
    missing = [name for name in cfg.schemes.enabled if name not in SCHEMES]
    if missing:
        raise ConfigError(
            f"schemes {missing} have a config section but no registered Scheme class; "
            "HINT: import the module that registers them"
        )
    return [SCHEMES[name](cfg, cfg.schemes[name]) for name in cfg.schemes.enabled]


def counter_attrs() -> tuple[str, ...]:
    """Every registered scheme's counter attribute names, once each, in registration order."""
    names: dict[str, None] = {}
    for scheme in SCHEMES.values():
        names.update(dict.fromkeys(scheme.counter_attrs))
    return tuple(names)


def take_counters(module: nn.Module, *, clear: bool) -> dict[str, dict[str, float]]:
    """The counters of every submodule of a layer, by ``(path, attr)`` joined as ``path:attr``."""
    out: dict[str, dict[str, float]] = {}
    for path, sub in module.named_modules():
        for attr in counter_attrs():
            counters = getattr(sub, attr, None)
            if isinstance(counters, dict):
                out[f"{path}:{attr}"] = {str(k): float(v) for k, v in counters.items()}
                if clear:
                    counters.clear()
    return out
