"""Progressive layer freezing, front layers first (AutoFreeze's gradient-norm criterion).

Criterion (AutoFreeze, Liu et al. 2021): every ``interval_steps`` steps each layer's gradient
norm is compared with its value at the previous check; a layer whose norm changed by less than
``threshold`` (relative) has converged. The gradient norm is read from the layer's own AdamW
state at step end: the bias-corrected first moment ``m / (1 - beta1^t)`` is an exponential moving
average of the layer's gradient (the raw gradients are already released by then), and the state
is the layer's own, so the criterion needs nothing but the layer and travels with it.

Front first: a layer freezes only if every layer before it is frozen, so the frozen set is always
a prefix ``0 .. frozen_prefix_end - 1``; each check extends the prefix over at most
``max_layers_per_check`` converged layers. The decision is made from per-layer flags allgathered
from every rank, so all ranks (and the reference) agree. The head never freezes.

What freezing saves: a frozen layer's parameters stop requiring gradients (no weight-gradient
kernels, and AdamW skips parameters without a gradient, so no optimizer work). The prefix end is
this scheme's ``no_grad_below``: the pipeline stage runs no backward at all below it and sends
no gradient message across it (``pipeline.stage.PipelineStage.backward_microbatch``); the forward
still runs.

State in the layer: buffers ``frozen`` (bool) and ``frozen_ref_grad_norm`` (the norm at the last
check), so a migrated or checkpointed layer keeps both; :func:`apply_frozen_flag` re-derives
``requires_grad`` from the buffer after a state dict is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dynmo_hpc.config import FreezingSection
from dynmo_hpc.model.schemes.registry import AllGather, Scheme, Slot


def attach(module: nn.Module) -> None:
    """Give a layer the freezing buffers (not frozen, no reference norm yet)."""
    module.register_buffer("frozen", torch.tensor(False))
    # -1 = no reference yet (not NaN: checkpoints and state comparisons stay NaN-free)
    module.register_buffer("frozen_ref_grad_norm", torch.tensor(-1.0, dtype=torch.float64))


def is_frozen(module: nn.Module) -> bool:
    flag = getattr(module, "frozen", None)
    return bool(flag) if isinstance(flag, torch.Tensor) else False


def _buffer(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"{type(module).__name__} has no '{name}' buffer: it was not built with "
            "schemes.freezing on; build layers through dynmo_hpc.model.schemes.build_layer"
        )
    return value


def freeze_(module: nn.Module) -> None:
    """Stop training a layer: no weight gradients, no optimizer updates from now on."""
    _buffer(module, "frozen").fill_(True)
    apply_frozen_flag(module)


def apply_frozen_flag(module: nn.Module) -> None:
    """Set ``requires_grad`` from the ``frozen`` buffer (after a layer is loaded or migrated)."""
    if is_frozen(module):
        for p in module.parameters():
            p.requires_grad_(False)
            p.grad = None


def grad_norm_estimate(optimizer: torch.optim.Optimizer) -> float:
    """The layer's gradient norm from AdamW's bias-corrected first moments (NaN before step 1)."""
    total = 0.0
    seen = False
    for group in optimizer.param_groups:
        beta1 = group["betas"][0]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or "exp_avg" not in state:
                continue
            step = float(state["step"])
            correction = 1.0 - beta1**step if beta1 > 0 else 1.0
            total += float(torch.sum(state["exp_avg"].detach().double() ** 2)) / correction**2
            seen = True
    return math.sqrt(total) if seen else math.nan


def is_check_step(section: FreezingSection, step: int) -> bool:
    """Checks run after steps whose count (step + 1) is a multiple of interval_steps."""
    return (step + 1) % section.interval_steps == 0


def check_layer(
    module: nn.Module, optimizer: torch.optim.Optimizer, threshold: float
) -> tuple[bool, float]:
    """Update a layer's reference norm; returns (converged, relative change)."""
    norm = grad_norm_estimate(optimizer)
    reference = _buffer(module, "frozen_ref_grad_norm")
    previous = float(reference)
    reference.fill_(-1.0 if math.isnan(norm) else norm)
    if math.isnan(norm) or previous <= 0.0:
        return False, math.nan
    change = abs(norm - previous) / previous
    return change < threshold, change


def next_prefix_end(
    current_end: int, converged: Mapping[int, bool], max_new: int, max_end: int
) -> int:
    """Extend the frozen prefix over consecutive converged layers, front first.

    Example: prefix end 1, converged {1: True, 2: True, 3: False}, max_new 5: returns 3.
    """
    end = current_end
    while end < max_end and end - current_end < max_new and converged.get(end, False):
        end += 1
    return end


def max_prefix_end(section: FreezingSection, num_layers: int) -> int:
    """Longest allowed frozen prefix: never the head."""
    cap = num_layers - 1
    return cap if section.max_frozen_layers is None else min(cap, section.max_frozen_layers)


def freeze_step(
    section: FreezingSection,
    step: int,
    slots: Sequence[Any],
    allgather: Any,
    current_end: int,
    num_layers: int,
) -> tuple[int, dict[str, Any] | None]:
    """Run a convergence check if one is due; returns the new prefix end and its event (the
    relative gradient-norm change of every unfrozen layer, None at a layer's first check)."""
    if not is_check_step(section, step):
        return current_end, None
    mine: dict[int, tuple[bool, float]] = {}
    for slot in slots:
        if not is_frozen(slot.module):
            mine[slot.index] = check_layer(slot.module, slot.optimizer, section.threshold)
    merged: dict[int, tuple[bool, float]] = {}
    for part in allgather(mine):
        merged.update(part)
    new_end = current_end
    if step + 1 >= section.start_step:
        converged = {i: ok for i, (ok, _) in merged.items()}
        new_end = next_prefix_end(
            current_end,
            converged,
            section.max_layers_per_check,
            max_prefix_end(section, num_layers),
        )
    for slot in slots:
        if slot.index < new_end and not is_frozen(slot.module):
            freeze_(slot.module)
    event = {
        "kind": "freeze",
        "frozen_prefix_end": new_end,
        "newly_frozen": list(range(current_end, new_end)),
        "relative_change": {
            str(i): None if math.isnan(change) else change
            for i, (_, change) in sorted(merged.items())
        },
    }
    return new_end, event


class FreezingScheme(Scheme):
    """``schemes.freezing``: the frozen prefix, extended at convergence checks.

    ``prefix_end`` is the same on every rank (decided from allgathered flags) and is this
    scheme's ``no_grad_below``; after a restore it is re-derived from the layers' flags.
    """

    name = "freezing"
    section_type = FreezingSection

    def __init__(self, cfg: Any, section: Any) -> None:
        super().__init__(cfg, section)
        self.prefix_end = 0
        """Layers ``0..prefix_end-1`` are all frozen."""

    def attach(self, module: nn.Module, index: int) -> None:
        attach(module)

    def after_load(self, module: nn.Module) -> None:
        apply_frozen_flag(module)

    def step_end(
        self, step: int, slots: Sequence[Slot], allgather: AllGather
    ) -> dict[str, Any] | None:
        num_layers = self.cfg.model.num_layers
        self.prefix_end, event = freeze_step(
            self.section, step, slots, allgather, self.prefix_end, num_layers
        )
        return event

    def resume(self, slots: Sequence[Slot], allgather: AllGather) -> None:
        flags: dict[int, bool] = {}
        for part in allgather({s.index: is_frozen(s.module) for s in slots}):
            flags.update(part)
        end = 0
        while flags.get(end, False):
            end += 1
        self.prefix_end = end

    def no_grad_below(self) -> int:
        return self.prefix_end

    def layer_stats(self, slot: Slot) -> dict[str, float]:
        return {"frozen": float(is_frozen(slot.module))}

    def summary(self) -> dict[str, Any]:
        return {"frozen_prefix_end": self.prefix_end}
