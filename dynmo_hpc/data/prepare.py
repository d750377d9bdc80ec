"""prepare-data: text files -> a tokenizer and memory-mappable token shards, in bounded memory.

The steps:

1. check every file (:mod:`.text_files`): non-empty UTF-8 without NUL bytes;
2. the tokenizer: a Hugging Face ``tokenizer.json`` given by the user, or a byte-level BPE trained
   on the text itself (``tokenizers``' trainer, fed from an iterator of pieces);
3. stream the text in pieces, tokenize batches of pieces with ``encode_batch_fast`` (Rust
   threads, all cores), and append the ids to shards (:class:`~.shards.ShardWriter`): the last
   ``val_fraction`` of the text's bytes goes to the validation split;
4. write ``tokenizer.json`` and ``meta.json`` last.

Memory: one batch of pieces (``batch_bytes``) and its ids at a time, whatever the corpus size;
training a tokenizer also holds the trainer's word counts (bounded by the distinct words, not the
text). Atomic: everything goes to a hidden temporary directory beside ``out``, renamed to ``out``
only when complete; an error (or Ctrl-C) removes it, so ``out`` is never half-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_hpc.atomic_io import fsync_dir
from dynmo_hpc.config.data_source import BYTE_ALPHABET, MAX_VOCAB
from dynmo_hpc.data.shards import (
    TOKENIZER_FILE,
    ShardWriter,
    meta_record,
    token_dtype,
)
from dynmo_hpc.data.text_files import check_text_files, text_pieces
from dynmo_hpc.errors import DataError

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 27
"""Ids per shard: 256 MiB of ``uint16``."""

DEFAULT_BATCH_BYTES = 1 << 20
"""Text bytes tokenized per ``encode_batch_fast`` call: bounds the encode loop's memory (the
library's per-token encodings take about 100 bytes per token while a batch is alive)."""

PROGRESS_INTERVAL_S = 5.0
"""Seconds between progress lines."""


@dataclass(frozen=True, kw_only=True)
class TokenizerChoice:
    """Where the tokenizer comes from: a file, or trained on the input with ``vocab_size``."""

    path: Path | None = None
    vocab_size: int | None = None

    def check(self) -> None:
        """Raises DataError: neither or both given, a vocabulary below the byte alphabet."""
        if (self.path is None) == (self.vocab_size is None):
            raise DataError(
                "give either a tokenizer file or a vocabulary size to train one; HINT: "
                "--tokenizer tokenizer.json, or --train-tokenizer --vocab-size 8192"
            )
        if self.vocab_size is not None and not BYTE_ALPHABET <= self.vocab_size < MAX_VOCAB:
            raise DataError(
                f"vocabulary size {self.vocab_size} is smaller than the {BYTE_ALPHABET} byte "
                f"values byte-level BPE starts from (or >= {MAX_VOCAB}); HINT: use at least "
                f"{BYTE_ALPHABET}, e.g. 8192"
            )
        if self.path is not None and not self.path.is_file():
            raise DataError(
                f"tokenizer {str(self.path)!r} is not a file; HINT: give a tokenizer.json"
            )


@dataclass(frozen=True)
class PrepareResult:
    """What prepare-data wrote: the directory and its ``meta.json`` contents."""

    out: Path
    meta: dict[str, Any]


def train_bpe(paths: list[Path], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab_size`` ids, trained on the files' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    log.info("training a byte-level BPE tokenizer of %d tokens", vocab_size)
    tokenizer.train_from_iterator(text_pieces(paths), trainer=trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face tokenizer from its ``tokenizer.json``.

    Raises:
        DataError: the file is not a tokenizer the library can read.
    """
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise DataError(
            f"tokenizer {str(path)!r} cannot be read ({exc}); HINT: give the tokenizer.json a "
            "Hugging Face model ships"
        ) from None


def _batches(
    paths: list[Path], split_at_bytes: int, batch_bytes: int
) -> Iterator[tuple[str, list[str], int]]:
    """``(split, pieces, num_bytes)`` batches: pieces before byte ``split_at_bytes`` of the text
    are ``train``, the rest ``val`` (the piece that crosses it is cut there)."""
    seen = 0
    batch: list[str] = []
    batch_split = "train"
    batch_size = 0
    for piece in text_pieces(paths):
        raw = piece.encode("utf-8")
        parts: list[tuple[str, str, int]]
        if seen < split_at_bytes < seen + len(raw):
            head = raw[: split_at_bytes - seen].decode("utf-8", errors="ignore")
            head_size = len(head.encode("utf-8"))
            parts = [("train", head, head_size), ("val", piece[len(head) :], len(raw) - head_size)]
        else:
            parts = [("train" if seen < split_at_bytes else "val", piece, len(raw))]
        seen += len(raw)
        for split, text, size in parts:
            if not text:
                continue
            if batch and (split != batch_split or batch_size >= batch_bytes):
                yield batch_split, batch, batch_size
                batch, batch_size = [], 0
            batch_split = split
            batch.append(text)
            batch_size += size
    if batch:
        yield batch_split, batch, batch_size


def _encode_into(
    tokenizer: Any,
    paths: list[Path],
    writers: dict[str, ShardWriter],
    *,
    num_bytes: int,
    val_fraction: float,
    batch_bytes: int,
) -> None:
    """Tokenize the files' text into the writers, logging progress."""
    split_at = num_bytes - int(num_bytes * val_fraction)
    done_bytes = 0
    t0 = last = time.monotonic()
    for split, pieces, size in _batches(paths, split_at, batch_bytes):
        encodings = tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        writers[split].write(ids)
        done_bytes += size
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL_S:
            last = now
            log.info(
                "tokenized %.1f of %.1f MB (%.1f MB/s), %d tokens",
                done_bytes / 1e6,
                num_bytes / 1e6,
                done_bytes / 1e6 / (now - t0),
                sum(w.num_tokens for w in writers.values()),
            )


def _claim_out(out: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty ``out`` unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; HINT: choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(
            f"--out {str(out)!r} exists and is not empty; HINT: choose another directory, or "
            "pass --overwrite to replace it"
        )


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` into place as ``out``, replacing what was there."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def prepare(
    paths: list[Path],
    out: Path,
    choice: TokenizerChoice,
    *,
    val_fraction: float = 0.1,
    overwrite: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> PrepareResult:
    """Tokenize ``paths`` into ``out`` (see the module docstring); returns what was written.

    Raises:
        DataError: no files, a file that is not UTF-8 text, a bad tokenizer choice, an existing
            non-empty ``out`` without ``overwrite``, or a bad ``val_fraction``.
    """
    choice.check()
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1); HINT: try 0.1")
    _claim_out(out, overwrite)
    sizes = check_text_files(paths)
    num_bytes = sum(sizes)
    log.info("preparing %d file(s), %.1f MB of text -> %s", len(paths), num_bytes / 1e6, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if choice.path is not None:
            tokenizer = load_tokenizer(choice.path)
        else:
            assert choice.vocab_size is not None
            tokenizer = train_bpe(paths, choice.vocab_size)
        # The largest id + 1, not the entry count: a tokenizer's ids need not be contiguous.
        vocab_size = int(max(tokenizer.get_vocab(with_added_tokens=True).values())) + 1
        dtype = token_dtype(vocab_size)
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
        try:
            _encode_into(
                tokenizer,
                paths,
                writers,
                num_bytes=num_bytes,
                val_fraction=val_fraction,
                batch_bytes=batch_bytes,
            )
        finally:
            shards = {s: w.close() for s, w in writers.items()}
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        digest = hashlib.sha256((tmp / TOKENIZER_FILE).read_bytes()).hexdigest()
        meta = meta_record(
            vocab_size=vocab_size,
            dtype=dtype,
            tokenizer_sha256=digest,
            shards=shards,
            sources=[str(p) for p in paths],
            val_fraction=val_fraction,
            num_text_bytes=num_bytes,
        )
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        _claim_out(out, overwrite)  # nothing appeared there meanwhile
        _publish(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    counts = meta["num_tokens"]
    log.info(
        "prepared %s: %d train + %d val tokens, vocabulary %d (%s)",
        out,
        counts["train"],
        counts["val"],
        vocab_size,
        dtype.name,
    )
    return PrepareResult(out=out, meta=meta)
