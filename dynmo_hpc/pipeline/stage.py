"""One pipeline stage: the layers it owns, and the runner that executes its schedule.

Ownership (after nanotron): every global layer has exactly one owner stage; a stage holds a
contiguous, ordered range ``parts[stage]..parts[stage+1]`` as :class:`LayerSlot` objects (module +
its own AdamW). Migration (:mod:`dynmo_hpc.pipeline.migration.move`) adds and removes slots; the
runner only ever iterates them in global order.

Per-layer segments: the runner cuts autograd at every layer boundary (each layer's input is a
detached leaf), so each layer's backward runs, and is timed, on its own. Chaining the segment
gradients by hand is the same chain rule the monolithic graph applies, so the numbers are equal
to the single-process reference; it is what lets the profiler report forward *and* backward cost
per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dynmo_hpc.config import JobConfig
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext, Payload, Spec
from dynmo_hpc.model.layer_call import LayerCall
from dynmo_hpc.model.optim import build_optimizer, scale_grads_, set_lr
from dynmo_hpc.model.schemes import activation_spec, build_layer
from dynmo_hpc.pipeline.comm import StageLink
from dynmo_hpc.pipeline.costs import LayerSize
from dynmo_hpc.pipeline.device import LayerTimer, make_timer
from dynmo_hpc.pipeline.migration.host_memory import layer_tensors, rehome
from dynmo_hpc.pipeline.schedule import Action

log = logging.getLogger(__name__)


@dataclass
class LayerSlot:
    """A global layer owned by this stage: its module, its optimizer and its cost timers."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    forward_timer: LayerTimer
    backward_timer: LayerTimer
    in_arena: bool = False
    """Whether its large storages live in one huge-page arena (see
    :mod:`dynmo_hpc.pipeline.migration.host_memory`): true for a layer that arrived by migration,
    and for every CPU layer after its first optimizer step."""


@dataclass
class SavedMicrobatch:
    """What a forward keeps for the backward of one microbatch on this stage."""

    inputs: list[Payload | None]
    outputs: list[Payload]
    aux: list[list[torch.Tensor]]
    ctx: MicrobatchContext


@dataclass
class StepStats:
    """One stage's view of one step."""

    lm_loss_sum: float = 0.0
    """Sum over microbatches of (LM loss / M); non-zero on the last stage only."""
    aux_loss_sum: float = 0.0
    """Sum over microbatches of this stage's auxiliary losses / M."""
    compute_s: float = 0.0
    """Wall seconds in forward/backward compute."""
    idle_s: float = 0.0
    """Wall seconds waiting on neighbours."""
    forward_s: dict[int, float] = field(default_factory=dict)
    """Per owned layer: forward cost this step (thread CPU time or CUDA event time)."""
    backward_s: dict[int, float] = field(default_factory=dict)


def _detach_inputs(x: Payload | None, needs_grad: bool) -> Payload | None:
    """Cut autograd at a layer boundary; the input is a leaf that collects its gradient."""
    if x is None:
        return None
    return {
        k: v.detach().requires_grad_(needs_grad and v.is_floating_point()) for k, v in x.items()
    }


class PipelineStage:
    """Layers ``parts[stage]:parts[stage+1]`` of the model, on one rank."""

    def __init__(
        self,
        cfg: JobConfig,
        stage: int,
        parts: list[int],
        link: StageLink,
        dataset: TextDataset,
        device: torch.device,
        *,
        build_layers: bool = True,
        first_microbatch: int = 0,
    ) -> None:
        """``build_layers=False`` leaves the stage empty, for a restore that brings its layers
        through :meth:`replace_layers`. ``first_microbatch``: the global index of the schedule's
        microbatch 0 (a replica trains a block of the global batch,
        :func:`~dynmo_hpc.pipeline.topology.replica_microbatches`)."""
        self.cfg = cfg
        self.stage = stage
        self.parts = list(parts)
        self.link = link
        self.dataset = dataset
        self.device = device
        self.num_microbatches = cfg.train.num_microbatches
        """The *global* batch's microbatches: every loss is scaled by its inverse, so the
        replicas' summed gradients are the global mean."""
        self.first_microbatch = first_microbatch
        self.call_layer = LayerCall.for_job(cfg, device.type)
        """Each layer's forward in ``train.precision``, recomputed per ``pipeline.recompute``."""
        self.spec: Spec = activation_spec(cfg, cfg.train.micro_batch_size)
        self.grad_spec: Spec = {k: v for k, v in self.spec.items() if v[1].is_floating_point}
        """Gradients travel back only for floating-point payload tensors."""
        self.no_grad_below = 0
        """No layer below this index needs a backward pass, so none runs through them and no
        gradient crosses into them (the scheme controller's ``no_grad_below``, copied at step
        boundaries, the same value on every rank)."""
        self.slots: list[LayerSlot] = (
            [self.make_slot(i, build_layer(cfg, i)) for i in range(parts[stage], parts[stage + 1])]
            if build_layers
            else []
        )

    # ------------------------------------------------------------------ ownership
    def make_slot(
        self, index: int, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> LayerSlot:
        """A slot for global layer ``index``: ``module`` moved to this stage's device with a new
        optimizer, or, with ``optimizer`` (a migrated layer's own), both used as they are: they
        must already be on this stage's device."""
        if optimizer is None:
            module = module.to(self.device)
            optimizer = build_optimizer(module, self.cfg.train)
        return LayerSlot(
            index=index,
            module=module,
            optimizer=optimizer,
            forward_timer=make_timer(self.device),
            backward_timer=make_timer(self.device),
        )

    @property
    def layer_indices(self) -> list[int]:
        return [slot.index for slot in self.slots]

    @property
    def is_last(self) -> bool:
        return self.stage == self.link.num_stages - 1

    def layer_sizes(self) -> dict[int, LayerSize]:
        """Per owned layer: parameter count and the bytes of weights, gradients, AdamW state."""
        out = {}
        for slot in self.slots:
            params = list(slot.module.parameters())
            optim_bytes = 0
            for state in slot.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        optim_bytes += value.numel() * value.element_size()
            out[slot.index] = LayerSize(
                num_params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                optim_bytes=optim_bytes,
            )
        return out

    def reset_timers(self) -> None:
        """Fresh per-layer timers: each step's costs are measured on their own."""
        for slot in self.slots:
            slot.forward_timer = make_timer(self.device)
            slot.backward_timer = make_timer(self.device)

    def replace_layers(
        self, new_parts: list[int], *, arrived: list[LayerSlot], leaving: set[int]
    ) -> None:
        """Adopt ``new_parts``: drop the ``leaving`` layers, insert the ``arrived`` slots in global
        order, and check the invariants (the one place a stage's layers change after build)."""
        kept = [slot for slot in self.slots if slot.index not in leaving]
        self.slots = sorted(kept + arrived, key=lambda slot: slot.index)
        self.parts = list(new_parts)
        self.check_invariants()

    def check_invariants(self) -> None:
        """Owned layers are exactly ``parts[stage]..parts[stage+1]-1``, in order."""
        expected = list(range(self.parts[self.stage], self.parts[self.stage + 1]))
        if self.layer_indices != expected:
            raise RuntimeError(
                f"stage {self.stage} owns layers {self.layer_indices}, expected {expected} "
                f"from partition {self.parts}"
            )

    # ------------------------------------------------------------------ one step
    def _context(self, step: int, microbatch: int) -> MicrobatchContext:
        tokens, targets = self.dataset.batch(
            self.cfg.job.seed,
            step,
            self.first_microbatch + microbatch,
            self.cfg.train.micro_batch_size,
        )
        return MicrobatchContext(tokens=tokens.to(self.device), targets=targets.to(self.device))

    def forward_microbatch(self, step: int, mb: int, stats: StepStats) -> SavedMicrobatch:
        x = self.link.recv_forward(mb, self.spec)
        t0 = time.perf_counter()
        ctx = self._context(step, mb)
        saved = SavedMicrobatch(inputs=[], outputs=[], aux=[], ctx=ctx)
        for slot in self.slots:
            # The gradient w.r.t. layer i's input is needed only if some layer below i trains.
            x_in = _detach_inputs(x, needs_grad=slot.index > self.no_grad_below)
            num_aux_before = len(ctx.aux_losses)
            slot.forward_timer.start()
            x = self.call_layer(slot.index, slot.module, x_in, ctx)
            slot.forward_timer.stop()
            saved.inputs.append(x_in)
            saved.outputs.append(x)
            saved.aux.append(ctx.aux_losses[num_aux_before:])
        stats.compute_s += time.perf_counter() - t0
        if self.is_last:
            assert ctx.loss is not None, "the last stage must end with the head"
            stats.lm_loss_sum += float(ctx.loss.detach()) / self.num_microbatches
        for aux in ctx.aux_losses:
            stats.aux_loss_sum += float(aux.detach()) / self.num_microbatches
        assert x is not None
        self.link.send_forward(mb, self.spec, x)
        return saved

    def backward_microbatch(
        self,
        mb: int,
        saved: SavedMicrobatch,
        stats: StepStats,
        on_layer_final: Callable[[int], None] | None = None,
    ) -> None:
        """Backward of microbatch ``mb``, layer by layer from the last; ``on_layer_final(pos)``
        runs after each layer's backward when ``mb`` is the stage's last (its gradients are
        final: the gradient all-reduce starts there), its seconds not counted as compute."""
        grads = None
        hook_s = 0.0
        if self.parts[self.stage + 1] > self.no_grad_below:
            grads = self.link.recv_backward(mb, self.grad_spec)
        t0 = time.perf_counter()
        scale = 1.0 / self.num_microbatches
        for pos in range(len(self.slots) - 1, -1, -1):
            slot = self.slots[pos]
            if slot.index < self.no_grad_below:
                grads = None
                break  # nothing below needs a gradient
            out, x_in = saved.outputs[pos], saved.inputs[pos]
            tensors: list[torch.Tensor] = []
            grad_tensors: list[torch.Tensor] = []
            if pos == len(self.slots) - 1 and self.is_last:
                assert saved.ctx.loss is not None
                tensors.append(saved.ctx.loss)
                grad_tensors.append(torch.tensor(scale, device=self.device))
            elif grads is not None:
                for name, value in out.items():
                    g = grads.get(name)
                    if g is not None and value.requires_grad:
                        tensors.append(value)
                        grad_tensors.append(g)
            for aux in saved.aux[pos]:
                if aux.requires_grad:
                    tensors.append(aux)
                    grad_tensors.append(torch.tensor(scale, device=self.device))
            slot.backward_timer.start()
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
            slot.backward_timer.stop()
            if on_layer_final is not None:
                t_hook = time.perf_counter()
                on_layer_final(pos)
                hook_s += time.perf_counter() - t_hook
            grads = None
            if x_in is not None:
                grads = {
                    k: (v.grad if v.grad is not None else torch.zeros_like(v))
                    for k, v in x_in.items()
                    if v.is_floating_point()
                }
        stats.compute_s += time.perf_counter() - t0 - hook_s
        if self.parts[self.stage] > self.no_grad_below and self.stage > 0:
            assert grads is not None, f"stage {self.stage} owes its input gradient"
            self.link.send_backward(mb, self.grad_spec, grads)
        self.link.reap_sends()

    def run_schedule(
        self,
        step: int,
        actions: list[Action],
        on_layer_final: Callable[[int], None] | None = None,
    ) -> StepStats:
        """Execute one step's forward/backward actions; gradients accumulate in ``.grad``.
        ``on_layer_final``: called with a layer's position during the last backward action
        (:meth:`backward_microbatch`), the gradient all-reduce's start."""
        stats = StepStats()
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        self.link.idle_s = 0.0
        self.reset_timers()
        saved: dict[int, SavedMicrobatch] = {}
        for i, action in enumerate(actions):
            if action.kind == "F":
                saved[action.microbatch] = self.forward_microbatch(step, action.microbatch, stats)
            else:
                hook = on_layer_final if i == last_backward else None
                self.backward_microbatch(
                    action.microbatch, saved.pop(action.microbatch), stats, hook
                )
        self.link.finish_sends()
        if saved or self.link.num_pending_sends:
            raise RuntimeError(
                f"stage {self.stage} ended step {step} with {len(saved)} microbatches "
                f"awaiting backward and {self.link.num_pending_sends} pending sends"
            )
        stats.idle_s = self.link.idle_s
        for slot in self.slots:
            stats.forward_s[slot.index] = slot.forward_timer.seconds()
            stats.backward_s[slot.index] = slot.backward_timer.seconds()
        return stats

    def optimizer_step(self, lr: float, clip_coefficient: float) -> None:
        for slot in self.slots:
            scale_grads_([slot.module], clip_coefficient)
            set_lr(slot.optimizer, lr)
            slot.optimizer.step()
            slot.optimizer.zero_grad(set_to_none=True)
            if not slot.in_arena and self.device.type == "cpu" and slot.optimizer.state:
                # Once, when the AdamW moments exist: a migration sends from here at full speed.
                rehome(layer_tensors(slot.module, slot.optimizer))
                slot.in_arena = True
