"""Text named with a tokenizer choice (``data.tokenizer``), prepared once into a cache directory.

Why: a job file can say "this text, a BPE of 8192 tokens trained on it" and run from a fresh
clone with no extra command. The launcher (``dynmo-hpc run``, or the SLURM manager on its node)
prepares the data before any rank starts (:func:`ensure_prepared`, from
:func:`dynmo_hpc.launch.preflight.check_data`); the ranks only open the result
(:func:`cache_dir_for`), so preparation happens once, not once per rank.

Where: ``data.cache_dir``, else ``<job.out_dir>/.data_cache``, in a subdirectory named by a key
over what determines the result: the text file (absolute path, size, modification time; for the
default text, the Python version that ships it), the tokenizer choice (a given tokenizer's
content hash) and ``data.val_fraction``. Changing any of them prepares anew; an unchanged job
reuses the directory. The key does not read the text itself, so the ranks find the directory
without reading the corpus.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from dynmo_hpc.config import DataSection
from dynmo_hpc.config.data_source import META_FILE
from dynmo_hpc.data.corpus import default_corpus_text
from dynmo_hpc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

CACHE_DIR_NAME = ".data_cache"
"""The default cache, under ``job.out_dir``."""

CACHE_FORMAT_VERSION = 1
"""Part of every key: bump it when prepare-data's output changes for the same input."""


def cache_key(data: DataSection) -> str:
    """A 16-hex-digit key over what the prepared data depends on (see the module docstring)."""
    assert data.tokenizer is not None
    if data.path is None:
        source: dict[str, object] = {"default_text": sys.version}
    else:
        stat = Path(data.path).stat()
        source = {
            "path": str(Path(data.path).resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
    tok = data.tokenizer
    tokenizer: dict[str, object] = {"train": tok.train, "vocab_size": tok.vocab_size}
    if tok.path is not None:
        tokenizer = {"sha256": hashlib.sha256(Path(tok.path).read_bytes()).hexdigest()}
    record = {
        "version": CACHE_FORMAT_VERSION,
        "source": source,
        "tokenizer": tokenizer,
        "val_fraction": data.val_fraction,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir_for(data: DataSection, out_dir: str | None) -> Path:
    """The directory ``data`` (with a ``tokenizer``) is prepared into.

    Raises:
        ConfigError: neither ``data.cache_dir`` nor an ``out_dir`` to put the cache under.
    """
    if data.cache_dir is not None:
        root = Path(data.cache_dir)
    elif out_dir is not None:
        root = Path(out_dir) / CACHE_DIR_NAME
    else:
        raise ConfigError(
            "data.tokenizer needs a cache directory; HINT: set data.cache_dir, or open the data "
            "for a job (its job.out_dir holds the cache)"
        )
    return root / cache_key(data)


def ensure_prepared(data: DataSection, out_dir: str | None) -> Path:
    """The prepared directory for ``data``, preparing it first if it is not there yet.

    Called once per launch, before the ranks start. A second launcher preparing the same key at
    the same time loses the final rename and uses the winner's directory.
    """
    from dynmo_hpc.data.prepare import TokenizerChoice, prepare

    out = cache_dir_for(data, out_dir)
    if (out / META_FILE).is_file():
        return out
    tok = data.tokenizer
    assert tok is not None
    choice = TokenizerChoice(
        path=Path(tok.path) if tok.path is not None else None,
        vocab_size=tok.vocab_size if tok.train else None,
    )
    log.info("data.tokenizer: preparing %s once into %s", data.path or "the default text", out)
    text = Path(data.path) if data.path is not None else None
    default_copy = out.parent / f".default-text-{os.getpid()}.txt"
    try:
        if text is None:
            out.parent.mkdir(parents=True, exist_ok=True)
            default_copy.write_text(default_corpus_text(), encoding="utf-8")
            text = default_copy
        prepare([text], out, choice, val_fraction=data.val_fraction, overwrite=True)
    except DataError:
        if (out / META_FILE).is_file():  # another launcher finished first
            return out
        raise
    finally:
        default_copy.unlink(missing_ok=True)
    return out
