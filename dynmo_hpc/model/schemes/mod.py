"""Mixture of Depths (Raposo et al., 2024): a routed block processes only its top tokens.

Mechanism: a linear router gives every token of a sequence a scalar score; the block keeps the
``k = ceil(capacity * T)`` highest-scoring tokens of each sequence (expert-choice routing, so
every sequence sends exactly k tokens and shapes stay static). Those k tokens are gathered in
position order and run through the whole block (attention among the selected tokens only,
causal in position order, then the feed-forward), so attention costs ~k^2 and the rest ~k per
sequence instead of T^2 and T. The other tokens skip the block on the residual path, unchanged.

Capacity annealing (``initial_capacity``, an addition to the paper, which trains at its final
capacity from the start): every routed block starts at a shared capacity (e.g. 1.0, dense) that
moves linearly to the block's own between two steps, like a dense model being converted to MoD.
The current value is a buffer the controller rewrites at every step end, so it travels with the
block and is in its checkpoint.

As in the paper, the router's weight multiplies the block's update, ``h + w * (block(h) - h)``,
which is what trains the router; here ``w = sigmoid(score)`` to keep the update bounded.

Note on causality: choosing the top-k over the whole sequence lets a future token's score
influence whether an earlier token is processed; that is how MoD is trained in the paper (which
adds a causal predictor for sampling). The losses and gradients here are exactly those of that
training objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dynmo_hpc.config import MoDSection, every_other_block
from dynmo_hpc.model.gpt import MicrobatchContext, Payload
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot


def tokens_processed(seq_len: int, capacity: float) -> int:
    """Tokens per sequence a routed block processes: ceil(capacity * seq_len), at least 1."""
    return max(1, min(seq_len, math.ceil(capacity * seq_len - 1e-9)))


def capacity_at(section: MoDSection, own_capacity: float, steps_done: int) -> float:
    """A routed block's capacity after ``steps_done`` optimizer steps (linear annealing).

    Example: initial_capacity 1.0, own capacity 0.125, anneal from step 10 to 30: 1.0 until step
    10, 0.5625 at 20, 0.125 from 30 on. Without initial_capacity: always the own capacity.
    """
    initial = section.initial_capacity
    start, end = section.anneal_start_step, section.anneal_end_step
    if initial is None or (steps_done >= end and steps_done > start):
        return own_capacity
    if steps_done <= start:
        return initial
    return initial + (own_capacity - initial) * (steps_done - start) / (end - start)


class DepthRouter(nn.Module):
    """The per-block router and its capacity (fraction of tokens processed)."""

    def __init__(self, d_model: int, capacity: float, start_capacity: float | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=False)
        self.capacity = capacity
        """The block's own (configured) capacity."""
        self.current_capacity: Tensor | None
        self.register_buffer(
            "current_capacity",
            None if start_capacity is None else torch.tensor(start_capacity, dtype=torch.float64),
        )
        """With capacity annealing, the capacity in force (rewritten by the controller at every
        step end); None (and not in the state dict) without it."""
        self.stats: dict[str, float] = {}
        """Tokens seen and processed since the last report (for the run log)."""
        self.last_selected: Tensor | None = None
        """(B, k) positions processed in the latest forward (tests, diagnostics)."""

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, C) -> selected positions (B, k) ascending, their router weights (B, k, 1)."""
        B, T, _ = h.shape
        capacity = self.capacity if self.current_capacity is None else float(self.current_capacity)
        k = tokens_processed(T, capacity)
        score = self.proj(h).squeeze(-1)  # (B, T)
        top = score.detach().topk(k, dim=1).indices.sort(dim=1).values  # (B, k)
        weight = torch.sigmoid(score.gather(1, top))[..., None]  # (B, k, 1)
        self.last_selected = top
        self.stats["tokens"] = self.stats.get("tokens", 0.0) + B * T
        self.stats["processed"] = self.stats.get("processed", 0.0) + B * k
        return top, weight


def routed_forward(block: SchemeBlock, x: Payload, ctx: MicrobatchContext) -> Payload:
    """A MoD block's forward: the selected tokens go through the block, the others pass
    unchanged (``block.forward_path`` of a routed block)."""
    assert block.depth_router is not None
    h = x["h"]  # (B, T, C)
    B, _, C = h.shape
    top, weight = block.depth_router(h)  # (B, k), (B, k, 1)
    index = top[..., None].expand(B, top.shape[1], C)  # (B, k, C)
    h_sel = h.gather(1, index)  # (B, k, C)
    u = h_sel + block.attn(block.ln_1(h_sel), positions=top)  # (B, k, C): causal, sorted
    u = u + block.feed_forward(block.ln_2(u), ctx)
    h_new = h_sel + weight * (u - h_sel)  # (B, k, C)
    return {**x, "h": h.scatter(1, index, h_new.to(h.dtype))}  # bf16 under autocast


class MoDScheme(Scheme):
    """``schemes.mod``: routers on the selected blocks, capacity annealed at every step end."""

    name = "mod"
    section_type = MoDSection
    changes_block = True
    counter_attrs = ("stats",)

    def configure_block(self, block: Any, index: int) -> None:
        section: MoDSection = self.section
        routed = section.layers
        if routed is None:
            routed = every_other_block(self.cfg.model.num_blocks)
        if index not in routed:
            return
        capacities = section.layer_capacity
        capacity = capacities[routed.index(index)] if capacities else section.capacity
        start = None if section.initial_capacity is None else capacity_at(section, capacity, 0)
        block.depth_router = DepthRouter(self.cfg.model.d_model, capacity, start)
        block.forward_path = routed_forward

    def step_end(self, step: int, slots: Sequence[Slot], allgather: AllGather) -> None:
        if self.section.initial_capacity is None:
            return None
        for slot in slots:
            router = getattr(slot.module, "depth_router", None)
            if isinstance(router, DepthRouter) and router.current_capacity is not None:
                router.current_capacity.fill_(capacity_at(self.section, router.capacity, step + 1))
        return None

    def layer_stats(self, slot: Slot) -> dict[str, float]:
        router = getattr(slot.module, "depth_router", None)
        if isinstance(router, DepthRouter) and router.current_capacity is not None:
            return {"depth_router.capacity": float(router.current_capacity)}
        return {}
