"""Tied input/output embeddings (``model.tie_embeddings``) in one process.

* the key: off by default (an untied gpt2 job builds what it built before), set by an imported
  config.json's ``tie_word_embeddings`` (one warning line when the job said otherwise);
* a fresh tied head starts bitwise equal to the embedding, in both families;
* the single-process reference keeps the two copies bitwise equal while it trains (clipping
  active), and its tied model learns;
* checked against transformers (a tied model built from a config, random weights): the summed
  gradient of our two copies is the gradient of transformers' one weight, and our clipping norm
  (the tied weight counted once) is transformers' total gradient norm.

The multi-rank cases (2 stages, replicas, the Hugging Face round trip) are in
``tests/test_pipeline_parity.py`` and ``tests/test_hf_roundtrip.py``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.evaluate import windows
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.optim import squared_grad_norm
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.model.tied import norm_exclusions, sum_local_, summed_grad, tied_parameter
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.hf_models import VOCAB, save_model
from tests.helpers.jobs import tiny_config

EMBEDDING_WEIGHT = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}


def _job(**model: object) -> config_mod.JobConfig:
    return config_mod.from_dict({"model": {"seq_len": 16, **model}})


def test_off_by_default_and_the_untied_head_is_its_own():
    cfg = _job(num_blocks=1, d_model=16, num_heads=2, d_ff=32)
    assert cfg.model.tie_embeddings is False
    head, embedding = build_layer(cfg, cfg.model.num_layers - 1), build_layer(cfg, 0)
    assert not torch.equal(head.lm_head.weight, embedding.wte.weight)
    assert norm_exclusions(cfg.model, cfg.model.num_layers - 1) == ()
    assert tied_parameter(cfg.model, 0, embedding) is None


def _tied(arch: str, **sections: object) -> config_mod.JobConfig:
    model = {"arch": arch, "num_blocks": 2, "d_model": 16, "num_heads": 2, "d_ff": 32}
    return config_mod.from_dict({"model": {**model, "tie_embeddings": True}, **sections})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("schemes", [{}, {"freezing": {}}])
def test_a_fresh_tied_head_starts_as_the_embedding(arch, schemes):
    cfg = _tied(arch, schemes=schemes)
    head, embedding = build_layer(cfg, cfg.model.num_layers - 1), build_layer(cfg, 0)
    assert torch.equal(head.lm_head.weight, embedding.get_parameter(EMBEDDING_WEIGHT[arch]))
    assert (
        head.lm_head.weight.data_ptr() != embedding.get_parameter(EMBEDDING_WEIGHT[arch]).data_ptr()
    )
    assert norm_exclusions(cfg.model, cfg.model.num_layers - 1) == ("lm_head.weight",)
    assert norm_exclusions(cfg.model, 0) == ()


@pytest.mark.parametrize(
    ("arch", "overrides", "tied"),
    [
        ("gpt2", {}, True),  # transformers' GPT-2 default
        ("gpt2", {"tie_word_embeddings": False}, False),
        ("llama", {}, False),  # tests.helpers.hf_models unties its Llama
        ("llama", {"tie_word_embeddings": True}, True),
    ],
)
def test_an_import_sets_the_key_from_config_json(tmp_path, arch, overrides, tied):
    directory = save_model(tmp_path / "hf", arch, **overrides)
    cfg = _job(init_from=str(directory))
    assert cfg.model.tie_embeddings is tied


def test_a_job_that_says_otherwise_gets_one_warning(tmp_path, caplog):
    directory = save_model(tmp_path / "hf", "gpt2")
    with caplog.at_level(logging.WARNING, logger="dynmo_hpc.config.hf_model"):
        cfg = _job(init_from=str(directory), tie_embeddings=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "model.tie_embeddings=False differs" in lines[0], lines
    assert cfg.model.tie_embeddings is True


def test_summed_grad_counts_a_missing_gradient_as_zero():
    a, b = torch.tensor([1.0, -0.0]), torch.tensor([0.5, 0.0])
    assert summed_grad(None, None) is None
    assert torch.equal(summed_grad(a, b), a + b)
    assert torch.equal(summed_grad(a, None), a) and torch.equal(summed_grad(None, b), b)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_reference_keeps_both_copies_bitwise_equal(tmp_path, arch):
    cfg = tiny_config(
        tmp_path,
        f"model.arch={arch}",
        "model.tie_embeddings=true",
        "train.steps=6",
        "train.grad_clip=0.05",  # clipping is active every step
    )
    result = train_reference(cfg)
    embedding = result.state[0][EMBEDDING_WEIGHT[arch]]
    head = result.state[cfg.model.num_layers - 1]["lm_head.weight"]
    assert torch.equal(embedding, head)
    assert not torch.equal(embedding, build_layer(cfg, 0).get_parameter(EMBEDDING_WEIGHT[arch]))
    assert result.losses[-1] < result.losses[0], "the tied model should learn"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gradient_and_clipping_norm_are_transformers_single_weight(tmp_path, arch):
    """Import a tied transformers model; one batch forward and backward on both sides: the
    two copies' summed gradient is transformers' gradient of its one tied weight, and the
    global norm over our layers (tied weight counted once) is transformers' total norm."""
    import transformers

    directory = save_model(tmp_path / "hf", arch, tie_word_embeddings=True)
    cfg = _job(init_from=str(directory))
    assert cfg.model.tie_embeddings
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=4 * 17).astype(np.uint16)
    batch = windows(tokens, 16, 4)

    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    ctx = MicrobatchContext(tokens=batch[:, :-1].contiguous(), targets=batch[:, 1:].contiguous())
    x = None
    for layer in layers:
        x = layer(x, ctx)
    assert ctx.loss is not None
    ctx.loss.backward()
    last = cfg.model.num_layers - 1
    embedding = tied_parameter(cfg.model, 0, layers[0])
    head = tied_parameter(cfg.model, last, layers[last])
    assert embedding is not None and head is not None
    sum_local_(embedding, head)
    assert torch.equal(embedding.grad, head.grad)
    ours = math.sqrt(
        math.fsum(
            squared_grad_norm(layer, norm_exclusions(cfg.model, i))
            for i, layer in enumerate(layers)
        )
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()  # no dropout (GPT-2 configs default to 0.1); gradients still flow
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model(input_ids=batch, labels=batch).loss.backward()
    theirs = math.sqrt(math.fsum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    torch.testing.assert_close(
        embedding.grad, model.get_input_embeddings().weight.grad, rtol=1e-4, atol=1e-7
    )
    assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
    untied_norm = math.sqrt(
        math.fsum(squared_grad_norm(layer) for layer in layers)  # the copy counted twice
    )
    assert abs(untied_norm - theirs) > 1e-3 * theirs, "the tied weight must count once"
