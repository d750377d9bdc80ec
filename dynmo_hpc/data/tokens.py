"""Token files: a flat little-endian ``uint16`` array on disk (nanoGPT's ``.bin``), memory-mapped.

Why memory-mapped: a tokenized corpus is often larger than a rank's share of memory, and a rank
reads only the windows it trains on or scores; ``numpy.memmap`` pages in just those. Why a flat
file: it is the format nanoGPT and many data pipelines already write, with no header to parse,
so a user's existing ``train.bin`` trains as it is.

Invariant: :func:`open_tokens` never copies the file; every check reads only what it must (the
size, and the maximum id once, in chunks, when a vocabulary is given).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynmo_hpc.config.data_source import TOKEN_FILE_SUFFIX
from dynmo_hpc.errors import ConfigError

_MAX_ID_CHUNK_TOKENS = 1 << 24
"""Tokens scanned at a time when checking ids against the vocabulary (32 MiB of ``uint16``)."""


def is_token_file(path: str | Path) -> bool:
    """Whether ``path`` names a flat token file (by its suffix)."""
    return str(path).endswith(TOKEN_FILE_SUFFIX)


def open_tokens(path: str | Path, *, what: str = "data.path") -> np.ndarray:
    """The tokens of a flat little-endian ``uint16`` file, memory-mapped read-only.

    Raises:
        ConfigError: the file is missing, unreadable, empty, or has an odd number of bytes
            (not ``uint16``); the message names ``what`` and the file.
    """
    p = Path(path)
    where = f"{what}={str(path)!r}"
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist; HINT: give a token file or a text file"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read ({exc.strerror})") from None
    if p.is_dir():
        raise ConfigError(f"{where} is a directory; HINT: give a flat uint16 .bin token file")
    if size == 0:
        raise ConfigError(f"{where} is empty; HINT: tokenize some text into it first")
    if size % 2:
        raise ConfigError(
            f"{where} has {size} bytes, not a whole number of uint16 tokens; HINT: a .bin token "
            "file is a flat little-endian uint16 array"
        )
    try:
        return np.memmap(p, dtype="<u2", mode="r")
    except OSError as exc:
        raise ConfigError(f"{where} cannot be mapped ({exc.strerror})") from None


def max_token_id(tokens: np.ndarray) -> int:
    """The largest id in ``tokens``, scanned in chunks so a mapped file is never loaded whole."""
    largest = 0
    for start in range(0, len(tokens), _MAX_ID_CHUNK_TOKENS):
        largest = max(largest, int(tokens[start : start + _MAX_ID_CHUNK_TOKENS].max()))
    return largest


def check_vocab(tokens: np.ndarray, vocab_size: int, *, source: str) -> None:
    """Refuse token ids the model cannot embed.

    Raises:
        ConfigError: an id is at or above ``vocab_size``; the message names ``source`` (the file)
            and the largest id.
    """
    largest = max_token_id(tokens)
    if largest >= vocab_size:
        raise ConfigError(
            f"{source} holds token id {largest}, but the model's vocabulary has {vocab_size} "
            f"ids (0..{vocab_size - 1}); HINT: set model.vocab_size to at least {largest + 1}, "
            "or tokenize with the model's own tokenizer"
        )
