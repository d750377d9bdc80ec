"""Dynamic schemes: the techniques that change each layer's work while training runs.

Each scheme is one module holding its mechanism and a :class:`~.registry.Scheme` subclass (its
config section, how it changes a block, its forward path, its step-end hook, its statistics and
counters, its restore hooks); :data:`BUILTIN_SCHEMES` registers the six built-in ones in
:mod:`.registry`, the one registry everything below iterates:

* :func:`build_layer` builds global layer ``index`` with the job's schemes applied (a pure
  function of the config, the seed and the index, so any rank builds the same layer);
* :func:`activation_spec` names the tensors that travel between stages (schemes may add some);
* :class:`SchemeController` runs at the end of every optimizer step on every rank (and in the
  single-process reference) and may change owned layers in place (prune, freeze, ...). It talks
  to other ranks only through the ``allgather`` callable it is given, so the same code runs
  under MPI and in one process. Its ``no_grad_below`` tells the pipeline stage which layers
  need no backward.

All per-layer scheme state lives inside the layer modules (buffers, submodules, attributes), so
it travels with a layer when the layer migrates. :mod:`.blocks` holds the block the schemes plug
into. With no scheme enabled every function here returns exactly what the plain model does
(same classes, same bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dynmo_hpc.config import JobConfig
from dynmo_hpc.model import families, tied
from dynmo_hpc.model.gpt import Spec, layer_kind
from dynmo_hpc.model.gpt import activation_spec as base_activation_spec
from dynmo_hpc.model.hf_weights import HFCheckpoint, load_layer_
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.early_exit import EarlyExitScheme
from dynmo_hpc.model.schemes.freezing import FreezingScheme
from dynmo_hpc.model.schemes.llama_blocks import LlamaSchemeBlock
from dynmo_hpc.model.schemes.mod import MoDScheme
from dynmo_hpc.model.schemes.moe import MoEScheme
from dynmo_hpc.model.schemes.pruning import PruningScheme
from dynmo_hpc.model.schemes.registry import (
    SCHEMES,
    AllGather,
    Scheme,
    Slot,
    counter_attrs,
    enabled_schemes,
    register,
    take_counters,
    unregister,
)
from dynmo_hpc.model.schemes.sparse_attention import SparseAttentionScheme
from dynmo_hpc.report_cycle import is_report_step

__all__ = [
    "BUILTIN_SCHEMES",
    "SCHEMES",
    "Scheme",
    "SchemeController",
    "activation_spec",
    "build_layer",
    "counter_attrs",
    "enabled_schemes",
    "register",
    "restore_layer",
    "take_counters",
    "unregister",
]

BUILTIN_SCHEMES: tuple[type[Scheme], ...] = (
    MoEScheme,
    PruningScheme,
    FreezingScheme,
    SparseAttentionScheme,
    EarlyExitScheme,
    MoDScheme,
)
"""The built-in schemes, registered on import (another scheme: :func:`register` its class)."""

for _scheme in BUILTIN_SCHEMES:
    register(_scheme)


SCHEME_BLOCKS: dict[str, type[nn.Module]] = {"gpt2": SchemeBlock, "llama": LlamaSchemeBlock}
"""``model.arch`` -> the block schemes plug into (``config.sections.ARCH_SCHEMES`` says which
schemes each family supports)."""

# --------------------------------------------------------------------------------------------
# Building layers
# --------------------------------------------------------------------------------------------


def _build_module(cfg: JobConfig, index: int, schemes: Sequence[Scheme]) -> nn.Module:
    """Layer ``index`` before initialisation: a scheme's replacement, a scheme block or the
    family's plain layer."""
    kind = layer_kind(cfg.model, index)
    for scheme in schemes:
        module = scheme.replace_layer(kind)
        if module is not None:
            return module
    if kind != "block" or not any(scheme.changes_block for scheme in schemes):
        return families.build_module(cfg.model, index)
    block = SCHEME_BLOCKS[cfg.model.arch](cfg.model, cfg.model.block_d_ff(index))
    for scheme in schemes:
        scheme.configure_block(block, index)
    return block


def build_layer(cfg: JobConfig, index: int, *, import_weights: bool = True) -> nn.Module:
    """Global layer ``index`` with the configured schemes applied; with ``model.init_from``
    (and ``import_weights``) its weights are then read from that Hugging Face directory."""
    schemes = enabled_schemes(cfg)
    if not schemes:
        module = families.build_layer(cfg.model, cfg.job.seed, index)
    else:
        module = _build_module(cfg, index, schemes)
        families.family_of(cfg.model).init_layer(module, cfg.model, cfg.job.seed, index)
    if tied.tied_name(cfg.model, index) == tied.HEAD_WEIGHT:
        tied.copy_tied_(module, build_layer(cfg, 0, import_weights=False), cfg.model)
    if import_weights and cfg.model.init_from is not None:
        load_layer_(module, cfg.model, index, HFCheckpoint(cfg.model.init_from))
    for scheme in schemes:
        scheme.attach(module, index)
    return module


def restore_layer(cfg: JobConfig, index: int, state: dict[str, torch.Tensor]) -> nn.Module:
    """Rebuild layer ``index`` from a state dict (checkpoint restore), scheme state included.

    The fresh layer is made to accept the state (pruned shapes), loaded, and then each scheme
    re-derives what the state implies (the frozen flag's ``requires_grad``).
    """
    module = build_layer(cfg, index, import_weights=False)
    schemes = enabled_schemes(cfg)
    for scheme in schemes:
        scheme.before_load(module, state)
    module.load_state_dict(state)
    for scheme in schemes:
        scheme.after_load(module)
    return module


def activation_spec(cfg: JobConfig, micro_batch_size: int) -> Spec:
    """The inter-stage payload for this job (float tensors only: gradients travel back too)."""
    spec = base_activation_spec(cfg.model, micro_batch_size)
    for scheme in enabled_schemes(cfg):
        spec.update(scheme.payload_spec(micro_batch_size))
    return spec


# --------------------------------------------------------------------------------------------
# Step-boundary decisions
# --------------------------------------------------------------------------------------------


Counters = dict[str, dict[str, float]]
"""A layer's scheme counters, by ``path:attr`` (:func:`take_counters`)."""


def layer_stats(
    slot: Slot, schemes: Sequence[Scheme], counters: Counters | None = None
) -> dict[str, float]:
    """A layer's scheme counters since the last report (``counters``: already taken, e.g.
    summed over replicas; None: taken from the layer now and cleared), plus each scheme's own
    figures; a counter ``key`` of submodule ``path`` is reported as ``path.key``."""
    out: dict[str, float] = {}
    if counters is None:
        counters = take_counters(slot.module, clear=True)
    for where, values in counters.items():
        path = where.rpartition(":")[0]
        prefix = f"{path}." if path else ""
        out.update({f"{prefix}{key}": value for key, value in values.items()})
    for scheme in schemes:
        out.update(scheme.layer_stats(slot))
    return out


def sum_counters(parts: Sequence[dict[int, Counters]]) -> dict[int, Counters]:
    """Every replica's counters of the same layers added up (all counters are counts: tokens,
    expert assignments, kept blocks, confidence sums). Pure.

    Example: ``sum_counters([{0: {"m:stats": {"t": 1.0}}}, {0: {"m:stats": {"t": 2.0}}}])``
    is ``{0: {"m:stats": {"t": 3.0}}}``."""
    out: dict[int, Counters] = {}
    for part in parts:
        for index, counters in part.items():
            layer = out.setdefault(index, {})
            for where, values in counters.items():
                into = layer.setdefault(where, {})
                for key, value in values.items():
                    into[key] = into.get(key, 0.0) + float(value)
    return out


class SchemeController:
    """Step-boundary decisions of the enabled schemes (none enabled: nothing to decide)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.schemes = enabled_schemes(cfg)

    @property
    def no_grad_below(self) -> int:
        """No layer below this index needs a backward pass (the largest of the schemes' values,
        the same on every rank); the pipeline stage skips their backward and gradient sends."""
        return max((scheme.no_grad_below() for scheme in self.schemes), default=0)

    def resume(self, slots: Sequence[Slot], allgather: AllGather) -> None:
        """Re-derive the schemes' run-wide state from restored layers."""
        for scheme in self.schemes:
            scheme.resume(slots, allgather)

    def run_state(self) -> dict[str, Any]:
        """What the checkpoint's run state records of the schemes."""
        state: dict[str, Any] = {"no_grad_below": self.no_grad_below}
        for scheme in self.schemes:
            state.update(scheme.summary())
        return state

    def is_report_step(self, step: int) -> bool:
        """Scheme statistics are gathered with the trainer's load reports."""
        return is_report_step(step, self.cfg.balance.interval, self.cfg.train.steps)

    def step_end(
        self,
        step: int,
        slots: Sequence[Slot],
        allgather: AllGather,
        replica_allgather: AllGather | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the schemes' decisions after optimizer step ``step``; returns run-log events.

        Every rank calls this with the same ``step`` and must make the same collective calls.
        ``allgather``: over this replica's pipeline; ``replica_allgather``: over the ranks of
        this stage in every replica (None: one replica). Each replica runs ``1/R`` of the
        batch, so the ``scheme_stats`` counters are summed over replicas: absolute counts
        cover the whole batch whatever ``pipeline.replicas`` is.
        """
        if not self.schemes:
            return []
        events: list[dict[str, Any]] = []
        for scheme in self.schemes:
            event = scheme.step_end(step, slots, allgather)
            if event is not None:
                events.append(event)
        if self.is_report_step(step):
            taken = {s.index: take_counters(s.module, clear=True) for s in slots}
            if replica_allgather is not None:
                taken = sum_counters(replica_allgather(taken))
            mine = {s.index: layer_stats(s, self.schemes, taken[s.index]) for s in slots}
            layers: dict[str, dict[str, float]] = {}
            for part in allgather(mine):
                layers.update({str(i): stats for i, stats in part.items()})
            events.append(
                {
                    "kind": "scheme_stats",
                    "schemes": self.cfg.schemes.enabled,
                    **self.run_state(),
                    "layers": dict(sorted(layers.items(), key=lambda kv: int(kv[0]))),
                }
            )
        for event in events:
            event["step"] = step
        return events
