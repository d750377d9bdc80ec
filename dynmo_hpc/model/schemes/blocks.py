"""The transformer block the dynamic schemes plug into, and its prunable, sparsifiable attention.

Why one block class for every scheme: the schemes touch different parts of a block (the
feed-forward for MoE, the attention for sparse attention and head pruning, the set of tokens for
MoD and early exit), and a block may carry several of them at once (MoE experts that are pruned,
a frozen MoD block). :class:`SchemeBlock` keeps the base ``Block``'s parameter names and
registration order (``ln_1``, ``attn.c_attn``, ``attn.c_proj``, ``ln_2``, ``mlp...``) and adds the
scheme modules after them, so ``model.init_layer_`` initialises it deterministically from
``(seed, index)`` on any rank. With no scheme attached it computes bit-for-bit what ``Block``
computes (a test checks it).

Every piece of scheme state (expert routers, MoD routers, exit heads, the kept heads, the
attention density) is a submodule, buffer or attribute of the block, so it travels when the
block migrates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.gpt import Block, MicrobatchContext, Payload
from dynmo_hpc.model.schemes import sparse_attention
from dynmo_hpc.model.schemes.moe import MoEFeedForward


def feed_forward(mlp: nn.Module, x: Tensor, ctx: MicrobatchContext) -> Tensor:
    """A block's feed-forward ``mlp`` on (..., C), dense or MoE (which sees the tokens as rows
    and appends its balancing loss to ``ctx``); shared by every family's scheme block."""
    if isinstance(mlp, MoEFeedForward):
        shape = x.shape
        y, aux = mlp(x.reshape(-1, shape[-1]))  # (N, C)
        ctx.aux_losses.append(aux)
        return y.view(shape)
    out: Tensor = mlp(x)
    return out


class SchemeAttention(nn.Module):
    """Causal self-attention with a variable number of heads and optional block sparsity.

    The parameters are laid out as in ``model.gpt.CausalSelfAttention`` (``c_attn`` holds the query,
    key and value rows of every head, ``c_proj`` maps the heads back to ``d_model``), but the
    head count may shrink: structural pruning removes a head's rows from ``c_attn`` and its
    columns from ``c_proj``, so the matrices really get smaller. ``head_size`` never changes.
    """

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.head_size = d_model // num_heads
        self.num_heads = num_heads
        """Heads still present (shrinks when heads are pruned)."""
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.sparse_block_size: int | None = None
        """Tokens per block when attention is block-sparse; None = dense causal attention."""
        self.density: Tensor | None
        self.register_buffer("density", None)  # not in the state dict until make_sparse
        """Block-sparse only: fraction of causal key blocks each query block keeps (a buffer,
        rewritten by the controller at every step end)."""
        self.stats: dict[str, float] = {}
        """Kept and causal key blocks since the last report (for the run log)."""

    def make_sparse(self, block_size: int, density: float) -> None:
        """Switch to dynamic block-sparse attention (see :mod:`.sparse_attention`)."""
        self.sparse_block_size = block_size
        self.register_buffer("density", torch.tensor(density, dtype=torch.float64))

    @property
    def inner_dim(self) -> int:
        """Width of the concatenated heads: num_heads * head_size."""
        return self.num_heads * self.head_size

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q, k, v, each (B, nh, T, hs)."""
        B, T, _ = x.shape
        nh, hs = self.num_heads, self.head_size
        q, k, v = self.c_attn(x).split(self.inner_dim, dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """(B, T, C) -> (B, T, C); ``positions`` is ignored (gpt2's positions are in the
        residual stream already; rotary families use it)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.sparse_block_size is None or self.density is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            y, kept, causal = sparse_attention.block_sparse_attention(
                q, k, v, self.sparse_block_size, float(self.density)
            )
            self.stats["kept_blocks"] = self.stats.get("kept_blocks", 0.0) + kept
            self.stats["causal_blocks"] = self.stats.get("causal_blocks", 0.0) + causal
        y = y.transpose(1, 2).contiguous().view(B, T, self.inner_dim)  # (B, T, nh * hs)
        return self.c_proj(y)

    def attend_active(self, hn: Tensor, active: Tensor, b_idx: Tensor, t_idx: Tensor) -> Tensor:
        """Attention output (N, C) for the active tokens only; keys/values come from all tokens.

        hn: (B, T, C) the block's normed input; active: (B, T) bool; (b_idx, t_idx): the N active
        positions in row-major order. Queries are packed per sequence into (B, Qmax) slots, with
        Qmax the most active tokens in any sequence; padded slots are computed and discarded.
        """
        B, T, _ = hn.shape
        nh, hs, inner = self.num_heads, self.head_size, self.inner_dim
        w_q, w_k, w_v = self.c_attn.weight.split(inner, dim=0)
        b_q, b_k, b_v = self.c_attn.bias.split(inner, dim=0)
        k = F.linear(hn, w_k, b_k).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = F.linear(hn, w_v, b_v).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        slot = (active.long().cumsum(1) - 1)[b_idx, t_idx]  # (N,) rank within its sequence
        q_max = int(active.sum(1).max())
        q_act = F.linear(hn[b_idx, t_idx], w_q, b_q)  # (N, nh * hs)
        q = hn.new_zeros(B, q_max, inner, dtype=q_act.dtype)  # bf16 under autocast
        q = q.index_put((b_idx, slot), q_act)  # (B, Qmax, nh * hs)
        q = q.view(B, q_max, nh, hs).transpose(1, 2)  # (B, nh, Qmax, hs)
        pos = torch.full((B, q_max), -1, dtype=torch.long, device=hn.device)
        pos = pos.index_put((b_idx, slot), t_idx)  # (B, Qmax), -1 = padding
        keys = torch.arange(T, device=hn.device)
        allowed = keys[None, None, :] <= pos[:, :, None]  # (B, Qmax, T) causal by position
        allowed = allowed | ((pos < 0)[:, :, None] & (keys == 0))  # padding sees key 0, no NaN
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])  # (B, nh, Qmax, hs)
        y = y.transpose(1, 2).reshape(B, q_max, inner)[b_idx, slot]  # (N, nh * hs)
        return self.c_proj(y)  # (N, C)


class SchemeBlock(Block):
    """A pre-norm block whose feed-forward, attention and token set the schemes may change.

    Attributes the schemes' ``configure_block`` hooks set (all default to the plain block):

    * ``mlp``: an ``MLP`` or a :class:`~.moe.MoEFeedForward`;
    * ``attn.make_sparse(...)``: dynamic block-sparse attention;
    * ``depth_router``: a :class:`~.mod.DepthRouter` (Mixture of Depths);
    * ``exit_head``: an :class:`~.early_exit.ExitHead`;
    * ``forward_path``: a module-level function ``(block, x, ctx) -> payload`` that replaces the
      dense forward (MoD's routed path, early exit's active-tokens path); a plain function, so
      it pickles by name when the block migrates.
    """

    def __init__(self, cfg: ModelSection, d_ff: int) -> None:
        super().__init__(cfg, d_ff)
        self.attn: SchemeAttention = SchemeAttention(cfg.d_model, cfg.num_heads)
        self.depth_router: nn.Module | None = None
        self.exit_head: nn.Module | None = None
        self.forward_path: ForwardPath | None = None
        self.token_stats: dict[str, float] = {}
        """Tokens seen and tokens computed since the last report (early-exit models)."""

    def feed_forward(self, x: Tensor, ctx: MicrobatchContext) -> Tensor:
        """The block's feed-forward on (..., C) (:func:`feed_forward`)."""
        return feed_forward(self.mlp, x, ctx)

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        if self.forward_path is not None:
            return self.forward_path(self, x, ctx)
        h = x["h"]  # (B, T, C)
        h = h + self.attn(self.ln_1(h))
        h = h + self.feed_forward(self.ln_2(h), ctx)
        return {**x, "h": h}


ForwardPath = Callable[[SchemeBlock, Payload, MicrobatchContext], Payload]
"""A scheme's replacement for :meth:`SchemeBlock.forward` (see ``forward_path``)."""
