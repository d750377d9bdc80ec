"""The Hugging Face round trip, verified by transformers itself.

* ``dynmo-hpc eval`` of a Hugging Face directory prints transformers' own loss on the same
  windows (1e-5 relative, fp32), for both families;
* import -> train on 2 MPI stages with forced migrations -> ``dynmo-hpc export`` ->
  ``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected weights, and the same
  loss on both sides (and the trained weights moved away from the imported ones); untied, and
  tied (``tie_word_embeddings: true`` both ways, trained tied, exported without
  ``lm_head.weight``);
* per scheme: pruning exports exactly (zeros in the dense weights), MoD exports only with
  ``--dense-backbone``, MoE is refused; bad input is one ``error:`` line and nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dynmo_hpc.checkpoint.hf_export import export_notes
from dynmo_hpc.checkpoint.model_files import load_model
from dynmo_hpc.cli import main
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.evaluate import mean_loss, windows
from dynmo_hpc.runlog import load
from tests.helpers.hf_models import hf_loss, save_model
from tests.helpers.hf_models import load_model as hf_load_model
from tests.helpers.jobs import run_job, tiny_config
from tests.helpers.scheme_jobs import LLAMA, SCHEME_OVERRIDES

SEQ_LEN = 24
TIED_WEIGHT = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}
NUM_WINDOWS = 6


def _token_file(path: Path, vocab: int = 256, n: int = 4000) -> Path:
    np.random.default_rng(1).integers(0, vocab, size=n).astype("<u2").tofile(path)
    return path


def _eval(model: Path, data: Path, capsys) -> float:
    argv = ["eval", str(model), "--data", str(data), "--seq-len", str(SEQ_LEN)]
    assert main([*argv, "--windows", str(NUM_WINDOWS)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("loss "), out
    return float(out[-1].split()[1])


def _hf_loss(directory: Path, data: Path) -> tuple[float, dict]:
    model, info = hf_load_model(directory)
    tokens = np.fromfile(data, dtype="<u2")
    return hf_loss(model, windows(tokens, SEQ_LEN, NUM_WINDOWS)), info


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eval_of_a_hf_directory_is_transformers_loss(tmp_path, arch, capsys):
    directory = save_model(tmp_path / "hf", arch)
    data = _token_file(tmp_path / "tokens.bin", vocab=300)
    ours = _eval(directory, data, capsys)
    theirs, _ = _hf_loss(directory, data)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


def test_eval_refuses_ids_beyond_the_vocabulary(tmp_path, capsys):
    directory = save_model(tmp_path / "hf", "llama", vocab_size=280)
    data = _token_file(tmp_path / "tokens.bin", vocab=300)
    capsys.readouterr()
    argv = ["eval", str(directory), "--data", str(data), "--seq-len", "8", "--windows", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokens.bin" in err and "error:" in err


def test_export_notes_per_scheme():
    assert export_notes(["pruning", "freezing"], dense_backbone=False)[0].startswith(
        "schemes.pruning: pruned neurons and heads are zeros"
    )
    with pytest.raises(CheckpointError, match="pass --dense-backbone"):
        export_notes(["mod"], dense_backbone=False)
    assert "every token runs every block" in export_notes(["early_exit"], dense_backbone=True)[0]
    with pytest.raises(CheckpointError, match=r"schemes\.moe cannot be exported"):
        export_notes(["moe"], dense_backbone=True)


# ----------------------------------------------------------------------- multi-rank round trip


def _export(run_dir: Path, out: Path, *extra: str) -> None:
    assert main(["export", str(run_dir), "--out", str(out), *extra]) == 0


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("arch", "tied"),
    [("llama", False), ("gpt2", True), ("llama", True)],  # gpt2: transformers' default, tied
)
def test_import_train_migrate_export_loads_in_transformers(tmp_path, arch, tied, capsys):
    overrides = {"tie_word_embeddings": True} if arch == "llama" and tied else {}
    source = save_model(tmp_path / "hf", arch, num_hidden_layers=4, n_layer=4, **overrides)
    cfg = tiny_config(
        tmp_path,
        f"model.init_from={source}",
        f"model.seq_len={SEQ_LEN}",
        "pipeline.num_stages=2",
        "train.steps=6",
        "balance.algorithm=optimal",
        "balance.force_moves=true",
        "checkpoint.at_end=true",
        f"job.name=roundtrip_{arch}_{'tied' if tied else 'untied'}",
    )
    assert cfg.model.tie_embeddings is tied
    result = run_job(cfg)
    migrations = load(cfg.run_dir / "run.h5").events.query("kind == 'migrate'")
    assert len(migrations) >= 1, "the run should have migrated layers"
    assert result["losses"][-1] < result["losses"][0]

    out = tmp_path / "exported"
    _export(cfg.run_dir, out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied
    data = _token_file(tmp_path / "tokens.bin")
    theirs, info = _hf_loss(out, data)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if tied:
        model = hf_load_model(out)[0]
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        loaded = load_model(cfg.run_dir).layers
        assert torch.equal(loaded[0].get_parameter(TIED_WEIGHT[arch]), loaded[-1].lm_head.weight)
    ours = _eval(cfg.run_dir, data, capsys)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    before, _ = _hf_loss(source, data)
    assert abs(before - theirs) > 1e-3, "the exported model should be the trained one"


@pytest.mark.mpi
def test_pruned_model_exports_exactly_and_mod_only_as_dense_backbone(tmp_path, capsys):
    common = ["pipeline.num_stages=1", "train.steps=4", "checkpoint.at_end=true"]
    pruned = tiny_config(
        tmp_path,
        *common,
        "job.name=pruned",
        "schemes.pruning={final_sparsity: 0.5, start_step: 1, end_step: 3, interval_steps: 1}",
    )
    run_job(pruned)
    out = tmp_path / "pruned_hf"
    _export(pruned.run_dir, out)
    data = _token_file(tmp_path / "tokens.bin")
    loaded = load_model(pruned.run_dir)
    narrow = [layer.mlp.c_fc.out_features for layer in loaded.layers[1:-1] if hasattr(layer, "mlp")]
    assert min(narrow) < pruned.model.d_ff, "pruning should have removed neurons"
    ours = mean_loss(loaded.layers, windows(np.fromfile(data, dtype="<u2"), SEQ_LEN, NUM_WINDOWS))
    theirs, info = _hf_loss(out, data)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)

    mod = tiny_config(tmp_path, *common, "job.name=mod", "schemes.mod={}")
    run_job(mod)
    capsys.readouterr()
    refused = tmp_path / "mod_refused"
    assert main(["export", str(mod.run_dir), "--out", str(refused)]) == 2
    assert "--dense-backbone" in capsys.readouterr().err and not refused.exists()
    backbone = tmp_path / "mod_backbone"
    _export(mod.run_dir, backbone, "--dense-backbone")
    assert "every token runs every block" in capsys.readouterr().out
    _, info = _hf_loss(backbone, data)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(
        load_model(mod.run_dir).layers[0].wte.weight,
        hf_load_model(backbone)[0].transformer.wte.weight,
    )


@pytest.mark.mpi
def test_pruned_llama_exports_exactly_with_whole_kv_groups_zeroed(tmp_path, capsys):
    """A llama pruned in neurons and key/value groups exports as zeros in the dense weights:
    transformers computes the pruned model's loss."""
    cfg = tiny_config(
        tmp_path,
        *LLAMA,
        "pipeline.num_stages=1",
        "train.steps=4",
        "checkpoint.at_end=true",
        "job.name=pruned_llama",
        *SCHEME_OVERRIDES["pruning"],
    )
    run_job(cfg)
    loaded = load_model(cfg.run_dir)
    groups = [layer.attn.num_kv_heads for layer in loaded.layers[1:-1]]
    assert min(groups) < cfg.model.kv_heads, "pruning should have removed a key/value group"
    out = tmp_path / "pruned_llama_hf"
    _export(cfg.run_dir, out)
    data = _token_file(tmp_path / "tokens.bin")
    ours = mean_loss(loaded.layers, windows(np.fromfile(data, dtype="<u2"), SEQ_LEN, NUM_WINDOWS))
    theirs, info = _hf_loss(out, data)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


def test_run_refuses_a_checkpoint_with_a_missing_tensor_before_writing(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    source = save_model(tmp_path / "hf", "llama")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    argv = ["run", "jobs/llama.yaml", "--set", f"model.init_from={source}"]
    argv += ["--set", "data.tokenizer=null"]  # byte-level text: the tiny model's 300 ids hold it
    assert main([*argv, "--set", f"job.out_dir={tmp_path / 'runs'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # num_blocks, d_model, d_ff and rope_theta of jobs/llama.yaml differ from config.json
    warnings = [line for line in lines if "differs from" in line]
    assert len(warnings) == 4 and all("WARNING" in line for line in warnings), lines
    (error,) = [line for line in lines if line not in warnings]
    assert "model.layers.2.self_attn.k_proj.weight is missing" in error and str(source) in error
    assert not (tmp_path / "runs").exists()


@pytest.mark.mpi
def test_export_carries_the_runs_tokenizer(tmp_path, capsys):
    """A llama trained on text tokenized on first use (``data.tokenizer``) exports the
    tokenizer it trained on: transformers' ``AutoTokenizer`` loads it from the export and
    encodes as the run's tokenizer does; a byte-level run exports no tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    cfg = tiny_config(
        tmp_path,
        *LLAMA,
        "data.tokenizer={train: true, vocab_size: 320}",
        "checkpoint.at_end=true",
        "job.name=tokenized",
    )
    run_job(cfg)
    out = tmp_path / "exported"
    _export(cfg.run_dir, out)
    printed = capsys.readouterr().out
    (cache,) = (tmp_path / ".data_cache").iterdir()
    assert f"tokenizer: {cache / 'tokenizer.json'}" in printed
    assert (out / "tokenizer.json").read_bytes() == (cache / "tokenizer.json").read_bytes()
    text = "def export(model):\n    return model.to_hf()  # naïve"
    theirs = AutoTokenizer.from_pretrained(out)(text)["input_ids"]
    assert theirs == Tokenizer.from_file(str(cache / "tokenizer.json")).encode(text).ids
    model, info = hf_load_model(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.vocab_size == cfg.model.vocab_size

    plain = tiny_config(tmp_path, "checkpoint.at_end=true", "job.name=bytes")
    run_job(plain)
    _export(plain.run_dir, tmp_path / "bytes_exported")
    assert not (tmp_path / "bytes_exported" / "tokenizer.json").exists()
