"""prepare-data: shards that decode back to the text, the validation tail, uint16/uint32, streaming
batches that change nothing, shards read across boundaries, and one-line refusals of bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from dynmo_hpc.cli import main
from dynmo_hpc.data.corpus import default_corpus_text
from dynmo_hpc.data.prepare import TokenizerChoice, prepare
from dynmo_hpc.data.shards import TokenWindows, open_prepared, token_dtype
from dynmo_hpc.errors import DataError


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text(default_corpus_text()[:200_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "data"
    prepare([text_file], out, TokenizerChoice(vocab_size=600), val_fraction=0.1)
    return out


def _decode(directory: Path, ids: np.ndarray) -> str:
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return str(tok.decode(ids.tolist()))


def test_shards_decode_to_the_text_with_the_tail_held_out(prepared: Path, text_file: Path) -> None:
    data = open_prepared(prepared)
    text = text_file.read_text(encoding="utf-8")
    train = _decode(prepared, data.train[0 : len(data.train)])
    val = _decode(prepared, data.val[0 : len(data.val)])
    assert train + val == text
    val_share = len(val.encode()) / len(text.encode())
    assert 0.09 < val_share <= 0.1
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["vocab_size"] == data.vocab_size == 600
    assert meta["dtype"] == "uint16"
    assert meta["num_tokens"] == {"train": len(data.train), "val": len(data.val)}
    digest = hashlib.sha256((prepared / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer_sha256"] == digest
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]


def test_small_batches_and_shards_and_a_given_tokenizer_give_the_same_ids(
    prepared: Path, text_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "again"
    choice = TokenizerChoice(path=prepared / "tokenizer.json")
    prepare([text_file], out, choice, val_fraction=0.1, shard_tokens=5000, batch_bytes=3000)
    first, again = open_prepared(prepared), open_prepared(out)
    assert len(again.train.arrays) > 1
    for split in ("train", "val"):
        a, b = getattr(first, split), getattr(again, split)
        assert np.array_equal(a[0 : len(a)], b[0 : len(b)])
    # A window spanning a shard boundary is the concatenation.
    s = 5000 - 3
    assert np.array_equal(again.train[s : s + 10], first.train[s : s + 10])


def test_token_windows_slices() -> None:
    windows = TokenWindows([np.arange(0, 3), np.arange(3, 3), np.arange(3, 10)])
    flat = np.arange(10)
    assert len(windows) == 10
    for start in range(10):
        for stop in range(start, 11):
            assert np.array_equal(windows[start:stop], flat[start:stop])


def test_dtype_widens_past_uint16(text_file: Path, tmp_path: Path) -> None:
    assert token_dtype(1 << 16) == np.dtype("<u2")
    assert token_dtype((1 << 16) + 1) == np.dtype("<u4")
    words = {f"w{i}": i for i in range(70_000)}
    words["[UNK]"] = 70_000
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    corpus = tmp_path / "w.txt"
    corpus.write_text("w69999 w1 w2 nope\n" * 50, encoding="utf-8")
    out = tmp_path / "big"
    prepare([corpus], out, TokenizerChoice(path=tmp_path / "big.json"), val_fraction=0.0)
    data = open_prepared(out)
    assert data.meta["dtype"] == "uint32" and data.vocab_size == 70_001
    assert data.train[0:4].tolist() == [69_999, 1, 2, 70_000]


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["prepare-data", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_bad_input_gets_one_line_and_nothing_written(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"text\0more")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    out = tmp_path / "out"
    cases = [
        ([], "no input text files"),
        ([str(empty)], "is empty"),
        ([str(binary)], "NUL byte at offset 4"),
        ([str(latin)], "not UTF-8"),
        ([str(tmp_path / "missing.txt")], "does not exist"),
    ]
    for texts, expected in cases:
        code, line = _cli(
            [*texts, "--out", str(out), "--train-tokenizer", "--vocab-size", "300"], capsys
        )
        assert code == 2 and line.startswith("error:") and expected in line and "HINT:" in line
    code, line = _cli(
        [str(text_file), "--out", str(out), "--train-tokenizer", "--vocab-size", "100"], capsys
    )
    assert code == 2 and "smaller than the 256 byte values" in line
    code, line = _cli([str(text_file), "--out", str(out)], capsys)
    assert code == 2 and "--train-tokenizer" in line
    assert not out.exists() and list(tmp_path.glob(".out*")) == []
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, line = _cli(
        [str(text_file), "--out", str(out), "--train-tokenizer", "--vocab-size", "300"], capsys
    )
    assert code == 2 and "not empty" in line and "--overwrite" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_overwrite_replaces_the_directory(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    args = [str(text_file), "--out", str(out), "--train-tokenizer", "--vocab-size", "300"]
    assert main(["prepare-data", *args, "--overwrite"]) == 0
    assert "prepared" in capsys.readouterr().out
    assert not (out / "old.txt").exists() and open_prepared(out).vocab_size == 300
    with pytest.raises(DataError, match="not empty"):
        prepare([text_file], out, TokenizerChoice(vocab_size=300))
