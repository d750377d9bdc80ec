"""``pipeline.recompute: block``: gradients bitwise those of ``none`` (plain and scheme layers, fp32
and bf16), the schemes' counters counted once, far fewer bytes saved for the backward, and a
2-stage pipeline run bitwise equal to the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynmo_hpc.config import JobConfig
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.layer_call import LayerCall, public_attrs
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import run_job, tiny_config
from tests.helpers.scheme_jobs import scheme_config


def _train_once(cfg: JobConfig, call: LayerCall) -> tuple[float, list[torch.Tensor], list[str]]:
    """Loss, every gradient, and the layers' public state after one forward and backward."""
    torch.manual_seed(0)
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    tokens, targets = TextDataset.for_job(cfg).batch(3, 1, 0, cfg.train.micro_batch_size)
    ctx = MicrobatchContext(tokens=tokens, targets=targets)
    x = None
    for i, layer in enumerate(layers):
        x = call(i, layer, x, ctx)
    assert ctx.loss is not None
    objective = ctx.loss + sum(ctx.aux_losses, torch.tensor(0.0))
    objective.backward()
    grads = [p.grad for layer in layers for p in layer.parameters() if p.grad is not None]
    state = [repr(sorted((k, repr(v)) for k, v in public_attrs(m).items())) for m in layers]
    return float(objective.detach()), grads, state


@pytest.mark.parametrize("scheme", [None, "moe", "early_exit", "mod", "sparse_attention"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_is_bitwise_and_counts_once(
    tmp_path: Path, scheme: str | None, precision: str
) -> None:
    cfg = scheme_config(tmp_path, scheme, f"train.precision={precision}")
    plain = LayerCall.for_job(cfg, "cpu")
    recomputed = LayerCall(
        precision=plain.precision, recompute_layers=range(1, cfg.model.num_blocks + 1)
    )
    loss, grads, state = _train_once(cfg, plain)
    loss_r, grads_r, state_r = _train_once(cfg, recomputed)
    assert loss_r == loss
    assert len(grads_r) == len(grads) and all(
        torch.equal(a, b) for a, b in zip(grads, grads_r, strict=True)
    )
    assert state_r == state  # the recomputation did not count its tokens again


def _saved_bytes(cfg: JobConfig, call: LayerCall) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _train_once(cfg, call)
    return total


def test_recompute_keeps_far_fewer_activations(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "model.num_blocks=6")
    blocks = range(1, cfg.model.num_blocks + 1)
    kept = _saved_bytes(cfg, LayerCall())
    recomputed = _saved_bytes(cfg, LayerCall(recompute_layers=blocks))
    assert recomputed < 0.5 * kept, (recomputed, kept)


@pytest.mark.mpi
def test_recompute_pipeline_matches_the_reference(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "pipeline.recompute=block", "pipeline.num_stages=2")
    assert run_job(cfg)["losses"] == train_reference(cfg).losses
