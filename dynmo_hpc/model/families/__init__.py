"""Model families (``model.arch``): one module per family, registered once in :mod:`.registry`.

* :mod:`.gpt2`: the GPT-2 layers of :mod:`dynmo_hpc.model.gpt` (the schemes' block extends them);
* :mod:`.llama`: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.

:func:`build_module` and :func:`build_layer` are what the layer builder calls; with
``model.arch: gpt2`` they build exactly what :func:`dynmo_hpc.model.gpt.build_layer` builds.
"""

from __future__ import annotations

from torch import nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.families import gpt2, llama
from dynmo_hpc.model.families.registry import FAMILIES, Family, HFTensor, family_of, register
from dynmo_hpc.model.gpt import layer_kind

__all__ = [
    "FAMILIES",
    "Family",
    "HFTensor",
    "build_layer",
    "build_module",
    "family_of",
    "gpt2",
    "llama",
    "register",
]


def build_module(cfg: ModelSection, index: int) -> nn.Module:
    """Global layer ``index`` of ``cfg``'s family, not yet initialised."""
    family = family_of(cfg)
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return family.build_embedding(cfg)
    if kind == "head":
        return family.build_head(cfg)
    return family.build_block(cfg, cfg.block_d_ff(index))


def build_layer(cfg: ModelSection, seed: int, index: int) -> nn.Module:
    """Build and initialise global layer ``index`` on the CPU (no scheme)."""
    module = build_module(cfg, index)
    family_of(cfg).init_layer(module, cfg, seed, index)
    return module
