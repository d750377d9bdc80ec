"""Token shards on disk: written in bounded memory by prepare-data, read memory-mapped by ranks.

A prepared directory holds::

    meta.json          format, vocab_size, dtype, tokenizer sha256, token counts, shard lists
    tokenizer.json     the Hugging Face tokenizer the ids came from
    train_0000.bin ... flat little-endian token ids (uint16 when the vocabulary fits, else uint32)
    val_0000.bin ...   the held-out validation split, the same way

Why shards: a single file of a large corpus is awkward to copy and to write atomically in one go;
shards of a bounded size are written one after another while the corpus streams past. Why flat
arrays: ``numpy.memmap`` maps them without a header to parse, and a rank pages in only the
windows it reads. :class:`TokenWindows` presents a split's shards as one sequence, so a window
may span two shards and sampling is the same rule as for a single array (:mod:`.batches`).

Invariant: the readers never copy a shard; they check each shard's size against ``meta.json``
(so a truncated copy is refused before training), not its contents.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_hpc.config.data_source import META_FILE, META_FORMAT, read_meta
from dynmo_hpc.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer a prepared directory's ids came from."""

UINT16_VOCAB = 1 << 16
"""Vocabularies up to this many ids are stored as ``uint16``, larger ones as ``uint32``."""

SPLITS = ("train", "val")
"""The splits of a prepared directory, in ``meta.json``'s ``shards`` mapping."""


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest little-endian unsigned dtype holding ids ``0..vocab_size-1``."""
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB else np.dtype("<u4")


class ShardWriter:
    """Appends token ids to ``<prefix>_<n>.bin`` files of at most ``shard_tokens`` ids each."""

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype[Any], shard_tokens: int):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
        self.directory = directory
        self.prefix = prefix
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        """``{"file": name, "num_tokens": n}`` per shard written so far (the last one open)."""
        self._handle: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(int(s["num_tokens"]) for s in self.shards)

    def write(self, ids: np.ndarray) -> None:
        """Append ``ids`` (any integer dtype, values already checked to fit)."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        while len(ids):
            if self._handle is None or self.shards[-1]["num_tokens"] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - int(self.shards[-1]["num_tokens"])
            head, ids = ids[:room], ids[room:]
            self._handle.write(head.tobytes())
            self.shards[-1]["num_tokens"] += len(head)

    def _open_next(self) -> None:
        if self._handle is not None:
            self._handle.close()
        name = f"{self.prefix}_{len(self.shards):04d}.bin"
        self._handle = open(self.directory / name, "wb")  # noqa: SIM115 - closed by close()
        self.shards.append({"file": name, "num_tokens": 0})

    def close(self) -> list[dict[str, Any]]:
        """Flush and close the open shard; returns the shard list."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        return self.shards


class TokenWindows:
    """A split's shards as one read-only sequence: ``len()`` and ``[start:stop]`` slices.

    A slice copies only the ids it names (from one shard, or two when it spans a boundary).
    """

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.starts = [0]
        for a in self.arrays:
            self.starts.append(self.starts[-1] + len(a))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("TokenWindows supports contiguous [start:stop] slices only")
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return np.empty(0, dtype=self.arrays[0].dtype if self.arrays else np.uint16)
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            offset = start - self.starts[i]
            take = min(stop - start, len(self.arrays[i]) - offset)
            pieces.append(self.arrays[i][offset : offset + take])
            start += take
            i += 1
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)


@dataclass(frozen=True)
class PreparedTokens:
    """A prepared directory opened for reading: both splits mapped, and its metadata."""

    train: TokenWindows
    val: TokenWindows
    vocab_size: int
    meta: dict[str, Any]


def open_prepared(directory: str | Path, *, what: str = "data.path") -> PreparedTokens:
    """Map a prepared directory's shards read-only, after checking them against ``meta.json``.

    Raises:
        ConfigError: ``meta.json`` is missing or not prepare-data's, a shard is missing or its
            size does not match the token count ``meta.json`` records.
    """
    root = Path(directory)
    meta = read_meta(root, what=what)
    where = f"{what}={str(directory)!r}"
    dtype = np.dtype(str(meta["dtype"])).newbyteorder("<")
    splits: dict[str, TokenWindows] = {}
    for split in SPLITS:
        arrays: list[np.ndarray] = []
        for shard in meta["shards"][split]:
            path = root / str(shard["file"])
            expected = int(shard["num_tokens"]) * dtype.itemsize
            try:
                size = path.stat().st_size
            except OSError:
                raise ConfigError(
                    f"{where}: shard {shard['file']} listed in {META_FILE} is missing; HINT: "
                    "copy the whole directory, or prepare it again"
                ) from None
            if size != expected:
                raise ConfigError(
                    f"{where}: shard {shard['file']} has {size} bytes, {META_FILE} says "
                    f"{expected} ({shard['num_tokens']} x {dtype.name}); HINT: a truncated "
                    "copy? copy it again, or prepare the data again"
                )
            if expected:
                arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        splits[split] = TokenWindows(arrays)
    if len(splits["train"]) == 0:
        raise ConfigError(f"{where} has no training tokens; HINT: prepare it from more text")
    return PreparedTokens(
        train=splits["train"], val=splits["val"], vocab_size=int(meta["vocab_size"]), meta=meta
    )


def meta_record(
    *,
    vocab_size: int,
    dtype: np.dtype[Any],
    tokenizer_sha256: str,
    shards: dict[str, list[dict[str, Any]]],
    sources: list[str],
    val_fraction: float,
    num_text_bytes: int,
) -> dict[str, Any]:
    """The ``meta.json`` of a prepared directory."""
    return {
        "format": META_FORMAT,
        "version": 1,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": tokenizer_sha256,
        "num_tokens": {split: sum(int(s["num_tokens"]) for s in shards[split]) for split in SPLITS},
        "num_text_bytes": num_text_bytes,
        "val_fraction": val_fraction,
        "sources": sources,
        "shards": shards,
    }
