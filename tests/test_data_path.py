"""``data.path`` forms: a prepare-data directory and a flat ``.bin`` read memory-mapped, text with
``data.tokenizer`` prepared once into a cache, ``model.vocab_size`` defaulting to the data's, and
preflight refusing bad token data. One 2-rank run on cached BPE data matches the single-process
reference bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.data.cache import cache_dir_for
from dynmo_hpc.data.corpus import default_corpus_text
from dynmo_hpc.data.prepare import TokenizerChoice, prepare
from dynmo_hpc.data.shards import open_prepared
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.launch import preflight
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import ROOT, run_job, tiny_config


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text(default_corpus_text()[:120_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare([text_file], out, TokenizerChoice(vocab_size=700), shard_tokens=4000)
    return out


def test_set_data_path_switches_a_shipped_job_and_the_vocabulary(
    prepared: Path, tmp_path: Path
) -> None:
    cfg = config_mod.load(ROOT / "jobs/elastic.yaml", [f"data.path={prepared}"])
    assert cfg.model.vocab_size == 700
    dataset = TextDataset.for_job(cfg)
    data = open_prepared(prepared)
    seq_len = cfg.model.seq_len
    tokens, targets = dataset.batch(cfg.job.seed, 3, 1, 4)
    assert tokens.shape == targets.shape == (4, seq_len)
    assert np.array_equal(tokens[:, 1:].numpy(), targets[:, :-1].numpy())
    # Every row is a window of the training stream, and the batch is a pure function.
    stream = data.train[0 : len(data.train)].astype(np.int64)
    for row in tokens.numpy():
        hits = np.flatnonzero(stream[: len(stream) - seq_len] == row[0])
        assert any(np.array_equal(stream[h : h + seq_len], row) for h in hits)
    again, _ = TextDataset.for_job(cfg).batch(cfg.job.seed, 3, 1, 4)
    assert np.array_equal(again.numpy(), tokens.numpy())
    val, _ = dataset.batch(cfg.job.seed, 3, 1, 4, split="val")
    assert int(val.max()) < 700


def test_a_model_vocabulary_smaller_than_the_data_is_refused(prepared: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.vocab_size=512 .*data's vocabulary \(700"):
        config_mod.load(
            ROOT / "jobs/default.yaml", [f"data.path={prepared}", "model.vocab_size=512"]
        )
    bigger = config_mod.load(
        ROOT / "jobs/default.yaml", [f"data.path={prepared}", "model.vocab_size=1024"]
    )
    assert bigger.model.vocab_size == 1024


def test_byte_text_keeps_its_batches(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    assert cfg.model.vocab_size == 256
    corpus = np.frombuffer(default_corpus_text().encode(), dtype=np.uint8)
    tokens, _ = TextDataset.for_job(cfg).batch(7, 2, 0, 3)
    rng = np.random.default_rng([7, 0, 2, 0])
    num_train = len(corpus) - int(len(corpus) * cfg.data.val_fraction)
    starts = rng.integers(0, num_train - cfg.model.seq_len - 1, size=3)
    want = np.stack([corpus[s : s + cfg.model.seq_len] for s in starts])
    assert np.array_equal(tokens.numpy(), want)


def test_flat_bin_file_and_its_vocabulary_check(tmp_path: Path) -> None:
    ids = (np.arange(5000) % 300).astype("<u2")
    path = tmp_path / "train.bin"
    ids.tofile(path)
    cfg = tiny_config(tmp_path, f"data.path={path}", "model.vocab_size=300")
    preflight.check_data(cfg)
    dataset = TextDataset.for_job(cfg)
    assert len(dataset.train) == 4500 and len(dataset.val) == 500
    tokens, targets = dataset.batch(1, 0, 0, 2)
    assert np.array_equal((tokens[:, 0].numpy() + 1) % 300, targets[:, 0].numpy())
    small = tiny_config(tmp_path, f"data.path={path}")
    with pytest.raises(ConfigError, match=r"token id 299.*vocabulary has 256"):
        preflight.check_data(small)


def test_preflight_refuses_bad_prepared_data(prepared: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ConfigError, match=r"without meta\.json"):
        tiny_config(tmp_path, f"data.path={bare}")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in prepared.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    cfg = tiny_config(tmp_path, f"data.path={copy}")
    preflight.check_data(cfg)
    shard = copy / "train_0001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"train_0001\.bin has .* bytes, meta.json says"):
        preflight.check_data(cfg)
    long = tiny_config(tmp_path, f"data.path={prepared}", "model.seq_len=20000")
    with pytest.raises(ConfigError, match=r"validation split has .* tokens"):
        preflight.check_data(long)


def test_tokenizer_choice_prepares_once_on_first_use(text_file: Path, tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path,
        f"data.path={text_file}",
        "data.tokenizer={train: true, vocab_size: 500}",
    )
    assert cfg.model.vocab_size == 500
    with pytest.raises(ConfigError, match="not there yet"):
        TextDataset.for_job(cfg)
    preflight.check_data(cfg)
    cache = cache_dir_for(cfg.data, cfg.job.out_dir)
    assert cache.parent == tmp_path / ".data_cache"
    stamp = (cache / "meta.json").stat().st_mtime_ns
    preflight.check_data(cfg)
    assert (cache / "meta.json").stat().st_mtime_ns == stamp
    assert json.loads((cache / "meta.json").read_text())["vocab_size"] == 500
    assert len(TextDataset.for_job(cfg).train) > 0
    other = tiny_config(
        tmp_path, f"data.path={text_file}", "data.tokenizer={train: true, vocab_size: 400}"
    )
    assert cache_dir_for(other.data, other.job.out_dir) != cache
    with pytest.raises(ConfigError, match="exactly one"):
        tiny_config(tmp_path, "data.tokenizer={train: false}")


@pytest.mark.mpi
def test_two_stages_on_cached_bpe_data_match_the_reference(text_file: Path, tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path,
        f"data.path={text_file}",
        "data.tokenizer={train: true, vocab_size: 400}",
        "pipeline.num_stages=2",
        "train.steps=3",
    )
    result = run_job(cfg)
    reference = train_reference(cfg)
    assert result["losses"] == reference.losses


def test_the_default_text_tokenized_into_a_chosen_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cfg = tiny_config(
        tmp_path, "data.tokenizer={train: true, vocab_size: 320}", f"data.cache_dir={cache}"
    )
    preflight.check_data(cfg)
    (prepared,) = cache.iterdir()
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["vocab_size"] == 320 and not list(cache.glob(".default-text-*"))
    dataset = TextDataset.for_job(cfg)
    assert len(dataset.train) == meta["num_tokens"]["train"]


def test_a_given_tokenizer_sets_the_vocabulary(
    prepared: Path, text_file: Path, tmp_path: Path
) -> None:
    tokenizer = prepared / "tokenizer.json"
    cfg = tiny_config(tmp_path, f"data.path={text_file}", f"data.tokenizer={{path: {tokenizer}}}")
    assert cfg.model.vocab_size == 700
    preflight.check_data(cfg)
    cache = cache_dir_for(cfg.data, cfg.job.out_dir)
    given = open_prepared(prepared)
    cached = open_prepared(cache)
    assert np.array_equal(cached.train[0:100], given.train[0:100])
    with pytest.raises(ConfigError, match=r"not a Hugging Face tokenizer\.json"):
        tiny_config(tmp_path, f"data.path={text_file}", f"data.tokenizer={{path: {text_file}}}")


def test_every_shipped_job_switches_to_prepared_data_with_one_key(prepared: Path) -> None:
    for job in sorted((ROOT / "jobs").rglob("*.yaml")):
        cfg = config_mod.load(job, [f"data.path={prepared}"])
        assert cfg.model.vocab_size == 700, job.name
