"""The ``llama`` family: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.

The module and parameter names inside each layer are Hugging Face ``LlamaForCausalLM``'s
(``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ...), and RoPE uses its
``rotate_half`` layout (dimension ``j`` of a head pairs with ``j + head_size / 2``), so importing
and exporting is a renaming with the layer index. Layer 0 is ``embed_tokens`` alone (no
position table: positions enter as rotations of q and k inside every block), layer N+1 the
final RMSNorm, ``lm_head`` and the loss.

Grouped-query attention: ``num_kv_heads`` key/value heads, query head ``h`` reads key/value head
``h // (num_heads / num_kv_heads)`` (Hugging Face's ``repeat_kv``).

Initialisation (a pure function of ``(seed, index)``, as for gpt2): matrices ~ N(0, 0.02), the
residual projections ``o_proj`` and ``down_proj`` scaled by 1/sqrt(2 N), norm weights one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.families.registry import Family, HFTensor, register
from dynmo_hpc.model.gpt import MicrobatchContext, Payload, layer_kind, layer_seed


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 as Hugging Face's LlamaRMSNorm."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_size: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos and sin, each (T, hs): frequency ``theta^(-2j/hs)`` for the pair (j, j + hs/2)."""
    dims = torch.arange(0, head_size, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (dims / head_size))  # (hs/2,)
    pos = torch.arange(seq_len, device=device).float()  # (T,)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    """(..., hs) -> (-x2, x1) with x1, x2 the first and second halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, nh, T, hs) by position; cos and sin are (T, hs)."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions and no biases."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.kv_heads
        self.head_size = cfg.d_model // cfg.num_heads
        self.rope_theta = cfg.rope_theta
        kv_width = self.num_kv_heads * self.head_size
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_size
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        cos, sin = rope_cos_sin(T, hs, self.rope_theta, x.device)
        q, k = (
            apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)),
            apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)),
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=nkv != nh
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaEmbedding(nn.Module):
    """Layer 0: token embedding only (positions are rotations inside the blocks)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        return {"h": self.embed_tokens(ctx.tokens)}  # (B, T, C)


class LlamaBlock(nn.Module):
    """A pre-norm Llama decoder layer."""

    def __init__(self, cfg: ModelSection, d_ff: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, d_ff)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        h = x["h"]  # (B, T, C)
        h = h + self.self_attn(self.input_layernorm(h))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return {**x, "h": h}


class LlamaHead(nn.Module):
    """Layer N+1: final RMSNorm, LM head and the cross-entropy loss (set on ``ctx.loss``)."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        logits = self.lm_head(self.norm(x["h"]))  # (B, T, vocab)
        ctx.loss = F.cross_entropy(logits.view(-1, logits.size(-1)), ctx.targets.view(-1))
        return {}


RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")
"""Scaled by 1/sqrt(2 N) at initialisation: attention output and (every expert's) down proj."""


def init_layer_(module: nn.Module, cfg: ModelSection, seed: int, index: int) -> None:
    """Initialise from a generator seeded by ``(seed, index)``, parameters in registration
    order: norm weights one, other matrices ~ N(0, 0.02), residual projections scaled by
    1/sqrt(2 N). Scheme parameters with biases (none today) would start at zero."""
    gen = torch.Generator().manual_seed(layer_seed(seed, index))
    std_proj = 0.02 / math.sqrt(2 * cfg.num_blocks)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # RMSNorm weight
                param.fill_(1.0)
            else:
                std = std_proj if name.endswith(RESIDUAL_PROJECTIONS) else 0.02
                param.copy_(torch.randn(param.shape, generator=gen) * std)


_BLOCK = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def hf_tensors(cfg: ModelSection, index: int) -> dict[str, HFTensor]:
    """Our parameter names of layer ``index`` -> their ``LlamaForCausalLM`` tensors."""
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return {"embed_tokens.weight": HFTensor("model.embed_tokens.weight")}
    if kind == "head":
        return {
            "norm.weight": HFTensor("model.norm.weight"),
            "lm_head.weight": HFTensor("lm_head.weight", fallback="model.embed_tokens.weight"),
        }
    return {name: HFTensor(f"model.layers.{index - 1}.{name}") for name in _BLOCK}


LLAMA = register(
    Family(
        name="llama",
        build_embedding=LlamaEmbedding,
        build_block=LlamaBlock,
        build_head=LlamaHead,
        embedding_weight="embed_tokens.weight",
        init_layer=init_layer_,
        hf_tensors=hf_tensors,
    )
)
