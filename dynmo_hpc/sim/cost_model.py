"""Per-layer forward and backward cost from the layer's shape and its scheme state.

Why: a run log measures the layers of the model it trained, on the machine it ran on. To ask
what a dynamic scheme does to a larger model, or on another machine, the simulator needs each
layer's work as a function of what it is (d_model, d_ff, heads, sequence length, micro batch)
and of what the scheme has done to it (neurons and heads kept, tokens kept, attention density,
frozen or not, expert loads), then that work times a machine's rates
(:class:`~dynmo_hpc.sim.machine.LayerRates`). This module is that function; pure arithmetic.

The work model, per microbatch, is a list of operations (:class:`~dynmo_hpc.sim.cost_ops.OpCost`,
counted as :mod:`dynmo_hpc.sim.cost_ops` describes).

Scheme state (:class:`SchemeState`) and what it removes:

- pruning: ``neurons_kept`` shrinks d_ff, ``heads_kept`` shrinks the attention width;
- MoD and early exit: ``tokens_kept`` of the micro batch's tokens run the block (``kv_tokens_kept``
  of them still project keys and values: all for early exit); a MoD block (``tokens_kept < 1``,
  ``kv_tokens_kept`` None) also routes: a router over every token, the kept tokens gathered in
  and scattered back;
- sparse attention: ``attention_density`` of the causal key blocks (kept blocks over causal
  blocks, as the run log records them);
- MoE: ``expert_loads``, each expert's tokens as a fraction of the block's, replace the dense
  feed-forward (one expert MLP per entry, plus the router); ``padded`` runs every expert on the
  busiest one's load;
- freezing: ``frozen`` drops the weight-gradient half of the backward; ``frozen_prefix`` (inside
  the prefix below the first trainable layer) drops the backward altogether.

Time of a pass: ``(flops - attention_flops) / flops_per_s + attention_flops /
attention_flops_per_s + bytes / bytes_per_s + indexed_bytes / indexed_bytes_per_s + ops *
op_overhead_s + overhead_s`` and the optional terms above (:func:`pass_time_s`; the backward
may have a matmul FLOP rate of its own); a pass with no work (a frozen prefix's backward)
costs 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from dynmo_hpc.config import ModelSection
from dynmo_hpc.sim.cost_ops import (  # noqa: F401  (re-exported: the cost model's vocabulary)
    BYTES_PER_VALUE,
    GROUP_OPS,
    INDEX_BYTES,
    INDEXED_BYTES_PER_ELEMENT,
    RANK_OPS,
    OpCost,
    OpKind,
    attention_core,
    block_sparse_attention,
    blocks_kept,
    causal_pairs,
    causal_tile,
    elementwise,
    gather,
    matmul,
    row_gather,
    row_scatter,
    scatter,
)
from dynmo_hpc.sim.machine import LayerRates

LayerKind = Literal["embedding", "block", "head"]


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """A layer's shape and the microbatch it runs: what its work scales with."""

    kind: LayerKind
    d_model: int
    d_ff: int = 0
    """Feed-forward width (each expert's, for MoE); blocks only."""
    num_heads: int = 1
    seq_len: int
    micro_batch: int
    vocab_size: int = 256
    """Embedding rows; head and exit-head outputs."""

    def check(self) -> None:
        """ValueError naming the field when a size is not a positive integer (d_ff of a block)."""
        if self.kind not in ("embedding", "block", "head"):
            raise ValueError(f"kind={self.kind!r}; expected embedding, block or head")
        sizes = ["d_model", "num_heads", "seq_len", "micro_batch", "vocab_size"]
        for name in [*sizes, *(["d_ff"] if self.kind == "block" else [])]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")


@dataclass(frozen=True, kw_only=True)
class SchemeState:
    """What a dynamic scheme has done to one layer at one step (default: nothing)."""

    neurons_kept: float = 1.0
    """Fraction of the d_ff feed-forward neurons left by pruning, in (0, 1]."""
    heads_kept: float = 1.0
    """Fraction of the attention heads left by pruning, in (0, 1]."""
    tokens_kept: float = 1.0
    """Fraction of the micro batch's tokens the layer runs on (MoD capacity, early exit's active
    tokens), in (0, 1]."""
    kv_tokens_kept: float | None = None
    """Fraction whose keys and values are projected and attended to; None: ``tokens_kept`` (MoD).
    Early exit: 1.0 (exited tokens keep their keys and values)."""
    attention_density: float = 1.0
    """Fraction of the causal (query, key) pairs computed (sparse attention), in (0, 1]."""
    frozen: bool = False
    """No weight gradients: the backward computes input gradients only."""
    frozen_prefix: bool = False
    """Inside the frozen prefix: no backward at all (implies ``frozen``)."""
    expert_loads: tuple[float, ...] | None = None
    """MoE: per expert, its tokens as a fraction of the layer's kept tokens (sum ``top_k`` with
    nothing dropped); None: the dense feed-forward."""
    padded: bool = False
    """MoE ``dispatch: padded``: every expert runs the busiest expert's load."""
    exit_head: bool = False
    """Early exit: the block owns an exit head (LayerNorm and a d_model x vocab map)."""
    sparse_block_size: int = 16
    """Tokens per key block of block-sparse attention (``schemes.sparse_attention.block_size``);
    read only when ``attention_density < 1``."""

    def check(self) -> None:
        """ValueError naming the field when a fraction is outside its range."""
        for name in ("neurons_kept", "heads_kept", "tokens_kept", "attention_density"):
            _fraction(name, getattr(self, name))
        if self.kv_tokens_kept is not None:
            _fraction("kv_tokens_kept", self.kv_tokens_kept)
        if self.frozen_prefix and not self.frozen:
            raise ValueError("frozen_prefix=True needs frozen=True; HINT: a prefix layer is frozen")
        if self.expert_loads is not None:
            if not self.expert_loads:
                raise ValueError("expert_loads is empty; HINT: one load per expert, or None")
            for load in self.expert_loads:
                if not math.isfinite(load) or load < 0:
                    raise ValueError(f"expert load {load!r} must be finite and >= 0")
        size = self.sparse_block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sparse_block_size={size!r} must be an integer >= 1")


def _fraction(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"{name}={value!r} must be in (0, 1]")


@dataclass(frozen=True)
class LayerCost:
    """A layer's work per microbatch: FLOPs and bytes of its forward and of its backward."""

    forward_flops: float
    forward_bytes: float
    backward_flops: float = 0.0
    backward_bytes: float = 0.0
    ops: dict[str, OpCost] = field(default_factory=dict, compare=False)
    """The operations it is the sum of, by name (for tests and reading)."""
    forward_indexed_bytes: float = 0.0
    backward_indexed_bytes: float = 0.0
    forward_ops: int = 0
    """Operations with forward work (each charged its kind's per-op overhead)."""
    backward_ops: int = 0
    """Operations with backward work (0 in a frozen prefix)."""
    forward_attention_flops: float = 0.0
    """The part of ``forward_flops`` in attention's products (:attr:`OpCost.attention`)."""
    backward_attention_flops: float = 0.0
    """The part of ``backward_flops`` in attention's products."""
    forward_weight_bytes: float = 0.0
    """Parameter bytes the forward reads (:attr:`OpCost.forward_weight_bytes`)."""
    backward_weight_bytes: float = 0.0
    """Parameter bytes the backward reads and parameter-gradient bytes it writes."""
    forward_ops_by_kind: dict[str, int] = field(default_factory=dict, compare=False)
    """``forward_ops`` split by :data:`OpKind` (kinds with no op left out; derived from
    ``ops``, so left out of comparisons like it)."""
    backward_ops_by_kind: dict[str, int] = field(default_factory=dict, compare=False)
    """``backward_ops`` split by :data:`OpKind`."""

    def pass_work(self, backward: bool) -> PassWork:
        """The forward's or the backward's work, as :func:`pass_time_s` prices it."""
        if backward:
            return PassWork(
                flops=self.backward_flops,
                nbytes=self.backward_bytes,
                indexed_bytes=self.backward_indexed_bytes,
                attention_flops=self.backward_attention_flops,
                weight_bytes=self.backward_weight_bytes,
                ops_by_kind=self.backward_ops_by_kind,
                backward=True,
            )
        return PassWork(
            flops=self.forward_flops,
            nbytes=self.forward_bytes,
            indexed_bytes=self.forward_indexed_bytes,
            attention_flops=self.forward_attention_flops,
            weight_bytes=self.forward_weight_bytes,
            ops_by_kind=self.forward_ops_by_kind,
            backward=False,
        )


@dataclass(frozen=True, kw_only=True)
class PassWork:
    """One pass's work (forward or backward of one microbatch), what :func:`pass_time_s` and the
    fit (:func:`dynmo_hpc.calibrate.cost_fit.features`) read; ``attention_flops`` is the part of
    ``flops`` in attention's products, ``weight_bytes`` the part of the bytes charged again at
    ``LayerRates.weight_bytes_per_s``."""

    flops: float = 0.0
    nbytes: float = 0.0
    indexed_bytes: float = 0.0
    attention_flops: float = 0.0
    weight_bytes: float = 0.0
    ops_by_kind: dict[str, int] = field(default_factory=dict)
    backward: bool = False
    """The backward: its matmul FLOPs at ``LayerRates.backward_flops_per_s`` when set."""

    @property
    def empty(self) -> bool:
        """No work at all (a frozen prefix's backward): the pass is not run and costs 0."""
        return self.flops == 0 and self.nbytes == 0 and self.indexed_bytes == 0


def _feed_forward(rows: float, d_model: int, d_ff: float, prefix: str) -> dict[str, OpCost]:
    return {
        f"{prefix}fc": matmul(rows, d_model, d_ff, bias=True),
        f"{prefix}gelu": elementwise(rows * d_ff),
        f"{prefix}proj": matmul(rows, d_ff, d_model, bias=True),
    }


def _moe(rows: float, shape: LayerShape, d_ff: float, state: SchemeState) -> dict[str, OpCost]:
    """The router over the kept tokens, then one expert MLP per load entry."""
    assert state.expert_loads is not None
    loads = state.expert_loads
    ops = {"router": matmul(rows, shape.d_model, len(loads))}
    busiest = max(loads)
    for e, load in enumerate(loads):
        expert_rows = rows * (busiest if state.padded else load)
        ops.update(_feed_forward(expert_rows, shape.d_model, d_ff, f"expert{e}_"))
    return ops


def _attention(shape: LayerShape, state: SchemeState, t_q: float, t_kv: float) -> dict[str, OpCost]:
    """Dense causal attention (fused), the masked active-token attention of early exit (all
    ``t_q t_kv`` pairs), or the block-sparse kernel."""
    b, width = shape.micro_batch, state.heads_kept * shape.d_model
    if state.attention_density < 1:
        heads = state.heads_kept * shape.num_heads
        return block_sparse_attention(
            b, width, heads, t_q, state.attention_density, state.sparse_block_size
        )
    masked = state.kv_tokens_kept is not None and t_q < t_kv
    return {"attention": attention_core(b, width, t_q, t_kv, 1.0, masked=masked)}


def _token_selection(shape: LayerShape, state: SchemeState) -> dict[str, OpCost]:
    """MoD's routing or early exit's active-token indexing; nothing when every token runs."""
    c, n_all = shape.d_model, shape.micro_batch * shape.seq_len
    n_q = n_all * state.tokens_kept
    if state.tokens_kept >= 1:
        return {}
    if state.kv_tokens_kept is None:  # MoD: route, gather the kept tokens in, scatter back
        return {
            "router": OpCost(
                forward_bytes=(n_all * c + n_all) * BYTES_PER_VALUE,
                dgrad_bytes=(n_q * c + n_all * c) * BYTES_PER_VALUE,
                wgrad_bytes=n_q * c * BYTES_PER_VALUE,
                kind="index",
            ),
            "topk": OpCost(forward_bytes=2 * n_all * BYTES_PER_VALUE, count=2, kind="index"),
            "select": gather(n_q * c, n_all * c),
            "combine": elementwise(3 * n_q * c),
            "scatter": scatter(n_q * c, n_all * c),
        }
    return {  # early exit: active rows and their queries packed, the output rows put back
        "select": row_gather(2 * n_q * c, n_all * c),
        "pack_queries": replace(row_scatter(n_q * c, n_q * c), count=4, backward_count=1),
        "unpack": row_gather(n_q * c, n_q * c),
        "scatter": row_scatter(n_q * c, n_all * c),
    }


def block_ops(shape: LayerShape, state: SchemeState) -> dict[str, OpCost]:
    """A pre-norm block's operations (:class:`dynmo_hpc.model.gpt.Block`) under ``state``."""
    c, b, t = shape.d_model, shape.micro_batch, shape.seq_len
    kv_kept = state.tokens_kept if state.kv_tokens_kept is None else state.kv_tokens_kept
    t_q, t_kv = state.tokens_kept * t, kv_kept * t
    n_q, n_kv = b * t_q, b * t_kv
    width = state.heads_kept * c
    d_ff = state.neurons_kept * shape.d_ff
    ops = {
        "ln_1": elementwise(n_kv * c),
        "q": matmul(n_q, c, width, bias=True),
        "kv": matmul(n_kv, c, 2 * width, bias=True),
        **_attention(shape, state, t_q, t_kv),
        "attn_proj": matmul(n_q, width, c, bias=True),
        "residual_1": elementwise(n_q * c),
        "ln_2": elementwise(n_q * c),
        **_token_selection(shape, state),
    }
    if state.expert_loads is None:
        ops.update(_feed_forward(n_q, c, d_ff, "mlp_"))
    else:
        ops.update(_moe(n_q, shape, d_ff, state))
    ops["residual_2"] = elementwise(n_q * c)
    if state.exit_head:
        ops["exit_ln"] = elementwise(n_q * c)
        ops["exit_head"] = matmul(n_q, c, shape.vocab_size)
        ops["exit_softmax"] = elementwise(n_q * shape.vocab_size)
    return ops


def embedding_ops(shape: LayerShape) -> dict[str, OpCost]:
    """Token plus position lookup: three kernels forward, each operand once per kernel as for
    every op here (the token rows gathered: read and written; the position rows gathered: read
    and written; their sum: both read, the sum written: ``4 n c + 3 t c`` values); backward
    (weight gradient only: the input is token ids) zero-fills both tables' gradients
    (``vocab_size + seq_len`` rows, however few tokens), adds the output's gradient into the
    token table's rows (one read of it; the table stays in cache), sums it over the batch for
    the position table (a second read, ``seq_len`` rows written) and adds those in; three
    operations (two lookups and the sum). Weight bytes: both tables forward (their rows come
    out of memory), and their gradients backward twice (zero-filled, then the rows added in)."""
    n, c, t = shape.micro_batch * shape.seq_len, shape.d_model, shape.seq_len
    forward = (4 * n * c + 3 * t * c) * BYTES_PER_VALUE
    backward = (2 * n * c + shape.vocab_size * c + 3 * t * c) * BYTES_PER_VALUE
    tables = (shape.vocab_size + t) * c * BYTES_PER_VALUE
    lookup = OpCost(
        0.0,
        forward,
        0.0,
        0.0,
        0.0,
        backward,
        count=3,
        kind="lookup",
        forward_weight_bytes=tables,
        wgrad_weight_bytes=2 * tables,
    )
    return {"lookup": lookup}


def head_ops(shape: LayerShape, state: SchemeState) -> dict[str, OpCost]:
    """Final LayerNorm, LM head and cross-entropy on the tokens still active."""
    n = shape.micro_batch * shape.seq_len * state.tokens_kept
    return {
        "ln_f": elementwise(n * shape.d_model),
        "lm_head": matmul(n, shape.d_model, shape.vocab_size),
        "softmax": elementwise(n * shape.vocab_size),
    }


def layer_cost(shape: LayerShape, state: SchemeState | None = None) -> LayerCost:
    """The layer's FLOPs and bytes per microbatch, forward and backward, under ``state``.

    Example: a block with d_model 64, d_ff 256, 4 heads, 128 tokens, micro batch 2 and no
    scheme does ``2*256*(12*64*64) + 4*2*(128*(128+32)/2)*64`` forward FLOPs (the second term
    its ``forward_attention_flops``).
    """
    state = state or SchemeState()
    shape.check()
    state.check()
    if shape.kind == "embedding":
        ops = embedding_ops(shape)
    elif shape.kind == "head":
        ops = head_ops(shape, state)
    else:
        ops = block_ops(shape, state)
    forward = _forward_totals(list(ops.values()))
    backward = _backward_totals(list(ops.values()), state)
    return LayerCost(ops=ops, **forward, **backward)


def _op_counts(counted: list[tuple[OpCost, int]]) -> dict[str, int]:
    """Ops per :data:`OpKind`, kinds with none left out."""
    out: dict[str, int] = {}
    for op, count in counted:
        out[op.kind] = out.get(op.kind, 0) + count
    return out


def _forward_totals(ops: list[OpCost]) -> dict[str, Any]:
    """The forward fields of :class:`LayerCost`, summed over its ops."""
    by_kind = _op_counts([(op, op.count) for op in ops if op.has_forward()])
    return {
        "forward_flops": sum(op.forward_flops for op in ops),
        "forward_bytes": sum(op.forward_bytes for op in ops),
        "forward_indexed_bytes": sum(op.forward_indexed_bytes for op in ops),
        "forward_attention_flops": sum(op.forward_flops for op in ops if op.attention),
        "forward_weight_bytes": sum(op.forward_weight_bytes for op in ops),
        "forward_ops": sum(by_kind.values()),
        "forward_ops_by_kind": by_kind,
    }


def _backward_totals(ops: list[OpCost], state: SchemeState) -> dict[str, Any]:
    """The backward fields of :class:`LayerCost`: input gradients, plus weight gradients
    unless frozen; nothing at all inside the frozen prefix."""
    if state.frozen_prefix:
        return {}
    wgrad = 0.0 if state.frozen else 1.0
    counted = [
        (op, op.count if op.backward_count is None else op.backward_count)
        for op in ops
        if op.has_backward(state.frozen)
    ]
    by_kind = _op_counts(counted)
    return {
        "backward_flops": sum(op.dgrad_flops + wgrad * op.wgrad_flops for op in ops),
        "backward_bytes": sum(op.dgrad_bytes + wgrad * op.wgrad_bytes for op in ops),
        "backward_indexed_bytes": sum(op.dgrad_indexed_bytes for op in ops),
        "backward_attention_flops": sum(op.dgrad_flops for op in ops if op.attention),
        "backward_weight_bytes": sum(
            op.dgrad_weight_bytes + wgrad * op.wgrad_weight_bytes for op in ops
        ),
        "backward_ops": sum(by_kind.values()),
        "backward_ops_by_kind": by_kind,
    }


def op_overhead_s(kind: str, rates: LayerRates) -> float:
    """Seconds per op of ``kind``: the kind's own overhead when the rates set one, else
    ``rates.op_overhead_s``."""
    own = {
        "matmul": rates.matmul_op_overhead_s,
        "index": rates.index_op_overhead_s,
        "lookup": rates.lookup_op_overhead_s,
    }.get(kind)
    return rates.op_overhead_s if own is None else own


def pass_time_s(work: PassWork, rates: LayerRates) -> float:
    """Seconds of one pass: ``(flops - attention_flops) / flops_per_s + attention_flops /
    attention_flops_per_s + bytes / bytes_per_s + indexed_bytes / indexed_bytes_per_s +
    weight_bytes / weight_bytes_per_s + sum over op kinds of ops * that kind's op overhead +
    overhead_s``; the backward's matmul FLOPs at
    ``rates.backward_flops_per_s`` when set, attention's at the matmul rate when
    ``rates.attention_flops_per_s`` is unset, indexed bytes at ``bytes_per_s`` when
    ``indexed_bytes_per_s`` is unset, weight bytes not charged again when ``weight_bytes_per_s`` is
    unset; 0 for a pass with no work (a frozen prefix's backward is not run at all)."""
    if work.empty:
        return 0.0
    flops_per_s = rates.flops_per_s
    if work.backward and rates.backward_flops_per_s is not None:
        flops_per_s = rates.backward_flops_per_s
    attention_per_s = rates.attention_flops_per_s or flops_per_s
    indexed_per_s = rates.indexed_bytes_per_s or rates.bytes_per_s
    weight_s = work.weight_bytes / rates.weight_bytes_per_s if rates.weight_bytes_per_s else 0.0
    ops_s = sum(n * op_overhead_s(kind, rates) for kind, n in work.ops_by_kind.items())
    return (
        (work.flops - work.attention_flops) / flops_per_s
        + work.attention_flops / attention_per_s
        + work.nbytes / rates.bytes_per_s
        + work.indexed_bytes / indexed_per_s
        + weight_s
        + ops_s
        + rates.overhead_s
    )


def layer_times_s(cost: LayerCost, rates: LayerRates) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one microbatch through the layer."""
    return pass_time_s(cost.pass_work(False), rates), pass_time_s(cost.pass_work(True), rates)


def layer_shapes(model: ModelSection, micro_batch: int) -> list[LayerShape]:
    """The shapes of a model's layers in placement order: embedding, blocks, head."""

    def shape(kind: LayerKind, d_ff: int = 0) -> LayerShape:
        return LayerShape(
            kind=kind,
            d_model=model.d_model,
            d_ff=d_ff,
            num_heads=model.num_heads,
            seq_len=model.seq_len,
            micro_batch=micro_batch,
            vocab_size=model.vocab_size,
        )

    blocks = [shape("block", model.block_d_ff(i)) for i in range(1, model.num_blocks + 1)]
    return [shape("embedding"), *blocks, shape("head")]
