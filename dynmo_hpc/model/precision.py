"""``train.precision``: how one layer's forward runs: fp32, or bf16 autocast around fp32 weights.

bf16 is mixed precision in the usual sense: the weights, their gradients and the AdamW state stay
fp32 (so checkpoints, migration and the optimizer are unchanged); inside a layer's forward
``torch.autocast`` runs the matrix products in bf16 on CPU and CUDA, and autograd runs each
backward op in the dtype its forward used.

Invariant: a layer's outputs are cast back to fp32 at its boundary, and so are the losses it
reports. So what travels between layers (and between stages) is fp32 whatever the precision: the
activation spec, the transport and the per-layer autograd segments are the same code in both, and
the pipeline computes exactly what the single-process reference computes (both call
:func:`run_layer`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from dynmo_hpc.model.gpt import MicrobatchContext, Payload

Precision = Literal["fp32", "bf16"]


def run_layer(
    module: nn.Module,
    x: Payload | None,
    ctx: MicrobatchContext,
    precision: Precision,
    device_type: str,
) -> Payload:
    """``module(x, ctx)`` in ``precision``; floating-point outputs and new losses come out fp32."""
    if precision == "fp32":
        out: Payload = module(x, ctx)
        return out
    num_aux_before = len(ctx.aux_losses)
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        out = module(x, ctx)
    for i in range(num_aux_before, len(ctx.aux_losses)):
        ctx.aux_losses[i] = ctx.aux_losses[i].float()
    if ctx.loss is not None:
        ctx.loss = ctx.loss.float()
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
