"""Tied input/output embeddings (``model.tie_embeddings``): the two copies and their gradients.

The embedding (global layer 0, always on the first stage) and the head (layer N+1, always on
the last stage) are separate layers that may sit on different ranks, so a tied weight is held
twice, as in Megatron-LM: the embedding's token table (the family's ``embedding_weight``) and
the head's ``lm_head.weight``. Invariants that make the two copies one parameter:

- they start bitwise equal: the head's copy is initialised from the embedding's
  (:func:`copy_tied_`), or both are read from the same Hugging Face tensor;
- before every optimizer step both copies' gradients are replaced by the same sum,
  embedding + head (:func:`summed_grad`; IEEE addition is commutative, so the two ranks that
  compute it get the same bits), and AdamW is element-wise and deterministic, so the copies
  stay bitwise equal after every step;
- global-norm clipping counts the weight once, as the single Hugging Face parameter would: the
  head's copy is left out of the head's squared norm (:func:`norm_exclusions`).

The summing across ranks is :mod:`dynmo_hpc.pipeline.tied_grads`; here is what both it and the
single-process reference share.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.families import family_of
from dynmo_hpc.model.gpt import layer_kind

HEAD_WEIGHT = "lm_head.weight"
"""The head's output projection (vocab x d_model) in every family."""


def tied_name(cfg: ModelSection, index: int) -> str | None:
    """The name of layer ``index``'s copy of the tied weight, or None (untied, or a block)."""
    if not cfg.tie_embeddings:
        return None
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return family_of(cfg).embedding_weight
    if kind == "head":
        return HEAD_WEIGHT
    return None


def tied_parameter(cfg: ModelSection, index: int, module: nn.Module) -> nn.Parameter | None:
    """Layer ``index``'s copy of the tied weight, or None where it holds none."""
    name = tied_name(cfg, index)
    return None if name is None else module.get_parameter(name)


def norm_exclusions(cfg: ModelSection, index: int) -> tuple[str, ...]:
    """Parameters of layer ``index`` left out of its squared gradient norm: the head's copy of a
    tied weight (the embedding's copy, holding the same summed gradient, counts it once)."""
    name = tied_name(cfg, index)
    return (name,) if name == HEAD_WEIGHT else ()


def copy_tied_(head: nn.Module, embedding: nn.Module, cfg: ModelSection) -> None:
    """Set a tied head's ``lm_head.weight`` to ``embedding``'s token table (layer 0 as built,
    so the copies start bitwise equal)."""
    source = embedding.get_parameter(family_of(cfg).embedding_weight)
    with torch.no_grad():
        head.get_parameter(HEAD_WEIGHT).copy_(source)


def summed_grad(embedding: Tensor | None, head: Tensor | None) -> Tensor | None:
    """The gradient both copies get: ``embedding + head`` (a missing one counts as zero; None
    when both are missing, so the weight is not stepped, as an unused parameter is not)."""
    if embedding is None and head is None:
        return None
    if embedding is None:
        assert head is not None
        return torch.zeros_like(head) + head
    if head is None:
        return embedding + torch.zeros_like(embedding)
    return embedding + head


def sum_local_(embedding: nn.Parameter, head: nn.Parameter) -> None:
    """Both copies on one process: give each the summed gradient (:func:`summed_grad`)."""
    total = summed_grad(embedding.grad, head.grad)
    if total is None:
        return
    embedding.grad = total
    head.grad = total.clone()
