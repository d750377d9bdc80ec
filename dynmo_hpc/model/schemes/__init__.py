"""Dynamic schemes: the techniques that change each layer's work while training runs.

This package is the single seam between the schemes and the rest of the system:

* :func:`build_layer` builds global layer ``index`` with the job's schemes applied (a pure
  function of the config, the seed and the index, so any rank builds the same layer);
* :func:`activation_spec` names the tensors that travel between stages (schemes may add some);
* :class:`SchemeController` runs at the end of every optimizer step on every rank (and in the
  single-process reference) and may change owned layers in place (prune, freeze, ...). It talks
  to other ranks only through the ``allgather`` callable it is given, so the same code runs
  under MPI and in one process.

All scheme state lives inside the layer modules (buffers and attributes), so it travels with a
layer when the layer migrates. One module per scheme: :mod:`.moe`, :mod:`.pruning`,
:mod:`.freezing`, :mod:`.sparse_attention`, :mod:`.early_exit`, :mod:`.mod`; :mod:`.blocks` holds
the block they plug into. With no scheme enabled every function here returns exactly what the
plain model does (same classes, same bits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dynmo_hpc.config import JobConfig, every_other_block
from dynmo_hpc.model.gpt import Block, Embedding, Head, Spec, init_layer_, layer_kind
from dynmo_hpc.model.gpt import activation_spec as base_activation_spec
from dynmo_hpc.model.gpt import build_layer as base_build_layer
from dynmo_hpc.model.schemes import early_exit, freezing, pruning, sparse_attention
from dynmo_hpc.model.schemes.blocks import SchemeAttention, SchemeBlock
from dynmo_hpc.model.schemes.mod import DepthRouter, capacity_at
from dynmo_hpc.model.schemes.moe import MoEFeedForward

AllGather = Callable[[Any], list[Any]]

__all__ = ["SchemeController", "activation_spec", "build_layer", "restore_layer"]


class Slot(Protocol):
    """What the controller may touch on an owned layer (see ``engine.LayerSlot``)."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer


# --------------------------------------------------------------------------------------------
# Building layers
# --------------------------------------------------------------------------------------------

_BLOCK_SCHEMES = ("moe", "pruning", "sparse_attention", "early_exit", "mod")
"""Schemes that change the block itself (freezing only adds buffers)."""


def _selected(layers: list[int] | None, default: list[int]) -> list[int]:
    return list(layers) if layers is not None else default


def sparse_base_density(cfg: JobConfig, index: int) -> float | None:
    """Layer ``index``'s configured attention density, or None if its attention is dense."""
    section = cfg.schemes.sparse_attention
    if section is None:
        return None
    layers = _selected(section.layers, list(range(1, cfg.model.num_blocks + 1)))
    if index not in layers:
        return None
    if section.layer_density is not None:
        return section.layer_density[layers.index(index)]
    return section.density


def _build_scheme_block(cfg: JobConfig, index: int) -> SchemeBlock:
    schemes, model = cfg.schemes, cfg.model
    all_blocks = list(range(1, model.num_blocks + 1))
    d_ff = cfg.model.block_d_ff(index)
    block = SchemeBlock(model, d_ff)
    if schemes.moe is not None and index in _selected(schemes.moe.layers, all_blocks):
        block.mlp = MoEFeedForward(model.d_model, schemes.moe.d_ff_expert or d_ff, schemes.moe)
    density = sparse_base_density(cfg, index)
    if density is not None:
        assert schemes.sparse_attention is not None
        section = schemes.sparse_attention
        block.attn.make_sparse(section.block_size, sparse_attention.density_at(section, density, 0))
    if schemes.mod is not None:
        routed = _selected(schemes.mod.layers, every_other_block(model.num_blocks))
        if index in routed:
            capacities = schemes.mod.layer_capacity
            capacity = capacities[routed.index(index)] if capacities else schemes.mod.capacity
            section = schemes.mod
            start = None if section.initial_capacity is None else capacity_at(section, capacity, 0)
            block.depth_router = DepthRouter(model.d_model, capacity, start)
    if schemes.early_exit is not None:
        block.early_exit_model = True
        if index in early_exit.exit_layers(schemes.early_exit, model.num_blocks):
            block.exit_head = early_exit.ExitHead(model, schemes.early_exit)
    return block


def build_layer(cfg: JobConfig, index: int) -> nn.Module:
    """Global layer ``index`` with the configured schemes applied."""
    schemes = cfg.schemes
    if not schemes.enabled:
        return base_build_layer(cfg.model, cfg.job.seed, index)
    kind = layer_kind(cfg.model, index)
    module: nn.Module
    if kind == "embedding":
        ee = schemes.early_exit is not None
        module = early_exit.EarlyExitEmbedding(cfg.model) if ee else Embedding(cfg.model)
    elif kind == "head":
        module = early_exit.EarlyExitHead(cfg.model) if schemes.early_exit else Head(cfg.model)
    elif any(getattr(schemes, name) is not None for name in _BLOCK_SCHEMES):
        module = _build_scheme_block(cfg, index)
    else:
        module = Block(cfg.model, cfg.model.block_d_ff(index))
    init_layer_(module, cfg.model, cfg.job.seed, index)
    if schemes.freezing is not None:
        freezing.attach(module)
    return module


def restore_layer(cfg: JobConfig, index: int, state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild layer ``index`` from a state dict (checkpoint restore), pruned shapes included.

    The fresh layer is shrunk to the state's shapes, loaded, and its frozen flag re-applied.
    """
    module = build_layer(cfg, index)
    pruning.conform_to_state_dict(module, state)
    module.load_state_dict(state)
    freezing.apply_frozen_flag(module)
    return module


def activation_spec(cfg: JobConfig, micro_batch_size: int) -> Spec:
    """The inter-stage payload for this job (float tensors only: gradients travel back too)."""
    spec = base_activation_spec(cfg.model, micro_batch_size)
    if cfg.schemes.early_exit is not None:
        spec.update(early_exit.payload_spec(micro_batch_size, cfg.model.seq_len))
    return spec


# --------------------------------------------------------------------------------------------
# Step-boundary decisions
# --------------------------------------------------------------------------------------------


def _collect_stats(slot: Slot, cfg: JobConfig) -> dict[str, float]:
    """A layer's scheme counters since the last report (then reset), plus its sparsity."""
    out: dict[str, float] = {}
    for path, sub in slot.module.named_modules():
        for attr in ("stats", "token_stats"):
            counters = getattr(sub, attr, None)
            if isinstance(counters, dict) and counters:
                prefix = f"{path}." if path else ""
                for key, value in counters.items():
                    out[f"{prefix}{key}"] = float(value)
                counters.clear()
    if cfg.schemes.pruning is not None:
        for kind, value in pruning.layer_sparsity(slot.module, cfg, slot.index).items():
            out[f"sparsity.{kind}"] = value
    attn = getattr(slot.module, "attn", None)
    if isinstance(attn, SchemeAttention):
        if cfg.schemes.pruning is not None:
            out["attn.num_heads"] = float(attn.num_heads)
        if attn.density is not None:
            out["attn.density"] = float(attn.density)
    router = getattr(slot.module, "depth_router", None)
    if isinstance(router, DepthRouter) and router.current_capacity is not None:
        out["depth_router.capacity"] = float(router.current_capacity)
    if cfg.schemes.freezing is not None:
        out["frozen"] = float(freezing.is_frozen(slot.module))
    return out


class SchemeController:
    """Step-boundary decisions of the enabled schemes (none enabled: nothing to decide)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.frozen_prefix_end = 0
        """Layers ``0..frozen_prefix_end-1`` are all frozen: no backward runs through them."""

    def resume(self, slots: Sequence[Slot], allgather: AllGather) -> None:
        """Re-derive ``frozen_prefix_end`` from the layers' frozen flags (after a restore)."""
        flags: dict[int, bool] = {}
        for part in allgather({s.index: freezing.is_frozen(s.module) for s in slots}):
            flags.update(part)
        end = 0
        while flags.get(end, False):
            end += 1
        self.frozen_prefix_end = end

    def is_report_step(self, step: int) -> bool:
        """Scheme statistics are gathered with the trainer's load reports."""
        return (step + 1) % self.cfg.balance.interval == 0 or step + 1 == self.cfg.train.steps

    def step_end(
        self, step: int, slots: Sequence[Slot], allgather: AllGather
    ) -> list[dict[str, Any]]:
        """Apply the schemes' decisions after optimizer step ``step``; returns run-log events.

        Every rank calls this with the same ``step`` and must make the same collective calls.
        """
        schemes = self.cfg.schemes
        if not schemes.enabled:
            return []
        events: list[dict[str, Any]] = []
        if schemes.pruning is not None:
            event = pruning.prune_step(self.cfg, step, slots, allgather)
            if event is not None:
                events.append(event)
        if schemes.freezing is not None:
            self.frozen_prefix_end, event = freezing.freeze_step(
                schemes.freezing,
                step,
                slots,
                allgather,
                self.frozen_prefix_end,
                self.cfg.model.num_layers,
            )
            if event is not None:
                events.append(event)
        if schemes.sparse_attention is not None:
            for slot in slots:
                base = sparse_base_density(self.cfg, slot.index)
                attn = getattr(slot.module, "attn", None)
                if (
                    base is not None
                    and isinstance(attn, SchemeAttention)
                    and attn.density is not None
                ):
                    density = sparse_attention.density_at(schemes.sparse_attention, base, step + 1)
                    attn.density.fill_(density)
        if schemes.mod is not None and schemes.mod.initial_capacity is not None:
            for slot in slots:
                router = getattr(slot.module, "depth_router", None)
                if isinstance(router, DepthRouter) and router.current_capacity is not None:
                    capacity = capacity_at(schemes.mod, router.capacity, step + 1)
                    router.current_capacity.fill_(capacity)
        if schemes.early_exit is not None:
            enabled = step + 1 >= schemes.early_exit.start_step
            for slot in slots:
                head = getattr(slot.module, "exit_head", None)
                if head is not None:
                    head.enabled.fill_(enabled)
        if self.is_report_step(step):
            layers: dict[str, dict[str, float]] = {}
            for part in allgather({s.index: _collect_stats(s, self.cfg) for s in slots}):
                layers.update({str(i): stats for i, stats in part.items()})
            events.append(
                {
                    "kind": "scheme_stats",
                    "schemes": schemes.enabled,
                    "frozen_prefix_end": self.frozen_prefix_end,
                    "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0]))),
                }
            )
        for event in events:
            event["step"] = step
        return events
