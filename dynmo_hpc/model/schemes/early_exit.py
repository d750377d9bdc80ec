"""Early exit (CALM-style): a confident token leaves the network; later layers skip it.

Mechanism: chosen blocks own a small exit head (LayerNorm + a d_model x vocab linear map). After
such a block, the exit head predicts the next byte for every token still active; a token whose
top softmax probability (CALM's "softmax response" confidence) is at least ``threshold`` exits.
The decision is a deterministic function of the data, so the single-process reference and every
pipeline partition make the same decisions.

What later layers compute: the payload carries an ``active`` mask (B, T) and the exited tokens'
hidden states unchanged. A later block gathers the active tokens (not a mask: the rows really go
away) and runs on them only its query projection, attention, output projection, LayerNorms,
feed-forward and exit head. Exited tokens still contribute keys and values, computed from their
carried hidden state, so active tokens keep attending to them (CALM's hidden-state propagation);
that projection (2 C^2 of a block's ~12 C^2 multiply-adds per token) is the only work a later
block spends on an exited token. The head runs its LayerNorm and LM head on active tokens only.

Loss (what ``ctx.loss``, the reported per-step loss, is): the mean over every token of the
cross-entropy of the prediction the network actually makes for it: the exit head's logits at the
layer where the token exited, or the final head's logits for tokens that never exited. The exit
cross-entropy travels to the last stage in the payload (``exit_nll``, (B, T), zero for tokens
that have not exited), with its gradient flowing back to the exit head and the layers below it.
Training the exits: each exit head also adds ``exit_loss_weight`` x its mean cross-entropy over
the tokens that reach it to the auxiliary losses (so exit heads learn before tokens use them).

On llama models the exit heads use RMSNorm, the embedding and head are the llama ones, and the
active tokens' queries are rotated by their own positions (``attend_active`` of
:class:`~.llama_blocks.LlamaSchemeAttention`).

Why a head per exit layer rather than the final head shared across stages: the exit layers and
the LM head live on different ranks, and a shared head would need its gradient all-reduced every
step and its weights kept in sync through migrations. A per-layer head is owned by its block and
travels with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_hpc.config import EarlyExitSection, ModelSection
from dynmo_hpc.model.families.llama import LlamaEmbedding, LlamaHead, RMSNorm
from dynmo_hpc.model.gpt import Embedding, Head, MicrobatchContext, Payload
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot, Spec


def exit_layers(section: EarlyExitSection, num_blocks: int) -> list[int]:
    """Blocks with an exit head: the configured list, or every block but the last."""
    return list(section.layers) if section.layers is not None else list(range(1, num_blocks))


def payload_spec(
    micro_batch_size: int, seq_len: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The payload keys early exit adds: the active mask and the exited tokens' losses."""
    shape = (micro_batch_size, seq_len)
    return {"active": (shape, torch.float32), "exit_nll": (shape, torch.float32)}


class ExitHead(nn.Module):
    """An exit block's own predictor and its exit rule."""

    def __init__(self, cfg: ModelSection, section: EarlyExitSection) -> None:
        super().__init__()
        self.ln: nn.Module = (
            RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.d_model)
        )
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.threshold = section.threshold
        self.loss_weight = section.exit_loss_weight
        self.register_buffer("enabled", torch.tensor(section.start_step == 0))
        """Whether tokens may exit yet (the controller switches it on at start_step)."""
        self.stats: dict[str, float] = {}
        """Since the last report: tokens reaching this exit, their summed confidence (mean =
        confidence_sum / reached, a guide for the threshold) and tokens exiting here."""

    def decide(
        self,
        h_act: Tensor,
        b_idx: Tensor,
        t_idx: Tensor,
        active: Tensor,
        exit_nll: Tensor,
        ctx: MicrobatchContext,
    ) -> Payload:
        """Predict for the active tokens (N, C); returns the updated ``active``/``exit_nll``."""
        logits = self.proj(self.ln(h_act))  # (N, V)
        ce = F.cross_entropy(logits, ctx.targets[b_idx, t_idx], reduction="none")  # (N,)
        ctx.aux_losses.append(self.loss_weight * ce.mean())
        with torch.no_grad():
            confidence = F.softmax(logits, dim=-1).amax(-1)  # (N,)
        self.stats["reached"] = self.stats.get("reached", 0.0) + float(b_idx.numel())
        self.stats["confidence_sum"] = self.stats.get("confidence_sum", 0.0) + float(
            confidence.sum()
        )
        if not bool(self.enabled):
            return {}
        leaving = confidence >= self.threshold  # (N,)
        lb, lt = b_idx[leaving], t_idx[leaving]
        self.stats["exited"] = self.stats.get("exited", 0.0) + float(lb.numel())
        active = active.clone()
        active[lb, lt] = False
        return {
            "active": active.to(torch.float32),
            "exit_nll": exit_nll.index_put((lb, lt), ce[leaving].to(exit_nll.dtype)),
        }


def _start_active(h: Tensor) -> Payload:
    B, T, _ = h.shape
    return {"h": h, "active": h.new_ones(B, T), "exit_nll": h.new_zeros(B, T)}


def _final_loss(logits_of: Any, x: Payload, ctx: MicrobatchContext) -> None:
    """``ctx.loss`` over every token: the final head on the active ones (``logits_of`` maps
    their (N, C) hidden states to logits), the carried exit losses for the others."""
    active = x["active"].detach() > 0.5  # (B, T)
    logits = logits_of(x["h"][active])  # (N, V)
    ce_sum = F.cross_entropy(logits, ctx.targets[active], reduction="sum")
    ctx.loss = (ce_sum + x["exit_nll"].sum()) / active.numel()


class EarlyExitEmbedding(Embedding):
    """Layer 0 of an early-exit model: every token starts active with no exit loss."""

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        return _start_active(super().forward(x, ctx)["h"])  # (B, T, C) and the masks


class LlamaEarlyExitEmbedding(LlamaEmbedding):
    """Layer 0 of a llama early-exit model (as :class:`EarlyExitEmbedding`)."""

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        return _start_active(super().forward(x, ctx)["h"])


class LlamaEarlyExitHead(LlamaHead):
    """The last layer of a llama early-exit model (as :class:`EarlyExitHead`)."""

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        _final_loss(lambda h: self.lm_head(self.norm(h)), x, ctx)
        return {}


class EarlyExitHead(Head):
    """The last layer of an early-exit model: LM loss over every token, exited or not.

    ``ctx.loss = (sum of final-head cross-entropy over active tokens + sum of exit_nll) / (B*T)``;
    the final LayerNorm and LM head run on the active tokens only.
    """

    def forward(self, x: Payload | None, ctx: MicrobatchContext) -> Payload:
        assert x is not None
        active = x["active"].detach() > 0.5  # (B, T)
        logits = self.lm_head(self.ln_f(x["h"][active]))  # (N, V)
        ce_sum = F.cross_entropy(logits, ctx.targets[active], reduction="sum")
        ctx.loss = (ce_sum + x["exit_nll"].sum()) / active.numel()
        return {}


def active_forward(block: SchemeBlock, x: Payload, ctx: MicrobatchContext) -> Payload:
    """A block of an early-exit model: it computes the active tokens only (the
    ``block.forward_path`` of every block of such a model)."""
    h = x["h"]  # (B, T, C)
    B, T, C = h.shape
    active = x["active"].detach() > 0.5  # (B, T)
    out = {**x, "active": x["active"].detach()}
    num_active = int(active.sum())
    stats = block.token_stats
    stats["tokens"] = stats.get("tokens", 0.0) + float(B * T)
    stats["processed"] = stats.get("processed", 0.0) + float(num_active)
    if num_active == 0:
        return out  # every token has exited: nothing to compute
    b_idx, t_idx = active.nonzero(as_tuple=True)  # (N,), (N,) row-major
    if num_active == B * T:
        h = h + block.attn(block.ln_1(h))
        h = h + block.feed_forward(block.ln_2(h), ctx)
        h_act = h.reshape(B * T, C)  # (N, C)
        out["h"] = h
    else:
        h_act = h[b_idx, t_idx] + block.attn.attend_active(block.ln_1(h), active, b_idx, t_idx)
        h_act = h_act + block.feed_forward(block.ln_2(h_act), ctx)  # (N, C)
        out["h"] = h.index_put((b_idx, t_idx), h_act.to(h.dtype))  # bf16 under autocast
    if isinstance(block.exit_head, ExitHead):
        out.update(block.exit_head.decide(h_act, b_idx, t_idx, active, x["exit_nll"], ctx))
    return out


class EarlyExitScheme(Scheme):
    """``schemes.early_exit``: exit heads on the chosen blocks, the active-token payload, and
    tokens allowed to exit from ``start_step`` on."""

    name = "early_exit"
    section_type = EarlyExitSection
    changes_block = True
    counter_attrs = ("stats", "token_stats")

    def replace_layer(self, kind: str) -> nn.Module | None:
        llama = self.cfg.model.arch == "llama"
        if kind == "embedding":
            return (LlamaEarlyExitEmbedding if llama else EarlyExitEmbedding)(self.cfg.model)
        if kind == "head":
            return (LlamaEarlyExitHead if llama else EarlyExitHead)(self.cfg.model)
        return None

    def configure_block(self, block: Any, index: int) -> None:
        block.forward_path = active_forward
        if index in exit_layers(self.section, self.cfg.model.num_blocks):
            block.exit_head = ExitHead(self.cfg.model, self.section)

    def payload_spec(self, micro_batch_size: int) -> Spec:
        return payload_spec(micro_batch_size, self.cfg.model.seq_len)

    def step_end(self, step: int, slots: Sequence[Slot], allgather: AllGather) -> None:
        enabled = step + 1 >= self.section.start_step
        for slot in slots:
            head = getattr(slot.module, "exit_head", None)
            if head is not None:
                head.enabled.fill_(enabled)
        return None
