"""Open what ``data`` names as a (train, validation) pair of token sequences, and check it.

The forms of ``data.path`` (:mod:`dynmo_hpc.config.data_source`):

- text (or null), byte-level: the UTF-8 bytes, read whole (:mod:`.corpus`), last
  ``data.val_fraction`` held out: the original path, unchanged bit for bit;
- text with ``data.tokenizer``: the prepared cache directory (:mod:`.cache`), opened as below;
- a flat ``uint16`` ``.bin`` (:mod:`.tokens`): memory-mapped, last ``data.val_fraction`` held out;
- a prepare-data directory (:mod:`.shards`): its shards memory-mapped, its own validation split.

Each split supports ``len()`` and ``[start:stop]``, which is all :mod:`.batches` needs; a mapped
split pages in only the windows a rank reads. :func:`check_source` is what preflight runs before
any rank starts: it prepares a ``data.tokenizer`` cache, checks both splits hold a sequence, and
scans a ``.bin`` file's ids against the model's vocabulary once (not on every rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from dynmo_hpc.config import DataSection
from dynmo_hpc.config.data_source import META_FILE, is_prepared_dir
from dynmo_hpc.data.cache import cache_dir_for, ensure_prepared
from dynmo_hpc.data.corpus import read_corpus, split_sizes
from dynmo_hpc.data.shards import TOKENIZER_FILE, open_prepared
from dynmo_hpc.data.tokens import check_vocab, is_token_file, open_tokens
from dynmo_hpc.errors import ConfigError


class TokenSequence(Protocol):
    """A split: its length and contiguous slices (a numpy array, or sharded windows)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice, /) -> np.ndarray: ...


def _prepared_dir(data: DataSection, out_dir: str | None) -> Path | None:
    """The prepared directory ``data`` trains from, or None for byte text and ``.bin`` files."""
    if data.tokenizer is not None:
        directory = cache_dir_for(data, out_dir)
        if not (directory / META_FILE).is_file():
            raise ConfigError(
                f"data.tokenizer: the prepared data {directory} is not there yet; HINT: start the "
                "job with dynmo-hpc run or sbatch (they prepare it before the ranks start)"
            )
        return directory
    if data.path is not None and is_prepared_dir(data.path):
        return Path(data.path)
    return None


def tokenizer_file(data: DataSection, out_dir: str | None) -> Path | None:
    """The ``tokenizer.json`` the data's ids came from: a prepared directory's (given, or the
    ``data.tokenizer`` cache's); None for byte-level text and ``.bin`` files, which carry none.

    Raises:
        ConfigError: the data names a prepared directory or cache that is not there.
    """
    directory = _prepared_dir(data, out_dir)
    return None if directory is None else directory / TOKENIZER_FILE


def _check_lengths(train: int, val: int, seq_len: int, unit: str, where: str) -> None:
    """Both non-empty splits hold at least one sequence (``seq_len + 2`` tokens)."""
    need = seq_len + 2
    for name, size in (("training", train), ("validation", val)):
        if (name == "training" or size) and size < need:
            raise ConfigError(
                f"{where}: the {name} split has {size} {unit} but model.seq_len={seq_len} "
                f"needs at least {need}; HINT: use more text, or a smaller model.seq_len"
            )


def open_source(
    data: DataSection, seq_len: int, out_dir: str | None
) -> tuple[TokenSequence, TokenSequence]:
    """(train, validation) splits of the data (see the module docstring).

    Raises:
        ConfigError: the data is unusable, or a split is too short for ``seq_len``.
    """
    directory = _prepared_dir(data, out_dir)
    if directory is not None:
        prepared = open_prepared(directory)
        where = f"data.path={str(directory)!r}"
        _check_lengths(len(prepared.train), len(prepared.val), seq_len, "tokens", where)
        return prepared.train, prepared.val
    if data.path is not None and is_token_file(data.path):
        tokens = open_tokens(data.path)
        num_train, _ = split_sizes(len(tokens), data.val_fraction, seq_len)
        return tokens[:num_train], tokens[num_train:]
    corpus = np.frombuffer(read_corpus(data.path), dtype=np.uint8).copy()
    num_train, _ = split_sizes(len(corpus), data.val_fraction, seq_len)
    return corpus[:num_train], corpus[num_train:]


def check_source(data: DataSection, seq_len: int, vocab_size: int, out_dir: str) -> int:
    """Preflight: prepare a ``data.tokenizer`` cache if needed, then refuse data the ranks
    could not train on (the same checks :func:`open_source` makes, plus a ``.bin`` file's ids
    against ``vocab_size``).

    Returns the validation split's length in tokens.

    Raises:
        ConfigError, DataError: the data is unusable; the message names it and the fix.
    """
    if data.tokenizer is not None:
        ensure_prepared(data, out_dir)
    _, val = open_source(data, seq_len, out_dir)
    if data.tokenizer is None and data.path is not None and is_token_file(data.path):
        check_vocab(open_tokens(data.path), vocab_size, source=f"data.path={data.path!r}")
    return len(val)
