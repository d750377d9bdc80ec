"""Per-layer AdamW, the learning-rate schedule and deterministic global-norm clipping.

Why one optimizer per layer: a layer that migrates must take its AdamW moments and step count
with it (the reference DynMo code loses them). With one optimizer per global layer, "the layer's
optimizer state" is simply that optimizer's ``state_dict()``, and no parameter-group surgery is
needed when layers arrive or leave. AdamW is element-wise, so this is the same math as one
optimizer over the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

import torch
from torch import nn

from dynmo_hpc.config import TrainSection


def lr_at(step: int, train: TrainSection) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


def group_hyperparameters(train: TrainSection) -> list[dict[str, float | tuple[float, float]]]:
    """Per parameter group (matrices, then biases / norms / 1-D tensors): weight decay and betas.

    One definition for :func:`build_optimizer` and :func:`apply_hyperparameters`, so a layer
    restored from a checkpoint trains with the job's values, not the ones saved with it.
    """
    betas = (train.beta1, train.beta2)
    return [
        {"weight_decay": train.weight_decay, "betas": betas},
        {"weight_decay": 0.0, "betas": betas},
    ]


def build_optimizer(module: nn.Module, train: TrainSection) -> torch.optim.AdamW:
    """AdamW for one layer; matrices decay, biases / norms / 1-D tensors do not."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [
        {"params": params, **hyper}
        for params, hyper in zip([decay, no_decay], group_hyperparameters(train), strict=True)
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), foreach=False)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, train: TrainSection) -> None:
    """Set the job's weight decay and betas on an optimizer whose state dict was just loaded.

    Why: ``load_state_dict`` restores the param_groups saved with the checkpoint, so without
    this a resume with another ``train.weight_decay`` or ``train.beta1/beta2`` would silently
    keep the old values (the learning rate is set every step by :func:`set_lr`). A no-op when
    the values are unchanged, so an unchanged resume stays bitwise exact.
    """
    wanted = group_hyperparameters(train)
    if len(optimizer.param_groups) != len(wanted):
        raise ValueError(f"{len(optimizer.param_groups)} parameter groups, expected {len(wanted)}")
    for group, hyper in zip(optimizer.param_groups, wanted, strict=True):
        group.update(hyper)


def squared_grad_norm(module: nn.Module, exclude: Collection[str] = ()) -> float:
    """Sum of squared gradient entries of one layer, accumulated in float64; the parameters
    named in ``exclude`` are left out (a tied weight's second copy)."""
    total = 0.0
    for name, p in module.named_parameters():
        if p.grad is not None and name not in exclude:
            total += float(torch.sum(p.grad.detach().double() ** 2))
    return total


def clip_coefficient(per_layer_sq_norms: Sequence[float], max_norm: float) -> float:
    """Scale factor for global-norm clipping, from per-layer squared norms in global order.

    Summing in global layer order (not per stage) makes the result independent of the partition,
    so a run that migrates layers clips exactly like one that does not.
    """
    if max_norm <= 0:
        return 1.0
    total_norm = math.sqrt(math.fsum(per_layer_sq_norms))
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_grads_(modules: Iterable[nn.Module], coefficient: float) -> None:
    if coefficient >= 1.0:
        return
    for module in modules:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coefficient)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
