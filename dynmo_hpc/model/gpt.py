"""A GPT built as an ordered list of placeable layers: embedding, N transformer blocks, head.

Why a flat list: the balancer places *layers* on stages, and migration moves them between ranks.
Layer ``i`` is built by :func:`build_layer` from the config and ``i`` alone, and its initial
weights depend only on ``(seed, i)``, so any rank can build any layer and get the same tensor
bits as the single-process reference. Layer 0 is the embedding, layers 1..N the blocks and layer
N+1 the head (final norm, LM head and loss); the embedding and head are costed and placed like
any other layer.

Every layer has the same calling convention, ``layer(x, ctx) -> x``, where ``x`` is the
inter-stage payload (a dict of tensors, ``None`` before the embedding) and ``ctx`` carries the
microbatch's tokens and targets and collects losses. That keeps the pipeline runner ignorant of
what a layer is.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import ModelSection

Payload = dict[str, Tensor]
"""What travels between stages: name -> tensor. ``"h"`` is the residual stream (B, T, C)."""

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Payload layout: name -> (shape, dtype); both ends of a link allocate buffers from it."""


@dataclass
class MicrobatchContext:
    """Per-microbatch inputs every stage can build locally, plus the losses layers report."""

    tokens: Tensor
    """(B, T) int64 input bytes."""
    targets: Tensor
    """(B, T) int64 next bytes."""
    loss: Tensor | None = None
    """Mean cross-entropy, set by the head on the last stage."""
    aux_losses: list[Tensor] = field(default_factory=list)
    """Extra loss terms (router balance, exit heads) added to the objective by the stage."""


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.num_heads
        q = q.view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.num_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


GELU_APPROXIMATION = {"gelu": "none", "gelu_tanh": "tanh"}
"""``model.activation`` -> ``F.gelu``'s ``approximate`` (tanh: Hugging Face's ``gelu_new``)."""


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu") -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_proj = nn.Linear(d_ff, d_model)
        self.approximate = GELU_APPROXIMATION[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Embedding(nn.Module):
    """Layer 0: token plus learned position embedding."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.num_positions, cfg.d_model)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        T = ctx.tokens.shape[1]
        pos = torch.arange(T, device=ctx.tokens.device)
        return {"h": self.wte(ctx.tokens) + self.wpe(pos)}  # (B, T, C)


class Block(nn.Module):
    """A pre-norm transformer block; ``attn`` and ``mlp`` are swappable for dynamic schemes."""

    def __init__(self, cfg: ModelSection, d_ff: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn: nn.Module = CausalSelfAttention(cfg.d_model, cfg.num_heads)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp: nn.Module = MLP(cfg.d_model, d_ff, cfg.activation)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        h = x["h"]  # (B, T, C)
        h = h + self.attn(self.ln_1(h))
        h = h + self.mlp(self.ln_2(h))
        return {**x, "h": h}


class Head(nn.Module):
    """Layer N+1: final LayerNorm, LM head and the cross-entropy loss (set on ``ctx.loss``)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        logits = self.lm_head(self.ln_f(x["h"]))  # (B, T, vocab)
        ctx.loss = F.cross_entropy(logits.view(-1, logits.size(-1)), ctx.targets.view(-1))
        return {}


def layer_kind(cfg: ModelSection, index: int) -> str:
    """'embedding', 'block' or 'head' for a global layer index."""
    if not 0 <= index < cfg.num_layers:
        raise IndexError(f"layer {index} outside 0..{cfg.num_layers - 1}")
    if index == 0:
        return "embedding"
    if index == cfg.num_layers - 1:
        return "head"
    return "block"


def layer_seed(seed: int, index: int) -> int:
    """A 63-bit seed for layer ``index``, independent of which rank builds it."""
    digest = hashlib.sha256(f"dynmo-layer:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_layer_(module: nn.Module, cfg: ModelSection, seed: int, index: int) -> None:
    """GPT-2 initialisation from a generator seeded by ``(seed, index)``.

    Linear and embedding weights ~ N(0, 0.02), residual projections scaled by 1/sqrt(2 N),
    biases zero, LayerNorm weight one. Parameters are visited in registration order, so the
    result is a pure function of the config, the seed and the index.
    """
    gen = torch.Generator().manual_seed(layer_seed(seed, index))
    std_proj = 0.02 / math.sqrt(2 * cfg.num_blocks)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # LayerNorm weight
                param.fill_(1.0)
            else:
                std = std_proj if name.endswith("c_proj.weight") else 0.02
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_layer(cfg: ModelSection, seed: int, index: int) -> nn.Module:
    """Build and initialise global layer ``index`` on the CPU."""
    kind = layer_kind(cfg, index)
    module: nn.Module
    if kind == "embedding":
        module = Embedding(cfg)
    elif kind == "head":
        module = Head(cfg)
    else:
        module = Block(cfg, cfg.block_d_ff(index))
    init_layer_(module, cfg, seed, index)
    return module


def activation_spec(cfg: ModelSection, micro_batch_size: int) -> Spec:
    """Names, shapes and dtypes of the payload sent between stages (same at every boundary)."""
    return {"h": ((micro_batch_size, cfg.seq_len, cfg.d_model), torch.float32)}


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
