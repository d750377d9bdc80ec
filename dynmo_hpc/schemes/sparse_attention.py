"""Dynamic block-sparse causal attention: each query block attends to its top key blocks only.

The mechanism (in the spirit of routing / top-k block attention such as MoBA and NSA's selection
branch): the sequence is cut into blocks of ``block_size`` tokens. For every (batch, head, query
block) a cheap pooled score, mean query of the block times mean key of each causal key block,
ranks the key blocks; the query block keeps its own (local, diagonal) block plus the best others
until it holds ``ceil(density * (i + 1))`` of its ``i + 1`` causal key blocks. Only the kept
(query block, key block) pairs are computed: scores and values are gathered per pair, and the
softmax is taken jointly over all pairs of a query block (a segmented softmax), so a query never
sees a skipped block and no skipped block costs a multiply. With density 1 every causal block is
kept and the result equals dense causal attention (to float rounding).

The choice is made at run time from the data (per microbatch, layer, head and query block), and
the density may differ by layer and drift during training (:func:`density_at`); the controller
writes the current density into each layer's ``attn.density`` buffer at every step end, so it
travels with the layer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import SparseAttentionSection


def density_at(section: SparseAttentionSection, base_density: float, steps_done: int) -> float:
    """A layer's density after ``steps_done`` optimizer steps (linear drift, clamped to (0, 1]).

    Example: density 0.5, drift_factor 0.5 from step 10 to 30: 0.5 until step 10, 0.375 at 20,
    0.25 from 30 on.
    """
    start, end = section.drift_start_step, section.drift_end_step
    if steps_done <= start or end == start:
        factor = 1.0 if steps_done <= start else section.drift_factor
    elif steps_done >= end:
        factor = section.drift_factor
    else:
        factor = 1.0 + (section.drift_factor - 1.0) * (steps_done - start) / (end - start)
    return min(1.0, max(1e-6, base_density * factor))


def blocks_kept_per_row(num_blocks: int, density: float) -> list[int]:
    """Key blocks kept by query block i: ceil(density * (i + 1)), at least its own block."""
    return [max(1, min(i + 1, math.ceil(density * (i + 1) - 1e-9))) for i in range(num_blocks)]


def select_key_blocks(
    q: Tensor, k: Tensor, block_size: int, density: float
) -> tuple[Tensor, Tensor]:
    """Choose the kept (query block, key block) pairs from pooled scores.

    Returns ``q_block`` (P,) int64, the query block of each pair (the same for every batch row
    and head, because the count per query block depends only on its index), and ``k_block``
    (B, nh, P) int64, the key block of each pair; pairs of a query block are contiguous and
    their key blocks ascend.
    """
    B, nh, T, hs = q.shape
    nb = T // block_size
    with torch.no_grad():
        q_pool = q.reshape(B, nh, nb, block_size, hs).mean(3)  # (B, nh, nb, hs)
        k_pool = k.reshape(B, nh, nb, block_size, hs).mean(3)  # (B, nh, nb, hs)
        score = q_pool @ k_pool.transpose(-1, -2)  # (B, nh, nb, nb)
        rows = torch.arange(nb, device=q.device)
        causal = rows[:, None] >= rows[None, :]  # (nb, nb)
        score = score.masked_fill(~causal, float("-inf"))
        score = score.masked_fill(torch.eye(nb, dtype=torch.bool, device=q.device), float("inf"))
        order = score.argsort(dim=-1, descending=True, stable=True)  # (B, nh, nb, nb)
        keep = blocks_kept_per_row(nb, density)
        k_block = torch.cat(
            [order[:, :, i, : keep[i]].sort(dim=-1).values for i in range(nb)], dim=-1
        )  # (B, nh, P)
        q_block = torch.repeat_interleave(rows, torch.tensor(keep, device=q.device))  # (P,)
    return q_block, k_block


def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, block_size: int, density: float
) -> tuple[Tensor, int, int]:
    """Causal attention over the kept key blocks only.

    q, k, v: (B, nh, T, hs) with T a multiple of ``block_size``. Returns the output
    (B, nh, T, hs), the number of kept (query block, key block) pairs per (batch row, head), and
    the number of causal pairs a dense causal kernel would compute.
    """
    B, nh, T, hs = q.shape
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of block_size {block_size}")
    nb = T // block_size
    bs = block_size
    q_block, k_block = select_key_blocks(q, k, block_size, density)
    num_pairs = q_block.numel()

    qb = q.reshape(B, nh, nb, bs, hs)
    kb = k.reshape(B, nh, nb, bs, hs)
    vb = v.reshape(B, nh, nb, bs, hs)
    q_pairs = qb[:, :, q_block]  # (B, nh, P, bs, hs)
    gather_index = k_block[..., None, None].expand(B, nh, num_pairs, bs, hs)
    k_pairs = torch.gather(kb, 2, gather_index)  # (B, nh, P, bs, hs)
    v_pairs = torch.gather(vb, 2, gather_index)  # (B, nh, P, bs, hs)

    scores = (q_pairs @ k_pairs.transpose(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, nh, P, bs, bs)
    diagonal = (k_block == q_block)[..., None, None]  # (B, nh, P, 1, 1)
    upper = torch.ones(bs, bs, dtype=torch.bool, device=q.device).triu(1)  # (bs, bs)
    scores = scores.masked_fill(diagonal & upper, float("-inf"))

    # Segmented softmax over every key of every pair that belongs to the same query block.
    with torch.no_grad():
        row_max = scores.amax(-1)  # (B, nh, P, bs)
        seg_max = torch.full((B, nh, nb, bs), float("-inf"), dtype=q.dtype, device=q.device)
        segment = q_block[None, None, :, None].expand(B, nh, num_pairs, bs)  # (B, nh, P, bs)
        seg_max = seg_max.scatter_reduce(2, segment, row_max, "amax")  # (B, nh, nb, bs)
    weights = torch.exp(scores - seg_max[:, :, q_block, :, None])  # (B, nh, P, bs, bs)
    denom = q.new_zeros(B, nh, nb, bs).index_add(2, q_block, weights.sum(-1))  # (B, nh, nb, bs)
    numer = q.new_zeros(B, nh, nb, bs, hs).index_add(2, q_block, weights @ v_pairs)
    y = numer / denom[..., None]  # (B, nh, nb, bs, hs)
    return y.reshape(B, nh, T, hs), num_pairs, nb * (nb + 1) // 2
