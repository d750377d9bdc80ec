"""Validation loss: a fixed set of held-out windows scored forward-only through the pipeline.

The windows are the validation split's microbatches ``0..eval_windows / micro_batch_size - 1`` of
step 0 (:meth:`~dynmo_hpc.data.batches.TextDataset.batch` with ``split="val"``): the same windows at
every pass, so the curve shows the model changing, not the sample. Replicas split the
microbatches (replica ``r`` scores ``r, r + R, ...``); the caller sums the last stages' losses over
the world.

Invariant: a pass leaves training untouched. It runs under ``torch.no_grad``, and it restores
what a forward may change besides its outputs: the torch RNG states and the layers' public Python
attributes (the schemes' counters such as ``stats`` and ``last_selected``, read at load reports).
So a run with validation trains bitwise as the same run without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.layer_call import LayerCall, public_attrs, restore_public_attrs
from dynmo_hpc.pipeline.stage import PipelineStage

EVAL_STEP = 0
"""The ``step`` argument of the validation windows' batches: fixed, so the windows are too."""


def is_eval_step(step: int, eval_interval: int, num_steps: int) -> bool:
    """Whether a validation pass follows ``step``: every ``eval_interval`` steps and the last."""
    return eval_interval > 0 and ((step + 1) % eval_interval == 0 or step + 1 == num_steps)


@contextmanager
def _untouched(modules: list[nn.Module], device: torch.device) -> Iterator[None]:
    """Restore the modules' public attributes and the RNG states on exit."""
    saved = [public_attrs(m) for m in modules]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        with torch.no_grad():
            yield
    finally:
        for module, attrs in zip(modules, saved, strict=True):
            restore_public_attrs(module, attrs)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def evaluate(stage: PipelineStage, replica: int, num_replicas: int) -> float:
    """This stage's share of one validation pass: the sum over its replica's microbatches of
    the mean LM loss on the last stage, 0.0 on the others (they forward and send only)."""
    cfg = stage.cfg
    batch_size = cfg.train.micro_batch_size
    num_microbatches = cfg.train.eval_windows // batch_size
    call_layer = LayerCall.for_job(cfg, stage.device.type)
    total = 0.0
    with _untouched([slot.module for slot in stage.slots], stage.device):
        for tag, mb in enumerate(range(replica, num_microbatches, num_replicas)):
            x = stage.link.recv_forward(tag, stage.spec)
            tokens, targets = stage.dataset.batch(
                cfg.job.seed, EVAL_STEP, mb, batch_size, split="val"
            )
            ctx = MicrobatchContext(
                tokens=tokens.to(stage.device), targets=targets.to(stage.device)
            )
            for slot in stage.slots:
                x = call_layer(slot.index, slot.module, x, ctx)
            if stage.is_last:
                assert ctx.loss is not None, "the last stage must end with the head"
                total += float(ctx.loss)
            else:
                assert x is not None
                stage.link.send_forward(tag, stage.spec, x)
        stage.link.finish_sends()
    return total
