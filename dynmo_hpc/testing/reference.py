"""Single-process, non-pipelined training: the yardstick for pipeline correctness.

Deliberately written as the plainest possible loop (all layers in one process, one autograd
backward per microbatch, gradients accumulated over microbatches; a tied embedding's two copies
get their summed gradient, as on the pipeline) and sharing only the model,
data and optimizer helpers with the pipeline engine. The tests require the pipeline's per-step
losses to match these, so any schedule or communication bug shows up as a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dynmo_hpc.config import JobConfig
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.layer_call import LayerCall
from dynmo_hpc.model.optim import (
    build_optimizer,
    clip_coefficient,
    lr_at,
    scale_grads_,
    set_lr,
    squared_grad_norm,
)
from dynmo_hpc.model.schemes import SchemeController, build_layer
from dynmo_hpc.model.tied import norm_exclusions, sum_local_, tied_parameter


@dataclass
class _Slot:
    index: int
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer


@dataclass
class ReferenceResult:
    losses: list[float]
    """Mean LM cross-entropy per step (over microbatches)."""
    state: dict[int, dict[str, torch.Tensor]]
    """Final parameters by global layer index."""
    step_time_s: list[float]
    """Wall seconds per step (the single-process baseline for benchmarks)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The scheme controller's run-log events (``scheme_stats`` and each scheme's own)."""


def train_reference(cfg: JobConfig, steps: int | None = None) -> ReferenceResult:
    torch.set_num_threads(cfg.runtime.threads_per_rank)
    num_steps = cfg.train.steps if steps is None else steps
    slots = [
        _Slot(i, layer, build_optimizer(layer, cfg.train))
        for i, layer in ((i, build_layer(cfg, i)) for i in range(cfg.model.num_layers))
    ]
    controller = SchemeController(cfg)
    dataset = TextDataset.for_job(cfg)
    call_layer = LayerCall(precision=cfg.train.precision)  # no recompute: the plain yardstick
    num_mb = cfg.train.num_microbatches
    losses = []
    step_time_s = []
    events: list[dict[str, Any]] = []
    for step in range(num_steps):
        t0 = time.perf_counter()
        step_loss = 0.0
        for mb in range(num_mb):
            tokens, targets = dataset.batch(cfg.job.seed, step, mb, cfg.train.micro_batch_size)
            ctx = MicrobatchContext(tokens=tokens, targets=targets)
            x = None
            for slot in slots:
                x = call_layer(slot.index, slot.module, x, ctx)
            assert ctx.loss is not None
            objective = ctx.loss / num_mb
            for aux in ctx.aux_losses:
                objective = objective + aux / num_mb
            objective.backward()
            step_loss += float(ctx.loss.detach()) / num_mb
        layers = [slot.module for slot in slots]
        if cfg.model.tie_embeddings:
            head = slots[-1]
            sum_local_(
                tied_parameter(cfg.model, 0, slots[0].module),
                tied_parameter(cfg.model, head.index, head.module),
            )
        sq_norms = [squared_grad_norm(s.module, norm_exclusions(cfg.model, s.index)) for s in slots]
        coeff = clip_coefficient(sq_norms, cfg.train.grad_clip)
        scale_grads_(layers, coeff)
        lr = lr_at(step, cfg.train)
        for slot in slots:
            set_lr(slot.optimizer, lr)
            slot.optimizer.step()
            slot.optimizer.zero_grad(set_to_none=True)
        events += controller.step_end(step, slots, lambda obj: [obj])
        losses.append(step_loss)
        step_time_s.append(time.perf_counter() - t0)
    state = {
        slot.index: {k: v.detach().clone() for k, v in slot.module.state_dict().items()}
        for slot in slots
    }
    return ReferenceResult(losses=losses, state=state, step_time_s=step_time_s, events=events)
