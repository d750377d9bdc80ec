"""Mixture of Depths (Raposo et al., 2024): a routed block processes only its top tokens.

Mechanism: a linear router gives every token of a sequence a scalar score; the block keeps the
``k = ceil(capacity * T)`` highest-scoring tokens of each sequence (expert-choice routing, so
every sequence sends exactly k tokens and shapes stay static). Those k tokens are gathered in
position order and run through the whole block (attention among the selected tokens only,
causal in position order, then the feed-forward), so attention costs ~k^2 and the rest ~k per
sequence instead of T^2 and T. The other tokens skip the block on the residual path, unchanged.

As in the paper, the router's weight multiplies the block's update, ``h + w * (block(h) - h)``,
which is what trains the router; here ``w = sigmoid(score)`` to keep the update bounded.

Note on causality: choosing the top-k over the whole sequence lets a future token's score
influence whether an earlier token is processed; that is how MoD is trained in the paper (which
adds a causal predictor for sampling). The losses and gradients here are exactly those of that
training objective.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def tokens_processed(seq_len: int, capacity: float) -> int:
    """Tokens per sequence a routed block processes: ceil(capacity * seq_len), at least 1."""
    return max(1, min(seq_len, math.ceil(capacity * seq_len - 1e-9)))


class DepthRouter(nn.Module):
    """The per-block router and its capacity (fraction of tokens processed)."""

    def __init__(self, d_model: int, capacity: float) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=False)
        self.capacity = capacity
        self.stats: dict[str, float] = {}
        """Tokens seen and processed since the last report (for the run log)."""
        self.last_selected: Tensor | None = None
        """(B, k) positions processed in the latest forward (tests, diagnostics)."""

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, C) -> selected positions (B, k) ascending, their router weights (B, k, 1)."""
        B, T, _ = h.shape
        k = tokens_processed(T, self.capacity)
        score = self.proj(h).squeeze(-1)  # (B, T)
        top = score.detach().topk(k, dim=1).indices.sort(dim=1).values  # (B, k)
        weight = torch.sigmoid(score.gather(1, top))[..., None]  # (B, k, 1)
        self.last_selected = top
        self.stats["tokens"] = self.stats.get("tokens", 0.0) + B * T
        self.stats["processed"] = self.stats.get("processed", 0.0) + B * k
        return top, weight
