"""The operations a layer is the sum of: each one's FLOPs, bytes and op count, per pass; pure.

Why a module of its own: :mod:`dynmo_hpc.sim.cost_model` composes layers from these; here is how
one operation's work is counted (the rules the whole cost model follows).

The work model, per microbatch, as a list of operations (:class:`OpCost`):

- FLOPs count the matmuls only, 2 per multiply-add (``2 m k n`` for an ``(m, k) @ (k, n)``);
  LayerNorm, GELU, softmax and residual adds are counted in bytes (they are memory-bound), so
  the fitted bytes rate absorbs their few FLOPs per element. Biases add no FLOPs (one add per
  output, next to ``k`` multiply-adds), but a bias's gradient re-reads the output's gradient
  (bytes, in the weight-gradient half);
- bytes are float32 values read and written, each operand once per kernel: a matmul reads its two
  inputs and writes its output; an elementwise operation reads and writes one tensor forward and
  reads two (its saved input, the output's gradient) and writes one backward; attention is fused
  (the score matrix is not written to memory, as scaled-dot-product kernels do);
- backward of a matmul with a weight is an input-gradient matmul (same FLOPs and bytes as the
  forward) and a weight-gradient matmul (same again); attention's two products have no weight and
  their backward is two products each (4x the forward's score FLOPs in all, all input gradient);
- causal attention counts the (query, key) pairs its fused kernel computes: the kernel walks
  the queries in tiles of :func:`causal_tile` rows and computes, for each tile, every key up to
  the tile's last query, so ``t_q (t_kv + tile) / 2`` per head per sequence (at most
  ``t_q t_kv``), not the exact ``t_q (t_kv + 1) / 2``; MoD's kept tokens attend among themselves;
  early exit's active queries attend to every token's keys through an explicit mask, so its
  kernel computes all ``t_q t_kv`` pairs. Attention's FLOPs are also counted apart
  (``LayerCost.forward_attention_flops``): products whose inner or outer size is the head size
  run at a rate of their own (``LayerRates.attention_flops_per_s``);
- indexed bytes: element gathers and scatters (MoD's routing, block-sparse attention's kept key
  blocks: ``torch.gather`` with an int64 index per element) move each element with its index,
  at a rate of their own (``LayerRates.indexed_bytes_per_s``): 16 bytes an element (value read,
  value written, index). Row gathers (early exit's ``h[b, t]`` and ``index_put``: one index
  per row of ``d_model`` values) are streaming copies: plain bytes;
- block-sparse attention (``attention_density < 1``) is the project's kernel
  (:mod:`dynmo_hpc.model.schemes.sparse_attention`): whole ``sparse_block_size`` key blocks,
  gathered, with the score matrix materialised (its bytes counted) and one op group per run of
  query blocks that keep equally many key blocks;
- ops: each operation with work in a pass counts one toward the pass's op count, which the
  rates charge ``op_overhead_s`` each (dispatch of a few small kernels); ops are of a kind
  (:data:`OpKind`: a matmul with its weight, index bookkeeping such as gathers, scatters and
  top-k, an embedding lookup, or anything else) and a kind may carry its own per-op cost
  (``LayerRates.matmul_op_overhead_s`` and the like): a Linear's call, a gather's index
  checks and an embedding's lookup dispatch different amounts of host work;
- weight bytes: the parameters an op reads in a pass (a matmul's weight forward and for its
  input gradient, its weight gradient written; an embedding's tables), counted again apart from
  the plain bytes so that a machine can charge them at a rate of their own
  (``LayerRates.weight_bytes_per_s``): between two passes of a layer the other layers run, so
  its weights come back from memory rather than from cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

BYTES_PER_VALUE = 4
"""float32, what the trainer computes in."""

OpKind = Literal["matmul", "index", "lookup", "other"]
"""What an op is, for its per-op cost: a matmul (``nn.Linear``), index bookkeeping (gathers,
scatters, top-k, masks of token selection), an embedding lookup, or anything else (LayerNorm,
GELU, softmax, residual adds, attention)."""


@dataclass(frozen=True)
class OpCost:
    """One operation's work: forward, backward input gradient, backward weight gradient."""

    forward_flops: float = 0.0
    forward_bytes: float = 0.0
    dgrad_flops: float = 0.0
    dgrad_bytes: float = 0.0
    wgrad_flops: float = 0.0
    wgrad_bytes: float = 0.0
    forward_indexed_bytes: float = 0.0
    """Bytes moved by gathers and scatters (with their indices), forward."""
    dgrad_indexed_bytes: float = 0.0
    """Bytes moved by gathers and scatters in the input-gradient backward."""
    count: int = 1
    """Operations this entry stands for in the forward (a kernel's loop, two lookups): what
    the per-op overhead of its :attr:`kind` is charged for. An op is about a Linear's or a
    LayerNorm's dispatch: a module call and a few small kernels."""
    backward_count: int | None = None
    """Operations in the backward; None: ``count``. Index bookkeeping (masks, positions, top-k)
    runs forward only."""
    attention: bool = False
    """Attention's products (scores, weighted values): FLOPs at ``attention_flops_per_s``."""
    kind: OpKind = "other"
    """What the op is, for its per-op cost (:data:`OpKind`)."""
    forward_weight_bytes: float = 0.0
    """Parameter bytes read forward (also in ``forward_bytes``; charged again at
    ``LayerRates.weight_bytes_per_s``)."""
    dgrad_weight_bytes: float = 0.0
    """Parameter bytes read for the input gradient."""
    wgrad_weight_bytes: float = 0.0
    """Parameter-gradient bytes written (dropped when frozen)."""

    def has_forward(self) -> bool:
        """Whether the forward does any work (counts toward the forward's ops)."""
        return bool(self.forward_flops or self.forward_bytes or self.forward_indexed_bytes)

    def has_backward(self, frozen: bool) -> bool:
        """Whether the backward does any work; a frozen layer's weight gradient does none."""
        dgrad = self.dgrad_flops or self.dgrad_bytes or self.dgrad_indexed_bytes
        return bool(dgrad or (not frozen and (self.wgrad_flops or self.wgrad_bytes)))


def matmul(m: float, k: float, n: float, *, weight: bool = True, bias: bool = False) -> OpCost:
    """``(m, k) @ (k, n)``: 2 m k n FLOPs, the three operands' bytes, per pass; a weight-less
    product has no weight-gradient part. With a ``bias`` (``nn.Linear``'s default), the weight
    gradient also sums the output's gradient over the rows: ``m n`` values read again."""
    flops = 2.0 * m * k * n
    nbytes = (m * k + k * n + m * n) * BYTES_PER_VALUE
    if not weight:
        return OpCost(flops, nbytes, 2 * flops, 2 * nbytes, kind="matmul")
    bias_bytes = (m * n + n) * BYTES_PER_VALUE if bias else 0.0
    weight_bytes = k * n * BYTES_PER_VALUE
    return OpCost(
        flops,
        nbytes,
        flops,
        nbytes,
        flops,
        nbytes + bias_bytes,
        kind="matmul",
        forward_weight_bytes=weight_bytes,
        dgrad_weight_bytes=weight_bytes,
        wgrad_weight_bytes=weight_bytes,
    )


def elementwise(elements: float) -> OpCost:
    """LayerNorm, GELU, softmax, a residual add: read and write forward, read two and write one
    backward; no FLOPs counted."""
    return OpCost(0.0, 2.0 * elements * BYTES_PER_VALUE, 0.0, 3.0 * elements * BYTES_PER_VALUE)


def causal_tile(t_q: float) -> int:
    """Query rows per tile of the fused causal attention kernel: PyTorch's CPU flash attention
    splits the queries into 32 rows below 192 of them, 64 below 768, 256 from there on (the
    measured layers run 64 and 128 tokens: 32)."""
    if t_q < 192:
        return 32
    return 64 if t_q < 768 else 256


def causal_pairs(t_q: float, t_kv: float) -> float:
    """(query, key) pairs a tiled causal kernel computes per sequence and channel: each tile of
    ``tile`` queries takes every key up to its last query, ``t_q (t_kv + tile) / 2`` in all
    (the exact causal count is ``t_q (t_kv + 1) / 2``), at most ``t_q t_kv``."""
    return min(t_q * t_kv, t_q * (t_kv + causal_tile(t_q)) / 2)


def attention_core(
    batch: int, width: float, t_q: float, t_kv: float, density: float, *, masked: bool = False
) -> OpCost:
    """Scores and weighted values of ``width`` attention channels (heads x head size), fused.

    Pairs per sequence: ``density * causal_pairs(t_q, t_kv)`` (``masked``: all ``t_q t_kv``,
    as a kernel given an explicit mask computes); each costs ``2 width`` FLOPs in ``Q K^T`` and
    again in ``A V``; backward is two products per forward product. Bytes: Q, K, V read and Y
    written forward; Q, K, V, dY read and dQ, dK, dV written backward (Y is re-read as well by
    fused kernels: counted)."""
    pairs = t_q * t_kv if masked else density * causal_pairs(t_q, t_kv)
    flops = 4.0 * batch * pairs * width
    forward_bytes = batch * width * (2 * t_q + 2 * t_kv) * BYTES_PER_VALUE
    backward_bytes = batch * width * (4 * t_q + 4 * t_kv) * BYTES_PER_VALUE
    return OpCost(flops, forward_bytes, 2 * flops, backward_bytes, attention=True)


INDEX_BYTES = 8
"""int64, the index of a gather or scatter, one per element moved."""
INDEXED_BYTES_PER_ELEMENT = 2 * BYTES_PER_VALUE + INDEX_BYTES


def gather(elements: float, source_elements: float) -> OpCost:
    """Gather ``elements`` values out of a ``source_elements`` tensor; backward scatters their
    gradients into a zeroed gradient of the source (plain bytes: the zero fill)."""
    moved = elements * INDEXED_BYTES_PER_ELEMENT
    zeros = source_elements * BYTES_PER_VALUE
    return OpCost(
        forward_indexed_bytes=moved, dgrad_bytes=zeros, dgrad_indexed_bytes=moved, kind="index"
    )


def scatter(elements: float, target_elements: float) -> OpCost:
    """Write ``elements`` values into a copy of a ``target_elements`` tensor (out of place);
    backward copies the target's gradient with those places zeroed and gathers theirs."""
    moved = elements * INDEXED_BYTES_PER_ELEMENT
    copy = 2 * target_elements * BYTES_PER_VALUE
    return OpCost(
        forward_bytes=copy,
        forward_indexed_bytes=moved,
        dgrad_bytes=copy,
        dgrad_indexed_bytes=2 * moved,
        kind="index",
    )


def row_gather(elements: float, source_elements: float) -> OpCost:
    """Gather whole rows (``h[b, t]``: one index per row of values): a streaming copy, read
    and write; backward zeroes the source's gradient and copies the rows' gradients in."""
    copy = 2 * elements * BYTES_PER_VALUE
    return OpCost(
        forward_bytes=copy, dgrad_bytes=source_elements * BYTES_PER_VALUE + copy, kind="index"
    )


def row_scatter(elements: float, target_elements: float) -> OpCost:
    """Put whole rows into a copy of a ``target_elements`` tensor (``index_put``); backward
    copies the target's gradient and copies the rows' gradients out."""
    copy = 2 * (target_elements + elements) * BYTES_PER_VALUE
    return OpCost(forward_bytes=copy, dgrad_bytes=copy, kind="index")


def blocks_kept(num_blocks: int, density: float) -> list[int]:
    """Key blocks each query block keeps: ``ceil(density (i + 1))``, at least its own (the
    rule of :func:`dynmo_hpc.model.schemes.sparse_attention.blocks_kept_per_row`)."""
    return [max(1, min(i + 1, math.ceil(density * (i + 1) - 1e-9))) for i in range(num_blocks)]


GROUP_OPS = 3
"""Ops a group of block-sparse attention stands for: about ten small kernels (sort, two gathers,
two products, the mask, the softmax), about three times a plain op's (a Linear's, a LayerNorm's)."""
RANK_OPS = 3
"""Ops of the key-block ranking (pooling, scores, masks, argsort: about eight kernels, no
gradient)."""


def block_sparse_attention(
    batch: int, width: float, heads: float, t_q: float, density: float, block_size: int
) -> dict[str, OpCost]:
    """The project's block-sparse attention over ``t_q`` tokens (queries and keys alike).

    ``density`` of the ``nb (nb + 1) / 2`` causal key blocks are kept (``nb = t_q /
    block_size``), each computed whole: ``2 bs^2 width`` FLOPs per kept block in each of the
    two products. The score matrix (``heads bs^2`` values per kept block) is written by the
    first product, read and written by the mask and the softmax, and read by the second (6
    passes forward, 9 backward); the kept key and value blocks are gathered (indexed bytes).
    One ``group`` op per run of query blocks with equal counts, as the kernel loops."""
    bs = block_size
    nb = max(1.0, t_q / bs)
    kept = density * nb * (nb + 1) / 2
    flops = 4.0 * batch * kept * bs * bs * width
    scores = batch * heads * kept * bs * bs * BYTES_PER_VALUE
    qkv = batch * width * t_q
    groups = len(set(blocks_kept(max(1, round(nb)), density)))
    return {
        "attention": OpCost(
            flops, 6 * scores, 2 * flops, 9 * scores, count=GROUP_OPS * groups, attention=True
        ),
        "attention_rank": OpCost(
            forward_bytes=2 * qkv * BYTES_PER_VALUE, count=RANK_OPS, kind="index"
        ),
        "attention_gather": gather(2 * batch * kept * bs * width, 2 * qkv),
    }
