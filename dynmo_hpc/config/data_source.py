"""What ``data.path`` names, the ``data.tokenizer`` choice, and the vocabulary the data needs.

Why in ``config``: ``model.vocab_size`` defaults to the data's vocabulary, and a model vocabulary
smaller than the data's is refused when the job file is loaded, before any rank starts. Both need
the data's vocabulary size, which this module reads without importing the data package (it sits
above ``config``): from a prepared directory's ``meta.json``, from a tokenizer file's JSON, or
from a ``data.tokenizer`` that trains one. Pure Python (json only).

``data.path`` is one of:

- a UTF-8 text file (or null: CPython's documentation text) trained on byte by byte,
  vocabulary 256, unless ``data.tokenizer`` asks for it to be tokenized first;
- a flat little-endian ``uint16`` token file ending in ``.bin`` (vocabulary unknown: the model's);
- a directory written by ``dynmo-hpc prepare-data`` (``meta.json`` names its vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynmo_hpc.errors import ConfigError

TOKEN_FILE_SUFFIX = ".bin"
"""A ``data.path`` ending in this is a flat ``uint16`` token file, not text."""

META_FILE = "meta.json"
"""The metadata file of a prepared token directory (``dynmo-hpc prepare-data``)."""

META_FORMAT = "dynmo-hpc-tokens"
"""``meta.json``'s ``format`` value: a directory not written by prepare-data is refused."""

BYTE_ALPHABET = 256
"""Byte-level BPE starts from the 256 byte values: no smaller vocabulary can encode any text."""

MAX_VOCAB = 1 << 32
"""Token ids are stored as ``uint32`` at most."""


@dataclass(frozen=True, kw_only=True)
class TokenizerSection:
    train: bool = False
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens on the text of ``data.path``."""
    vocab_size: int = 8192
    """Vocabulary of the trained tokenizer (with ``train: true``); at least 256 (the bytes)."""
    path: str | None = None
    """An existing Hugging Face ``tokenizer.json`` to tokenize with (instead of training one)."""

    def validate(self) -> None:
        if self.train == (self.path is not None):
            raise ConfigError(
                f"data.tokenizer has train={self.train} and path={self.path!r}; HINT: give "
                "exactly one: train: true (with vocab_size) or path: tokenizer.json"
            )
        if self.train and not BYTE_ALPHABET <= self.vocab_size < MAX_VOCAB:
            raise ConfigError(
                f"data.tokenizer.vocab_size={self.vocab_size} is outside [{BYTE_ALPHABET}, "
                f"{MAX_VOCAB}); HINT: byte-level BPE needs the 256 byte values; try 8192"
            )
        if self.path is not None and not Path(self.path).is_file():
            raise ConfigError(
                f"data.tokenizer.path={self.path!r} is not a file; HINT: give a Hugging Face "
                "tokenizer.json, or train: true"
            )


def is_prepared_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory (prepared by ``dynmo-hpc prepare-data``, or meant to be)."""
    return Path(path).is_dir()


def read_meta(directory: str | Path, *, what: str = "data.path") -> dict[str, Any]:
    """A prepared directory's ``meta.json``, checked for its format.

    Raises:
        ConfigError: there is no ``meta.json``, it is not JSON, or not prepare-data's format.
    """
    where = f"{what}={str(directory)!r}"
    meta_path = Path(directory) / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{where} is a directory without {META_FILE}; HINT: give a directory written by "
            "dynmo-hpc prepare-data, or a text or .bin file"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {META_FILE} cannot be read ({exc}); HINT: prepare the data again with "
            "dynmo-hpc prepare-data --overwrite"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise ConfigError(
            f"{where}: {META_FILE} is not a dynmo-hpc token directory's (format "
            f"{META_FORMAT!r}); HINT: prepare it with dynmo-hpc prepare-data"
        )
    return meta


def tokenizer_file_vocab_size(path: str | Path) -> int:
    """The vocabulary of a Hugging Face ``tokenizer.json``: its largest id + 1 (model vocabulary
    and added tokens), read as JSON without loading the tokenizer.

    Raises:
        ConfigError: the file is not a tokenizer.json with a ``model.vocab``.
    """
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        vocab = spec["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in spec.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"tokenizer {str(path)!r} is not a Hugging Face tokenizer.json with a model "
            f"vocabulary ({type(exc).__name__}: {exc}); HINT: give the tokenizer.json a model "
            "ships, or train one"
        ) from None


def data_vocab_size(path: str | None, tokenizer: TokenizerSection | None) -> int | None:
    """The vocabulary the data needs, or None where only the model says (a flat ``.bin``).

    Byte-level text: 256. A prepared directory: its ``meta.json``. Text with ``data.tokenizer``:
    the trained vocabulary asked for, or the tokenizer file's.
    """
    if tokenizer is not None:
        if tokenizer.train:
            return tokenizer.vocab_size
        assert tokenizer.path is not None
        return tokenizer_file_vocab_size(tokenizer.path)
    if path is None:
        return BYTE_ALPHABET
    if is_prepared_dir(path):
        return int(read_meta(path)["vocab_size"])
    if str(path).endswith(TOKEN_FILE_SUFFIX):
        return None
    return BYTE_ALPHABET


def resolve_vocab_size(model_vocab_size: int, explicit: bool, data_vocab: int | None) -> int:
    """``model.vocab_size``: the data's unless the job set it; never smaller than the data's.

    Raises:
        ConfigError: the job's ``model.vocab_size`` is smaller than the data's (names both).
    """
    if data_vocab is None:
        return model_vocab_size
    if not explicit:
        return data_vocab
    if model_vocab_size < data_vocab:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the data's vocabulary "
            f"({data_vocab} tokens); HINT: drop model.vocab_size to use the data's, or set it "
            f"to at least {data_vocab}"
        )
    return model_vocab_size
