"""The model-family interface and its one registry, keyed by ``model.arch``.

A family says how to build each kind of layer (embedding, block, head) from the ``model:``
section, how to initialise a layer deterministically from ``(seed, index)``, and how its
parameters are named in a Hugging Face checkpoint (for ``model.init_from`` and export). Every
consumer (the layer builder, the importer, the exporter) looks the family up here; a new family
is one module that calls :func:`register` and an entry in
:data:`dynmo_hpc.config.sections.ARCH_SCHEMES` (the schemes it supports).

Invariant: a family's layers keep the calling convention of :mod:`dynmo_hpc.model.gpt`
(``layer(x, ctx) -> payload``, the head sets ``ctx.loss``), so the pipeline never knows which
family it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.config.sections import ARCH_SCHEMES
from dynmo_hpc.errors import ConfigError


@dataclass(frozen=True)
class HFTensor:
    """Where one parameter of ours lives in a Hugging Face checkpoint."""

    name: str
    """The tensor's name in the safetensors files."""
    transposed: bool = False
    """Stored (in, out), as GPT-2's ``Conv1D``: transposed against ``nn.Linear``."""
    fallback: str | None = None
    """Read this tensor instead when ``name`` is absent (a head tied to the embedding)."""


@dataclass(frozen=True)
class Family:
    """One model family (``model.arch``)."""

    name: str
    build_embedding: Callable[[ModelSection], nn.Module]
    build_block: Callable[[ModelSection, int], nn.Module]
    """(model section, feed-forward width) -> an uninitialised block."""
    build_head: Callable[[ModelSection], nn.Module]
    init_layer: Callable[[nn.Module, ModelSection, int, int], None]
    """(module, model section, seed, global index): deterministic initialisation in place."""
    hf_tensors: Callable[[ModelSection, int], dict[str, HFTensor]]
    """(model section, global index) -> our parameter name -> its Hugging Face tensor."""
    embedding_weight: str = "wte.weight"
    """The embedding layer's token table, which ``model.tie_embeddings`` ties to the head's
    ``lm_head.weight`` (same shape: vocab x d_model)."""
    packed: dict[str, int] = field(default_factory=dict)
    """Parameter name suffix -> how many equal parts it packs along dim 0 (GPT-2's fused
    ``c_attn``: q, k, v), so a pruned matrix is padded back part by part."""


FAMILIES: dict[str, Family] = {}
"""Registered families by ``model.arch``."""


def register(family: Family) -> Family:
    """Register a family; its name must be a ``model.arch`` the config knows."""
    if family.name not in ARCH_SCHEMES:
        raise ConfigError(
            f"model family '{family.name}' has no entry in config.sections.ARCH_SCHEMES; "
            "HINT: add it there with the schemes it supports"
        )
    known = FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise ConfigError(f"model family '{family.name}' is already registered")
    FAMILIES[family.name] = family
    return family


def family_of(cfg: ModelSection) -> Family:
    """The family of ``model.arch``."""
    family = FAMILIES.get(cfg.arch)
    if family is None:
        raise ConfigError(
            f"model.arch={cfg.arch!r} has no registered family (known: {', '.join(FAMILIES)}); "
            "HINT: import dynmo_hpc.model.families"
        )
    return family
