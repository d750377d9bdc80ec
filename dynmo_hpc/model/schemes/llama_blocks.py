"""The ``llama`` family's scheme block: a Llama decoder layer the dynamic schemes plug into.

It keeps :class:`~dynmo_hpc.model.families.llama.LlamaBlock`'s parameter names and registration
order (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``,
``mlp.{gate,up,down}_proj``: Hugging Face's, so import and export see the same tensors) and
offers the hooks :class:`~.blocks.SchemeBlock` offers gpt2's schemes: ``attn`` (with
``make_sparse``), ``ln_1``, ``ln_2``, ``feed_forward``, ``depth_router``, ``exit_head``,
``forward_path``. With no scheme attached it computes bit-for-bit what ``LlamaBlock`` computes.

Rotary positions: a token keeps its position in the sequence whatever the scheme does with it.
Mixture of Depths runs the block on a subset of the tokens, so the attention takes their
``positions`` (B, T') and rotates q and k by those, not by their rank in the subset. Block-sparse
attention rotates q and k first and then selects key blocks, with the key/value heads repeated
for their query-head groups (grouped-query attention, Hugging Face's ``repeat_kv``).

Every built-in scheme runs on llama: MoE (SwiGLU experts), early exit (``attend_active``),
sparse attention, MoD, pruning (SwiGLU neurons; heads in whole key/value groups,
:mod:`.pruning`) and freezing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.families.llama import LlamaAttention, LlamaBlock, apply_rope, rope_cos_sin
from dynmo_hpc.model.gpt import MicrobatchContext, Payload
from dynmo_hpc.model.schemes import sparse_attention
from dynmo_hpc.model.schemes.blocks import ForwardPath, feed_forward


class LlamaSchemeAttention(LlamaAttention):
    """Grouped-query rotary attention with optional positions and block sparsity."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__(cfg)
        self.sparse_block_size: int | None = None
        """Tokens per block when attention is block-sparse; None = dense causal attention."""
        self.density: Tensor | None
        self.register_buffer("density", None)  # not in the state dict until make_sparse
        self.stats: dict[str, float] = {}
        """Kept and causal key blocks since the last report (for the run log)."""

    def make_sparse(self, block_size: int, density: float) -> None:
        """Switch to dynamic block-sparse attention (see :mod:`.sparse_attention`)."""
        self.sparse_block_size = block_size
        self.register_buffer("density", torch.tensor(density, dtype=torch.float64))

    def _rope(self, q: Tensor, k: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """q, k rotated by position: 0..T-1, or ``positions`` (B, T) of each token."""
        T, hs = q.shape[2], self.head_size
        if positions is None:
            cos, sin = rope_cos_sin(T, hs, self.rope_theta, q.device)  # (T, hs)
        else:
            table_cos, table_sin = rope_cos_sin(
                int(positions.max()) + 1, hs, self.rope_theta, q.device
            )
            cos, sin = table_cos[positions][:, None], table_sin[positions][:, None]  # (B,1,T,hs)
        return (
            apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)),
            apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)),
        )

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_size  # heads still present
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = self._rope(q, k, positions)
        if self.sparse_block_size is None or self.density is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=nkv != nh
            )  # (B, nh, T, hs)
        else:
            k = k.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hs)
            y, kept, causal = sparse_attention.block_sparse_attention(
                q, k, v, self.sparse_block_size, float(self.density)
            )
            self.stats["kept_blocks"] = self.stats.get("kept_blocks", 0.0) + kept
            self.stats["causal_blocks"] = self.stats.get("causal_blocks", 0.0) + causal
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, nh * hs)
        return self.o_proj(y)

    def attend_active(self, hn: Tensor, active: Tensor, b_idx: Tensor, t_idx: Tensor) -> Tensor:
        """Attention output (N, C) for the active tokens only; keys/values come from all tokens
        (as gpt2's ``SchemeAttention.attend_active``), each query rotated by its own position.

        hn: (B, T, C) the block's normed input; active: (B, T) bool; (b_idx, t_idx): the N
        active positions in row-major order, packed per sequence into (B, Qmax) query slots.
        """
        B, T, _ = hn.shape
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_size
        cos, sin = rope_cos_sin(T, hs, self.rope_theta, hn.device)  # (T, hs)
        k = self.k_proj(hn).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype)).repeat_interleave(nh // nkv, dim=1)
        v = self.v_proj(hn).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hs)
        slot = (active.long().cumsum(1) - 1)[b_idx, t_idx]  # (N,) rank within its sequence
        q_max = int(active.sum(1).max())
        q_act = self.q_proj(hn[b_idx, t_idx]).view(-1, nh, hs)  # (N, nh, hs)
        q_cos, q_sin = cos[t_idx][:, None].to(q_act.dtype), sin[t_idx][:, None].to(q_act.dtype)
        q_act = apply_rope(q_act, q_cos, q_sin)  # (N, nh, hs) at each token's position
        q = hn.new_zeros(B, q_max, nh, hs).index_put((b_idx, slot), q_act)  # (B, Qmax, nh, hs)
        q = q.transpose(1, 2)  # (B, nh, Qmax, hs)
        pos = torch.full((B, q_max), -1, dtype=torch.long, device=hn.device)
        pos = pos.index_put((b_idx, slot), t_idx)  # (B, Qmax), -1 = padding
        keys = torch.arange(T, device=hn.device)
        allowed = keys[None, None, :] <= pos[:, :, None]  # (B, Qmax, T) causal by position
        allowed = allowed | ((pos < 0)[:, :, None] & (keys == 0))  # padding sees key 0, no NaN
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])  # (B,nh,Qmax,hs)
        y = y.transpose(1, 2).reshape(B, q_max, nh * hs)[b_idx, slot]  # (N, nh * hs)
        return self.o_proj(y)  # (N, C)


class LlamaSchemeBlock(LlamaBlock):
    """A Llama decoder layer whose attention and token set the schemes may change (see the
    module docstring); ``attn``, ``ln_1`` and ``ln_2`` name its Hugging Face-named parts."""

    def __init__(self, cfg: ModelSection, d_ff: int) -> None:
        super().__init__(cfg, d_ff)
        self.self_attn: LlamaSchemeAttention = LlamaSchemeAttention(cfg)  # same slot, same order
        self.depth_router: nn.Module | None = None
        self.exit_head: nn.Module | None = None
        self.forward_path: ForwardPath | None = None
        self.token_stats: dict[str, float] = {}

    @property
    def attn(self) -> LlamaSchemeAttention:
        return self.self_attn

    @property
    def ln_1(self) -> nn.Module:
        return self.input_layernorm

    @property
    def ln_2(self) -> nn.Module:
        return self.post_attention_layernorm

    def feed_forward(self, x: Tensor, ctx: MicrobatchContext) -> Tensor:
        """The block's SwiGLU (or its MoE) on (..., C) (:func:`.blocks.feed_forward`)."""
        return feed_forward(self.mlp, x, ctx)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        if self.forward_path is not None:
            return self.forward_path(self, x, ctx)  # type: ignore[arg-type]
        h = x["h"]  # (B, T, C)
        h = h + self.self_attn(self.input_layernorm(h))
        h = h + self.feed_forward(self.post_attention_layernorm(h), ctx)
        return {**x, "h": h}
