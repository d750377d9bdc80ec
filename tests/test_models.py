"""Model families and the Hugging Face import, checked against transformers itself.

* ``gpt2`` through the family registry builds bit-for-bit what ``model.gpt`` builds;
* a Llama (GQA, RoPE with a non-default theta, untied head) and a GPT-2 (tied head, Conv1D
  weights, tanh GELU) built by transformers from a config and imported with
  ``model.init_from`` score the same loss as transformers on the same windows (1e-5 relative,
  fp32), from one file and from a sharded index;
* config.json wins over the job's model keys, with one warning line per differing key (its
  ``tie_word_embeddings`` sets ``model.tie_embeddings``);
* bad input: one line naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dynmo_hpc import config as config_mod
from dynmo_hpc.config.sections import ARCH_SCHEMES
from dynmo_hpc.errors import CheckpointError, ConfigError
from dynmo_hpc.model import families
from dynmo_hpc.model.evaluate import mean_loss, windows
from dynmo_hpc.model.gpt import build_layer as gpt_build_layer
from dynmo_hpc.model.hf_weights import HFCheckpoint, check_checkpoint
from dynmo_hpc.model.schemes import build_layer
from tests.helpers.hf_models import VOCAB, hf_loss, load_model, save_model

SEQ_LEN = 16


def _job(init_from: Path | None = None, **model: object) -> config_mod.JobConfig:
    keys: dict[str, object] = {"seq_len": SEQ_LEN, **model}
    if init_from is not None:
        keys["init_from"] = str(init_from)
    return config_mod.from_dict({"model": keys})


def _tokens(n: int = 2000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).astype(np.uint16)


def test_gpt2_family_builds_the_plain_model_bitwise():
    cfg = _job(num_blocks=2, d_model=32, num_heads=2, d_ff=64)
    for index in range(cfg.model.num_layers):
        ours = build_layer(cfg, index).state_dict()
        plain = gpt_build_layer(cfg.model, cfg.job.seed, index).state_dict()
        assert ours.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(ours[name], tensor), name


def test_llama_layers_are_deterministic_per_seed_and_index():
    cfg = _job(arch="llama", num_blocks=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48)
    a = families.build_layer(cfg.model, 7, 1).state_dict()
    b = families.build_layer(cfg.model, 7, 1).state_dict()
    c = families.build_layer(cfg.model, 8, 1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["self_attn.q_proj.weight"], c["self_attn.q_proj.weight"])
    assert a["self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8


@pytest.mark.parametrize(
    ("arch", "shard"), [("llama", None), ("gpt2", None), ("llama", "20KB"), ("gpt2", "20KB")]
)
def test_imported_model_scores_transformers_loss(tmp_path, arch, shard):
    directory = save_model(tmp_path / "hf", arch, max_shard_size=shard)
    if shard is not None:
        assert (directory / "model.safetensors.index.json").is_file()
    cfg = _job(directory)
    assert cfg.model.arch == arch
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    batch = windows(_tokens(), SEQ_LEN, 6)
    model, _ = load_model(directory)
    ours, theirs = mean_loss(layers, batch), hf_loss(model, batch)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


def test_config_json_wins_with_one_warning_per_differing_key(tmp_path, caplog):
    directory = save_model(tmp_path / "hf", "llama")
    with caplog.at_level(logging.WARNING, logger="dynmo_hpc.config.hf_model"):
        cfg = _job(directory, d_model=128, num_heads=4, num_blocks=9)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # num_heads agrees: no line
    assert any("model.d_model=128" in line and "(32)" in line for line in lines)
    assert any("model.num_blocks=9" in line and "(3)" in line for line in lines)
    assert (cfg.model.d_model, cfg.model.num_blocks, cfg.model.kv_heads) == (32, 3, 2)
    assert cfg.model.norm_eps == 1e-6 and cfg.model.rope_theta == 5000.0


def test_llama_section_validation():
    with pytest.raises(ConfigError, match=r"num_heads\(4\) % model.num_kv_heads\(3\)"):
        _job(arch="llama", num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"num_kv_heads=2 needs model\.arch: llama"):
        _job(num_kv_heads=2)
    with pytest.raises(ConfigError, match=r"model\.arch=.mamba. is not a model family"):
        _job(arch="mamba")


def test_a_family_refuses_schemes_it_does_not_implement(monkeypatch):
    """A family that lists its schemes in ARCH_SCHEMES gets the others refused in one line."""
    monkeypatch.setitem(ARCH_SCHEMES, "llama", frozenset({"freezing"}))
    with pytest.raises(ConfigError, match=r"schemes moe are not implemented for model\.arch=llama"):
        config_mod.from_dict({"model": {"arch": "llama"}, "schemes": {"moe": {}}})
    config_mod.from_dict({"model": {"arch": "llama"}, "schemes": {"freezing": {}}})


def test_llama_trains_with_freezing_config():
    cfg = config_mod.from_dict({"model": {"arch": "llama"}, "schemes": {"freezing": {}}})
    layer = build_layer(cfg, 1)
    assert hasattr(layer, "frozen") and hasattr(layer, "self_attn")


# ---------------------------------------------------------------------------------- bad input


def _rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_missing_config_json_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: no such file"):
        _job(tmp_path)


def test_unreadable_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: unreadable"):
        _job(tmp_path)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 128}, "sliding_window"),
    ],
)
def test_unsupported_llama_features_are_refused_naming_the_key(tmp_path, changes, key):
    directory = save_model(tmp_path / "hf", "llama")
    _rewrite_config(directory, **changes)
    with pytest.raises(ConfigError, match=f"config.json: {key}"):
        _job(directory)


def _edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "tensor model.layers.1.mlp.up_proj.weight is missing",
        ),
        (
            lambda t: t.update({"model.layers.9.extra": torch.zeros(2)}),
            "unexpected tensor model.layers.9.extra",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(31)}),
            r"tensor model.norm.weight has shape \[31\], config.json implies \[32\]",
        ),
    ],
)
def test_bad_tensors_are_named_with_their_file(tmp_path, edit, message):
    directory = save_model(tmp_path / "hf", "llama")
    _edit_tensors(directory, edit)
    cfg = _job(directory)
    with pytest.raises(CheckpointError, match=message) as info:
        check_checkpoint(cfg.model, HFCheckpoint(directory))
    assert "\n" not in str(info.value)
    assert str(directory) in str(info.value)


@pytest.mark.parametrize(
    "model",
    [
        {"arch": "llama", "num_blocks": 2, "d_model": 32, "num_heads": 4, "num_kv_heads": 2},
        {"arch": "gpt2", "num_blocks": 2, "d_model": 32, "num_heads": 2, "max_positions": 40},
    ],
)
def test_layer_params_count_what_the_family_builds(model):
    """The pre-launch memory bound counts each family's real parameters."""
    cfg = _job(d_ff=48, vocab_size=300, **model)
    built = [sum(p.numel() for p in build_layer(cfg, i).parameters()) for i in range(4)]
    assert cfg.model.layer_params() == built


def test_a_tied_head_imports_tied_with_no_warning(tmp_path, caplog):
    """config.json's tie_word_embeddings (GPT-2's default) sets model.tie_embeddings; the head
    holds its own copy, equal to the embedding's."""
    directory = save_model(tmp_path / "hf", "gpt2")  # GPT-2 ties lm_head to wte
    with caplog.at_level(logging.WARNING, logger="dynmo_hpc.config.hf_model"):
        cfg = _job(directory)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert cfg.model.tie_embeddings
    head, embedding = build_layer(cfg, cfg.model.num_layers - 1), build_layer(cfg, 0)
    assert torch.equal(head.lm_head.weight, embedding.wte.weight)
    assert head.lm_head.weight.data_ptr() != embedding.wte.weight.data_ptr()
