"""Dynamic block-sparse causal attention: each query block attends to its top key blocks only.

The mechanism (in the spirit of routing / top-k block attention such as MoBA and NSA's selection
branch): the sequence is cut into blocks of ``block_size`` tokens. For every (batch, head, query
block) a cheap pooled score, mean query of the block times mean key of each causal key block,
ranks the key blocks; the query block keeps its own (local, diagonal) block plus the best others
until it holds ``ceil(density * (i + 1))`` of its ``i + 1`` causal key blocks. Only the kept
(query block, key block) pairs are computed: the kept key and value blocks are gathered, and each
query block attends over exactly them (one softmax over its kept keys), so a query never sees a
skipped block and no skipped block costs a multiply. With density 1 every causal block is
kept and the result equals dense causal attention (to float rounding).

The choice is made at run time from the data (per microbatch, layer, head and query block), and
the density may differ by layer and drift during training (:func:`density_at`), for instance
from a dense start to each layer's own density; the controller writes the current density into
each layer's ``attn.density`` buffer at every step end, so it travels with the layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dynmo_hpc.config import SparseAttentionSection
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot


def density_at(section: SparseAttentionSection, base_density: float, steps_done: int) -> float:
    """A layer's density after ``steps_done`` optimizer steps (linear drift, clamped to (0, 1]).

    Example: density 0.5, drift_factor 0.5 from step 10 to 30: 0.5 until step 10, 0.375 at 20,
    0.25 from 30 on. With ``initial_density`` 1.0 instead: 1.0 until step 10, 0.625 at 20, 0.25
    from 30 on (the start is shared by every layer, the end is each layer's own).
    """
    start, end = section.drift_start_step, section.drift_end_step
    initial = section.initial_density
    if steps_done <= start:
        density = base_density if initial is None else initial
    elif steps_done >= end:
        density = base_density * section.drift_factor
    elif initial is None:
        factor = 1.0 + (section.drift_factor - 1.0) * (steps_done - start) / (end - start)
        density = base_density * factor
    else:
        final = base_density * section.drift_factor
        density = initial + (final - initial) * (steps_done - start) / (end - start)
    return min(1.0, max(1e-6, density))


def blocks_kept_per_row(num_blocks: int, density: float) -> list[int]:
    """Key blocks kept by query block i: ceil(density * (i + 1)), at least its own block."""
    return [max(1, min(i + 1, math.ceil(density * (i + 1) - 1e-9))) for i in range(num_blocks)]


def rank_key_blocks(q: Tensor, k: Tensor, block_size: int) -> Tensor:
    """Key blocks of every query block, best first: its own block, then causal blocks by pooled
    score (mean query of the block . mean key of the key block), then the non-causal ones.

    q, k: (B, nh, T, hs). Returns (B, nh, nb, nb) int64 key-block indices; ties break by index.
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
        return score.argsort(dim=-1, descending=True, stable=True)


def select_key_blocks(
    q: Tensor, k: Tensor, block_size: int, density: float
) -> tuple[Tensor, Tensor]:
    """The kept (query block, key block) pairs, for inspection and tests.

    Returns ``q_block`` (P,) int64, the query block of each pair (the same for every batch row
    and head: the count per query block depends only on its index), and ``k_block``
    (B, nh, P) int64; pairs of a query block are contiguous and their key blocks ascend.
    """
    order = rank_key_blocks(q, k, block_size)  # (B, nh, nb, nb)
    nb = order.shape[-1]
    keep = blocks_kept_per_row(nb, density)
    k_block = torch.cat([order[:, :, i, : keep[i]].sort(dim=-1).values for i in range(nb)], -1)
    q_block = torch.repeat_interleave(
        torch.arange(nb, device=q.device), torch.tensor(keep, device=q.device)
    )
    return q_block, k_block


def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, block_size: int, density: float
) -> tuple[Tensor, int, int]:
    """Causal attention over the kept key blocks only.

    q, k, v: (B, nh, T, hs) with T a multiple of ``block_size``. Returns the output
    (B, nh, T, hs), the number of kept (query block, key block) pairs per (batch row, head), and
    the number of causal pairs a dense causal kernel computes.

    Query blocks that keep the same number n of key blocks form a group (they are contiguous,
    because n grows with the block index); a group's kept key and value blocks are gathered into
    (B, nh, R, n * bs, hs) and attended with one batched matmul and one softmax, so nothing is
    padded and no skipped block is touched. Kept blocks are in ascending order, so a query
    block's own (diagonal) block is the last one and takes the causal mask.
    """
    B, nh, T, hs = q.shape
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of block_size {block_size}")
    nb, bs = T // block_size, block_size
    keep = blocks_kept_per_row(nb, density)
    order = rank_key_blocks(q, k, block_size)  # (B, nh, nb, nb)
    qb = q.reshape(B, nh, nb, bs, hs) * (1.0 / math.sqrt(hs))
    kb = k.reshape(B, nh, nb, bs, hs)
    vb = v.reshape(B, nh, nb, bs, hs)
    upper = torch.ones(bs, bs, dtype=torch.bool, device=q.device).triu(1)  # (bs, bs)
    outputs = []
    start = 0
    while start < nb:
        n = keep[start]
        end = start
        while end < nb and keep[end] == n:
            end += 1
        rows = end - start
        kept = order[:, :, start:end, :n].sort(dim=-1).values  # (B, nh, R, n)
        index = kept.reshape(B, nh, rows * n)[..., None, None].expand(B, nh, rows * n, bs, hs)
        k_sel = torch.gather(kb, 2, index).reshape(B, nh, rows, n * bs, hs)  # (B, nh, R, n*bs, hs)
        v_sel = torch.gather(vb, 2, index).reshape(B, nh, rows, n * bs, hs)
        scores = qb[:, :, start:end] @ k_sel.transpose(-1, -2)  # (B, nh, R, bs, n*bs)
        mask = torch.zeros(bs, n * bs, dtype=torch.bool, device=q.device)
        mask[:, (n - 1) * bs :] = upper  # causal inside the diagonal block
        weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        outputs.append(weights @ v_sel)  # (B, nh, R, bs, hs)
        start = end
    y = torch.cat(outputs, dim=2)  # (B, nh, nb, bs, hs)
    return y.reshape(B, nh, T, hs), sum(keep), nb * (nb + 1) // 2


def base_density(section: SparseAttentionSection, num_blocks: int, index: int) -> float | None:
    """Layer ``index``'s configured attention density, or None if its attention is dense."""
    layers = list(section.layers) if section.layers is not None else list(range(1, num_blocks + 1))
    if index not in layers:
        return None
    if section.layer_density is not None:
        return section.layer_density[layers.index(index)]
    return section.density


class SparseAttentionScheme(Scheme):
    """``schemes.sparse_attention``: block-sparse attention whose density the controller
    rewrites at every step end (the ``attn.density`` buffer, which travels with the layer)."""

    name = "sparse_attention"
    section_type = SparseAttentionSection
    changes_block = True
    counter_attrs = ("stats",)

    def _base(self, index: int) -> float | None:
        return base_density(self.section, self.cfg.model.num_blocks, index)

    def configure_block(self, block: Any, index: int) -> None:
        density = self._base(index)
        if density is not None:
            block.attn.make_sparse(self.section.block_size, density_at(self.section, density, 0))

    def step_end(self, step: int, slots: Sequence[Slot], allgather: AllGather) -> None:
        for slot in slots:
            base = self._base(slot.index)
            density = getattr(getattr(slot.module, "attn", None), "density", None)
            if base is not None and isinstance(density, torch.Tensor):
                density.fill_(density_at(self.section, base, step + 1))
        return None

    def layer_stats(self, slot: Slot) -> dict[str, float]:
        density = getattr(getattr(slot.module, "attn", None), "density", None)
        return {} if density is None else {"attn.density": float(density)}
