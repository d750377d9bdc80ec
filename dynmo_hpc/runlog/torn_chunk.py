"""Read a run-log dataset whose last chunk a killed writer was rewriting, proving its rows intact.

Why this exists: every flush rewrites a table's partly filled last chunk, and HDF5 rewrites a
filtered chunk where it lies when its size does not change (Fletcher-32 adds 4 bytes, always).
Linux ends a file write at a page boundary when SIGKILL arrives, so a writer killed during that
write leaves the chunk half new and half old. Its stored Fletcher-32 checksum (the last 4 bytes,
written last) is then the old one, the chunk fails it, and HDF5 refuses the whole dataset,
although every row the file's metadata counts is intact: the metadata still holds the previous
flush's row count, and a flush rewrites those rows with the bytes they already had.

The proof used here instead of trusting the bytes: the stored checksum is that of the chunk as
its last complete write left it, which is some ``k`` rows followed by the fill value (zeros),
with ``k`` at least the rows counted. If for some such ``k`` the checksum of "first ``k`` rows
of the torn chunk, then zeros" equals the stored one, the counted rows are exactly those the
checksum covered. Anything else (a flipped bit among the counted rows, a damaged checksum) still
fails, as HDF5 would have failed it.

Only a file its writer never closed can hold a torn chunk (closing completes every write), and
the readers open exactly those files with SWMR; in a file opened without it, a chunk that fails
its checksum is damage, whatever its bytes.
"""

from __future__ import annotations

import logging

import h5py
import numpy as np

log = logging.getLogger(__name__)

FLETCHER32_BYTES = 4
_MOD = 0xFFFF  # Fletcher-32 sums are kept modulo 65535 (ones' complement)


def is_checksum_failure(exc: BaseException) -> bool:
    """True for HDF5's error when a chunk fails its filter (here: only Fletcher-32 can)."""
    return isinstance(exc, OSError) and "filter returned failure" in str(exc)


def read_rows(ds: h5py.Dataset) -> np.ndarray:
    """Every row of the 1-D chunked dataset ``ds``; in a file opened with SWMR (its writer never
    closed it), a torn chunk whose rows are proven intact is read from its raw bytes instead of
    failing the whole read.

    Raises:
        OSError: a chunk fails its checksum and is not a torn rewrite (real damage), or HDF5
            cannot read the dataset for another reason.
    """
    try:
        return np.asarray(ds[()])
    except OSError as exc:
        if not (is_checksum_failure(exc) and ds.file.swmr_mode and _recoverable_layout(ds)):
            raise
    assert ds.chunks is not None  # checked by _recoverable_layout
    num_rows, chunk_rows = ds.shape[0], ds.chunks[0]
    pieces = []
    for start in range(0, num_rows, chunk_rows):
        stop = min(start + chunk_rows, num_rows)
        try:
            pieces.append(ds[start:stop])
        except OSError as exc:
            if not is_checksum_failure(exc):
                raise
            pieces.append(_proven_rows(ds, start, stop - start))
    return np.concatenate(pieces)


def _recoverable_layout(ds: h5py.Dataset) -> bool:
    """A 1-D chunked dataset whose only filter is Fletcher-32 (what the run log writes)."""
    return (
        ds.ndim == 1
        and ds.chunks is not None
        and ds.fletcher32
        and ds.compression is None
        and not ds.shuffle
        and not ds.scaleoffset
    )


def _proven_rows(ds: h5py.Dataset, start: int, num_rows: int) -> np.ndarray:
    """The first ``num_rows`` rows of the chunk at ``start``, if its checksum proves them."""
    filter_mask, raw = ds.id.read_direct_chunk((start,))
    file_dtype = ds.id.get_type().dtype  # the bytes' layout on disk
    assert ds.chunks is not None
    data_bytes = ds.chunks[0] * file_dtype.itemsize
    if filter_mask != 0 or len(raw) != data_bytes + FLETCHER32_BYTES:
        raise OSError(f"chunk at row {start} of {ds.name}: filter returned failure (bad layout)")
    data = np.frombuffer(raw, dtype=np.uint8, count=data_bytes)
    stored = int.from_bytes(raw[data_bytes:], "little")
    counts = np.arange(num_rows, ds.chunks[0] + 1)
    if not _any_prefix_matches(data, counts * file_dtype.itemsize, stored):
        raise OSError(
            f"chunk at row {start} of {ds.name}: filter returned failure (Fletcher-32 checksum "
            "mismatch, and not a torn rewrite of its last rows)"
        )
    log.warning(
        "%s %s: rows %d-%d lie in a chunk a killed writer was rewriting; its checksum proves "
        "them intact (later rows in it were never committed)",
        ds.file.filename,
        ds.name,
        start,
        start + num_rows - 1,
    )
    rows = np.frombuffer(data[: num_rows * file_dtype.itemsize].tobytes(), dtype=file_dtype)
    return rows.astype(ds.dtype)


def _any_prefix_matches(data: np.ndarray, prefix_bytes: np.ndarray, stored: int) -> bool:
    """Whether Fletcher-32 of ``data[:b]`` followed by zeros equals ``stored`` for some ``b``.

    HDF5's Fletcher-32 reads big-endian 16-bit words ``w_i`` (an odd last byte is the high byte
    of a word), ``sum1 = sum w_i`` and ``sum2 = sum w_i * (N - i)`` modulo 65535 over the
    ``N`` words, stored as ``sum2 << 16 | sum1``. Zeros after the prefix add nothing to either
    sum, so prefix sums give every candidate at once.
    """
    padded = np.zeros(len(data) + len(data) % 2, dtype=np.uint8)
    padded[: len(data)] = data
    words = padded.reshape(-1, 2).astype(np.int64)
    words = words[:, 0] * 256 + words[:, 1]
    num_words = len(words)
    weights = num_words - np.arange(num_words, dtype=np.int64)
    sum1 = np.concatenate(([0], np.cumsum(words)))
    sum2 = np.concatenate(([0], np.cumsum(words * weights)))
    full_words = prefix_bytes // 2
    cand1 = sum1[full_words]
    cand2 = sum2[full_words]
    odd = prefix_bytes % 2 == 1
    if odd.any():
        idx = full_words[odd]
        high = padded[2 * idx].astype(np.int64) * 256  # the prefix's last byte, low byte zeroed
        cand1[odd] += high
        cand2[odd] += high * weights[idx]
    want1, want2 = (stored & 0xFFFF) % _MOD, (stored >> 16) % _MOD
    return bool(np.any((cand1 % _MOD == want1) & (cand2 % _MOD == want2)))
