"""How one layer's forward runs: its precision (``train.precision``) and whether its activations
are kept or recomputed in the backward (``pipeline.recompute``).

Precision. bf16 is mixed precision in the usual sense: the weights, their gradients and the AdamW
state stay fp32 (so checkpoints, migration and the optimizer are unchanged); inside a layer's
forward ``torch.autocast`` runs the matrix products in bf16 on CPU and CUDA, and autograd runs
each backward op in the dtype its forward used.

Recompute. With ``pipeline.recompute: block`` a transformer block's forward runs under
``torch.utils.checkpoint`` (non-reentrant): only its input is kept for the backward, which runs
the forward again to rebuild the rest. The recomputation repeats the same ops on the same inputs
(with the RNG state restored), so the gradients are bitwise those of ``none``. Its side effects
are not repeated: the recomputation runs on a scratch microbatch context (no second loss or
auxiliary loss) and restores the layers' public attributes (the schemes' counters) afterwards.

Invariant: a layer's outputs are cast back to fp32 at its boundary, and so are the losses it
reports. So what travels between layers (and between stages) is fp32 whatever the precision: the
activation spec, the transport and the per-layer autograd segments are the same code in both, and
the pipeline computes exactly what the single-process reference computes (both call
:class:`LayerCall`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dynmo_hpc.model.gpt import MicrobatchContext, Payload

Precision = Literal["fp32", "bf16"]


def public_attrs(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Each submodule's public (non-underscore) attributes, copied one level deep."""
    return {
        name: {k: copy.copy(v) for k, v in vars(m).items() if not k.startswith("_")}
        for name, m in module.named_modules()
    }


def restore_public_attrs(module: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    """Undo what a forward did to the attributes :func:`public_attrs` saved (and drop new ones)."""
    for name, sub in module.named_modules():
        before = saved.get(name, {})
        for key in [k for k in vars(sub) if not k.startswith("_") and k not in before]:
            delattr(sub, key)
        vars(sub).update(before)


def _forward(module: nn.Module, x: Payload | None, ctx: MicrobatchContext, recompute: bool) -> Any:
    """``module(x, ctx)``, under activation checkpointing when ``recompute`` (and grad is on)."""
    if not (recompute and torch.is_grad_enabled()):
        return module(x, ctx)
    calls = 0

    def run(inputs: Payload | None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return module(inputs, ctx)
        saved = public_attrs(module)  # the backward's recomputation: no side effects
        try:
            return module(inputs, MicrobatchContext(tokens=ctx.tokens, targets=ctx.targets))
        finally:
            restore_public_attrs(module, saved)

    return checkpoint(run, x, use_reentrant=False)


@dataclass(frozen=True)
class LayerCall:
    """Runs global layer ``index``'s forward the way the job says."""

    precision: Precision = "fp32"
    device_type: str = "cpu"
    recompute_layers: range = range(0)
    """Global layer indices whose activations are recomputed (the blocks, or none)."""

    @classmethod
    def for_job(cls, cfg: Any, device_type: str) -> LayerCall:
        """From ``train.precision`` and ``pipeline.recompute`` (``block``: layers 1..num_blocks)."""
        blocks = range(1, cfg.model.num_blocks + 1)
        recompute = blocks if cfg.pipeline.recompute == "block" else range(0)
        return cls(
            precision=cfg.train.precision, device_type=device_type, recompute_layers=recompute
        )

    def __call__(
        self, index: int, module: nn.Module, x: Payload | None, ctx: MicrobatchContext
    ) -> Payload:
        """Layer ``index``'s outputs; floating-point outputs and new losses come out fp32."""
        recompute = index in self.recompute_layers
        if self.precision == "fp32":
            out: Payload = _forward(module, x, ctx, recompute)
            return out
        num_aux_before = len(ctx.aux_losses)
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            out = _forward(module, x, ctx, recompute)
        for i in range(num_aux_before, len(ctx.aux_losses)):
            ctx.aux_losses[i] = ctx.aux_losses[i].float()
        if ctx.loss is not None:
            ctx.loss = ctx.loss.float()
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
