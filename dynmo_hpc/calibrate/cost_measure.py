"""Measure the project's real layers, one at a time, in the scheme states the cost model names.

Why: :mod:`dynmo_hpc.sim.cost_model` turns a layer's shape and scheme state into FLOPs and
bytes; the machine's rates that turn those into seconds are fitted (:mod:`.cost_fit`) on what
this module measures. It builds each layer with the model's own classes and the schemes' own
mechanisms (``pruning.shrink_mlp`` / ``shrink_attention`` physically slice neurons and heads, a
MoD ``DepthRouter`` keeps the top tokens, ``SchemeAttention.make_sparse`` drops key blocks,
freezing turns the weights' ``requires_grad`` off, early exit's ``active_forward`` runs the
active tokens only) and times its forward and its backward the way a pipeline stage does
(:mod:`dynmo_hpc.pipeline.stage`): the input is a detached leaf, the backward is
``torch.autograd.backward`` of the layer's output alone, and the clock is the calling thread's
CPU time with one torch thread (``docs/simulate.md``, "Per-layer cost model").

Each case's scheme state is the one the layer really ran: a MoD block's kept fraction is its
``ceil(capacity T) / T`` and a block-sparse layer's density its kept key blocks over the causal
ones, which is what the run log's scheme statistics record.

Not pure (torch, the clock): the thin edge the pure fit stands on.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from dynmo_hpc.calibrate.cost_fit import Sample
from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.gpt import (
    MLP,
    Block,
    Embedding,
    Head,
    MicrobatchContext,
    Payload,
    init_layer_,
)
from dynmo_hpc.model.schemes.blocks import SchemeBlock
from dynmo_hpc.model.schemes.early_exit import active_forward
from dynmo_hpc.model.schemes.mod import DepthRouter, routed_forward, tokens_processed
from dynmo_hpc.model.schemes.pruning import shrink_attention, shrink_mlp
from dynmo_hpc.model.schemes.sparse_attention import blocks_kept_per_row
from dynmo_hpc.sim.cost_model import LayerShape, SchemeState

log = logging.getLogger(__name__)

SPARSE_BLOCK_SIZE = 16
"""Tokens per key block of the sparse-attention cases (the config's default)."""


@dataclass(frozen=True, kw_only=True)
class LayerCase:
    """One layer to measure: a label, its shape and the scheme state it runs in."""

    label: str
    shape: LayerShape
    state: SchemeState


def mod_fraction(seq_len: int, capacity: float) -> float:
    """Tokens a MoD block with ``capacity`` really keeps, as a fraction of ``seq_len``."""
    return tokens_processed(seq_len, capacity) / seq_len


def sparse_density(seq_len: int, density: float, block_size: int = SPARSE_BLOCK_SIZE) -> float:
    """Kept key blocks over causal key blocks of block-sparse attention at ``density``."""
    num_blocks = seq_len // block_size
    return sum(blocks_kept_per_row(num_blocks, density)) / (num_blocks * (num_blocks + 1) / 2)


def standard_cases(d_model: int, seq_len: int, micro_batch: int) -> list[LayerCase]:
    """The layers measured at one width: embedding, head, a plain block and blocks in each
    scheme state (d_ff = 4 d_model, d_model / 16 heads of 16 channels, at least 2)."""
    heads = max(2, d_model // 16)
    base = {"d_model": d_model, "num_heads": heads, "seq_len": seq_len, "micro_batch": micro_batch}
    block = LayerShape(kind="block", d_ff=4 * d_model, **base)
    states: list[tuple[str, SchemeState]] = [
        ("plain", SchemeState()),
        ("neurons0.5", SchemeState(neurons_kept=0.5)),
        ("neurons0.25", SchemeState(neurons_kept=0.25)),
        ("heads0.5", SchemeState(heads_kept=0.5)),
        ("mod0.5", SchemeState(tokens_kept=mod_fraction(seq_len, 0.5))),
        ("mod0.25", SchemeState(tokens_kept=mod_fraction(seq_len, 0.25))),
        ("frozen", SchemeState(frozen=True)),
        ("exit0.5", SchemeState(tokens_kept=0.5, kv_tokens_kept=1.0)),
    ]
    if seq_len % SPARSE_BLOCK_SIZE == 0 and seq_len >= 4 * SPARSE_BLOCK_SIZE:
        for density in (0.5, 0.25):
            kept = sparse_density(seq_len, density)
            states.append((f"sparse{density}", SchemeState(attention_density=kept)))
    tag = f"d{d_model}/t{seq_len}/b{micro_batch}"
    cases = [
        LayerCase(
            label=f"{tag}/embedding",
            shape=replace(block, kind="embedding", d_ff=0),
            state=SchemeState(),
        ),
        LayerCase(
            label=f"{tag}/head", shape=replace(block, kind="head", d_ff=0), state=SchemeState()
        ),
    ]
    cases += [LayerCase(label=f"{tag}/{name}", shape=block, state=s) for name, s in states]
    return cases


def _model_section(shape: LayerShape) -> ModelSection:
    return ModelSection(
        num_blocks=1,
        d_model=shape.d_model,
        num_heads=shape.num_heads,
        d_ff=max(shape.d_ff, 1),
        seq_len=shape.seq_len,
        vocab_size=shape.vocab_size,
    )


def _scheme_block(cfg: ModelSection, shape: LayerShape, state: SchemeState) -> SchemeBlock:
    """A block with the scheme mechanisms that produce ``state`` (MoE is not built here)."""
    block = SchemeBlock(cfg, shape.d_ff)
    init_layer_(block, cfg, 0, 1)
    if state.neurons_kept < 1:
        assert isinstance(block.mlp, MLP)
        shrink_mlp(block.mlp, torch.arange(round(state.neurons_kept * shape.d_ff)), "")
    if state.heads_kept < 1:
        shrink_attention(block.attn, list(range(round(state.heads_kept * shape.num_heads))), "")
    if state.attention_density < 1:
        nominal = _nominal_density(shape.seq_len, state.attention_density)
        block.attn.make_sparse(SPARSE_BLOCK_SIZE, nominal)
    if state.tokens_kept < 1 and state.kv_tokens_kept is None:
        block.depth_router = DepthRouter(cfg.d_model, state.tokens_kept)
        block.forward_path = routed_forward
    elif state.kv_tokens_kept is not None:
        block.forward_path = active_forward
    if state.frozen:
        block.requires_grad_(False)
    return block


def _nominal_density(seq_len: int, kept: float) -> float:
    """The configured density whose kept-block fraction is ``kept`` (the inverse of
    :func:`sparse_density` on the densities :func:`standard_cases` uses)."""
    for nominal in (kept, 0.5, 0.25, 0.125, 0.75):
        if abs(sparse_density(seq_len, nominal) - kept) < 1e-12:
            return nominal
    raise ValueError(f"attention_density={kept} is no kept-block fraction at seq_len={seq_len}")


def build_case(case: LayerCase) -> nn.Module:
    """The real layer for ``case``: ``Embedding``, ``Head``, the plain ``Block`` or a
    ``SchemeBlock`` carrying the state's scheme mechanisms."""
    cfg = _model_section(case.shape)
    module: nn.Module
    if case.shape.kind == "embedding":
        module = Embedding(cfg)
    elif case.shape.kind == "head":
        module = Head(cfg)
    elif case.state == SchemeState():
        module = Block(cfg, case.shape.d_ff)
    else:
        return _scheme_block(cfg, case.shape, case.state)
    init_layer_(module, cfg, 0, 1)
    return module


def _inputs(case: LayerCase, gen: torch.Generator) -> tuple[Payload | None, MicrobatchContext]:
    """A microbatch's context and the layer's input payload (None for the embedding)."""
    shape = case.shape
    b, t, c = shape.micro_batch, shape.seq_len, shape.d_model
    tokens = torch.randint(0, shape.vocab_size, (b, t), generator=gen)
    ctx = MicrobatchContext(tokens=tokens, targets=tokens.roll(-1, dims=1))
    if shape.kind == "embedding":
        return None, ctx
    x: Payload = {"h": torch.randn(b, t, c, generator=gen)}
    if case.state.kv_tokens_kept is not None:
        keep = round(case.state.tokens_kept * t)
        order = torch.rand(b, t, generator=gen).argsort(dim=1)[:, :keep]  # (B, keep)
        x["active"] = torch.zeros(b, t).scatter(1, order, 1.0)  # (B, T), keep ones per row
        x["exit_nll"] = torch.zeros(b, t)
    return x, ctx


def _one_pass(module: nn.Module, case: LayerCase, gen: torch.Generator) -> tuple[float, float]:
    """Thread CPU seconds of one forward and of one backward, as a stage times them."""
    x, ctx = _inputs(case, gen)
    x_in = None if x is None else {k: v.detach().requires_grad_(k == "h") for k, v in x.items()}
    start = time.thread_time()
    out = module(x_in, ctx)
    forward_s = time.thread_time() - start
    tensors: list[Tensor] = []
    grads: list[Tensor] = []
    if case.shape.kind == "head":
        assert ctx.loss is not None
        tensors, grads = [ctx.loss], [torch.tensor(1.0)]
    else:
        tensors, grads = [out["h"]], [torch.randn(out["h"].shape, generator=gen)]
    for aux in ctx.aux_losses:
        tensors.append(aux)
        grads.append(torch.tensor(1.0))
    start = time.thread_time()
    torch.autograd.backward(tensors, grads)
    backward_s = time.thread_time() - start
    return forward_s, backward_s


def measure(
    cases: Iterable[LayerCase],
    *,
    repeats: int = 9,
    warmup: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[Sample]:
    """Median forward and backward thread CPU seconds of each case over ``repeats`` passes.

    The repeats are the outer loop (one pass of every case per round), so a burst of load on
    the shared machine lands on all cases alike instead of on a few. One torch thread.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    torch.set_num_threads(1)
    cases = list(cases)
    modules = [build_case(case) for case in cases]
    gen = torch.Generator().manual_seed(0)
    forward: list[list[float]] = [[] for _ in cases]
    backward: list[list[float]] = [[] for _ in cases]
    for round_index in range(warmup + repeats):
        for i, (case, module) in enumerate(zip(cases, modules, strict=True)):
            forward_s, backward_s = _one_pass(module, case, gen)
            module.zero_grad(set_to_none=True)
            if round_index >= warmup:
                forward[i].append(forward_s)
                backward[i].append(backward_s)
        if progress is not None:
            progress(f"round {round_index + 1}/{warmup + repeats} of {len(cases)} layers")
    return [
        Sample(
            label=case.label,
            shape=case.shape,
            state=case.state,
            forward_s=statistics.median(forward[i]),
            backward_s=statistics.median(backward[i]),
        )
        for i, case in enumerate(cases)
    ]
