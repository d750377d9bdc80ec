"""Validation loss: passes every ``train.eval_interval`` steps through the pipeline equal the
single-process forward over the same windows, leave training bitwise unchanged, reach the run
log's ``eval`` table, and the report's loss figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.launch import preflight
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.pipeline.evaluate import EVAL_STEP, _untouched, is_eval_step
from dynmo_hpc.runlog import load
from dynmo_hpc.runlog.report import plot_loss, summarize
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import run_job, tiny_config
from tests.helpers.scheme_jobs import scheme_config


def test_eval_steps() -> None:
    assert [s for s in range(10) if is_eval_step(s, 4, 10)] == [3, 7, 9]
    assert [s for s in range(10) if is_eval_step(s, 0, 10)] == []
    assert [s for s in range(4) if is_eval_step(s, 1, 4)] == [0, 1, 2, 3]


def test_eval_windows_must_fill_microbatches(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="eval_windows=5 is not a multiple"):
        tiny_config(tmp_path, "train.eval_interval=2", "train.eval_windows=5")
    tiny_config(tmp_path, "train.eval_windows=5")  # no validation: not checked
    no_val = tiny_config(tmp_path, "train.eval_interval=2", "data.val_fraction=0")
    with pytest.raises(ConfigError, match=r"no validation split; HINT: set data\.val_fraction"):
        preflight.check_data(no_val)


def _reference_eval_loss(cfg, state: dict[int, dict[str, torch.Tensor]]) -> float:  # type: ignore[no-untyped-def]
    layers = []
    for i in range(cfg.model.num_layers):
        layer = build_layer(cfg, i)
        layer.load_state_dict(state[i])
        layers.append(layer)
    dataset = TextDataset.for_job(cfg)
    batch = cfg.train.micro_batch_size
    total = 0.0
    with torch.no_grad():
        for mb in range(cfg.train.eval_windows // batch):
            tokens, targets = dataset.batch(cfg.job.seed, EVAL_STEP, mb, batch, split="val")
            ctx = MicrobatchContext(tokens=tokens, targets=targets)
            x = None
            for layer in layers:
                x = layer(x, ctx)
            assert ctx.loss is not None
            total += float(ctx.loss)
    return total / (cfg.train.eval_windows // batch)


@pytest.mark.mpi
def test_pipeline_validation_matches_the_reference_and_leaves_training_alone(
    tmp_path: Path,
) -> None:
    cfg = tiny_config(
        tmp_path,
        "pipeline.num_stages=2",
        "train.eval_interval=2",
        "train.eval_windows=6",
        "train.steps=3",
    )
    result = run_job(cfg)
    reference = train_reference(cfg)
    assert result["losses"] == reference.losses  # validation changed nothing
    run = load(cfg.run_dir / "run.h5")
    assert run.eval["step"].tolist() == [1, 2]
    after_two = train_reference(cfg, steps=2)
    want = [_reference_eval_loss(cfg, after_two.state), _reference_eval_loss(cfg, reference.state)]
    np.testing.assert_allclose(run.eval["loss"].to_numpy(), want, rtol=1e-6)
    assert f"Validation: 2 passes; loss {run.eval['loss'].iloc[0]:.4g} (step 1)" in summarize(run)
    (ax,) = plot_loss(run).axes
    labels = [line.get_label() for line in ax.lines]
    assert "training" in labels and "validation" in labels


@pytest.mark.parametrize("scheme", ["moe", "early_exit", "mod"])
def test_a_pass_leaves_the_schemes_counters_and_the_rng_alone(tmp_path: Path, scheme: str) -> None:
    cfg = scheme_config(tmp_path, scheme)
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    tokens, targets = TextDataset.for_job(cfg).batch(1, 0, 0, cfg.train.micro_batch_size)

    def forward() -> None:
        x = None
        ctx = MicrobatchContext(tokens=tokens, targets=targets)
        for layer in layers:
            x = layer(x, ctx)

    def public_state() -> list[str]:
        return [
            repr(sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_")))
            for layer in layers
            for m in layer.modules()
        ]

    forward()  # the counters exist and are non-zero
    before = public_state()
    rng = torch.get_rng_state()
    with _untouched(layers, torch.device("cpu")):
        forward()
        torch.rand(3)
    assert public_state() == before
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.mpi
def test_replicas_split_the_validation_windows(tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path,
        "pipeline.num_stages=1",
        "pipeline.replicas=2",
        "train.eval_interval=2",
        "train.eval_windows=6",
        "train.steps=2",
    )
    run_job(cfg)
    run = load(cfg.run_dir / "run.h5")
    assert run.eval["step"].tolist() == [1]
    want = _reference_eval_loss(cfg, train_reference(cfg).state)
    np.testing.assert_allclose(run.eval["loss"].to_numpy(), [want], rtol=1e-5)
