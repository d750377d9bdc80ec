"""A cheap look at an HDF5 file's superblock before the HDF5 library is let near it.

Why: a run log is opened with SWMR semantics (its writer may be live or killed), and an SWMR
reader skips HDF5's own "file is truncated" test and retries a metadata block that fails its
checksum, with growing sleeps, for a long time, holding the GIL (a truncated or bit-flipped
``run.h5`` made ``dynmo-hpc report`` hang, deaf to Ctrl-C). Reading the superblock here costs
one small read and catches, in microseconds: a file that is not HDF5 at all, a superblock that
fails its checksum, and a file shorter than the end-of-file address the superblock records
(truncation, the most common damage). Whatever damage lies deeper is left to the isolated
reader (:func:`dynmo_hpc.runlog.load` reads in a child process) and its timeout.

The layout follows the HDF5 file format specification, "Superblock" (versions 0-3). Run logs
are written with the 1.10 format (superblock version 3), whose superblock carries a Jenkins
lookup3 checksum; versions 0 and 1 (other tools' files) have none but still record the
end-of-file address.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dynmo_hpc.errors import RunLogError

SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The eight bytes every HDF5 superblock starts with."""
FIRST_USER_BLOCK_BYTES = 512
"""The superblock sits at byte 0 or, after a user block, at 512, 1024, 2048, ..."""
SWMR_WRITE_FLAGS = 0x01 | 0x04
"""File consistency flags (version 3) a writer sets while the file is open: write access, SWMR
write access. Left set in a file whose writer was killed."""

_MASK32 = 0xFFFFFFFF
_DAMAGED_HINT = (
    "HINT: the file is damaged (truncated or overwritten); restore it from a backup, or if its "
    "run is still writing it, try again in a moment"
)


@dataclass(frozen=True)
class Superblock:
    """What the precheck learned from a file's superblock."""

    offset_bytes: int
    """Where the superblock starts (0 unless the file has a user block)."""
    version: int
    flags: int
    """File consistency flags; nonzero for a file open for writing or left by a killed writer."""
    eof_bytes: int
    """The end of file the superblock records: the file's size in bytes when it is intact."""

    @property
    def open_for_write(self) -> bool:
        """True when a writer holds the file now, or held it when it was killed."""
        return self.version >= 3 and bool(self.flags & SWMR_WRITE_FLAGS)


def _rot(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK32


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    for rot_a, rot_b, rot_c in ((4, 6, 8), (16, 19, 4)):
        a = ((a - c) & _MASK32) ^ _rot(c, rot_a)
        c = (c + b) & _MASK32
        b = ((b - a) & _MASK32) ^ _rot(a, rot_b)
        a = (a + c) & _MASK32
        c = ((c - b) & _MASK32) ^ _rot(b, rot_c)
        b = (b + a) & _MASK32
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c = ((c ^ b) - _rot(b, 14)) & _MASK32
    a = ((a ^ c) - _rot(c, 11)) & _MASK32
    b = ((b ^ a) - _rot(a, 25)) & _MASK32
    c = ((c ^ b) - _rot(b, 16)) & _MASK32
    a = ((a ^ c) - _rot(c, 4)) & _MASK32
    b = ((b ^ a) - _rot(a, 14)) & _MASK32
    return ((c ^ b) - _rot(b, 24)) & _MASK32


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle`` of ``data``: the checksum HDF5 puts on metadata."""
    a = b = c = (0xDEADBEEF + len(data) + initval) & _MASK32
    if not data:
        return c
    rest = len(data)
    pos = 0
    while rest > 12:
        x, y, z = struct.unpack_from("<3I", data, pos)
        a, b, c = _mix((a + x) & _MASK32, (b + y) & _MASK32, (c + z) & _MASK32)
        pos += 12
        rest -= 12
    tail = data[pos:] + bytes(12 - rest)
    x, y, z = struct.unpack("<3I", tail)
    return _final((a + x) & _MASK32, (b + y) & _MASK32, (c + z) & _MASK32)


def _address(raw: bytes, start: int, size: int) -> int | None:
    """A little-endian file address of ``size`` bytes, or None for the undefined address."""
    value = int.from_bytes(raw[start : start + size], "little")
    return None if value == (1 << (8 * size)) - 1 else value


def _find_signature(f: BinaryIO, file_bytes: int) -> int | None:
    """Offset of the superblock signature (0, 512, 1024, ...), or None."""
    offset = 0
    while offset + len(SIGNATURE) <= file_bytes:
        f.seek(offset)
        if f.read(len(SIGNATURE)) == SIGNATURE:
            return offset
        offset = FIRST_USER_BLOCK_BYTES if offset == 0 else offset * 2
    return None


def check(path: Path) -> Superblock:
    """The superblock of ``path``, if it is plausibly an intact HDF5 file.

    Raises:
        RunLogError: not an HDF5 file, a damaged superblock, or a truncated file.
    """
    file_bytes = os.path.getsize(path)
    with open(path, "rb") as f:
        offset = _find_signature(f, file_bytes)
        if offset is None:
            raise RunLogError(
                f"{path} is not an HDF5 file ({file_bytes} bytes, no HDF5 signature), so not a "
                "dynmo_hpc run log; HINT: pass the run.h5 a run wrote (runs/<job>/run.h5)"
            )
        f.seek(offset)
        raw = f.read(256)
    return _parse(path, raw, offset, file_bytes)


def _parse(path: Path, raw: bytes, offset: int, file_bytes: int) -> Superblock:
    if len(raw) < 16:
        raise RunLogError(f"{path}: the HDF5 superblock is cut off; {_DAMAGED_HINT}")
    version = raw[8]
    if version in (2, 3):
        size_o = raw[9]
        layout = 12 + 4 * size_o  # base, extension, end of file, root group addresses
        if size_o not in (2, 4, 8, 16) or len(raw) < layout + 4:
            raise RunLogError(f"{path}: the HDF5 superblock is cut off or damaged; {_DAMAGED_HINT}")
        (stored,) = struct.unpack_from("<I", raw, layout)
        if lookup3(raw[:layout]) != stored:
            raise RunLogError(
                f"{path}: the HDF5 superblock fails its checksum (corrupt bytes at the start of "
                f"the file); {_DAMAGED_HINT}"
            )
        flags = raw[11]
        eof = _address(raw, 12 + 2 * size_o, size_o)
    elif version in (0, 1):
        size_o = raw[13]
        start = 24 + (4 if version == 1 else 0)  # base address; v1 adds indexed-storage K
        if size_o not in (2, 4, 8, 16) or len(raw) < start + 4 * size_o:
            raise RunLogError(f"{path}: the HDF5 superblock is cut off or damaged; {_DAMAGED_HINT}")
        flags = int.from_bytes(raw[20:24], "little")
        eof = _address(raw, start + 2 * size_o, size_o)
    else:
        raise RunLogError(
            f"{path}: HDF5 superblock version {version} is unknown (damaged, or written by a "
            "newer HDF5 than this reader knows); HINT: pass the run.h5 a run wrote, undamaged"
        )
    if eof is None:
        raise RunLogError(f"{path}: the HDF5 superblock records no end of file; {_DAMAGED_HINT}")
    # HDF5 compares this address with the whole file's size, user block included (as tried on
    # files with a 1 KiB user block), so it is taken as an absolute offset here too.
    eof_bytes = eof
    if eof_bytes > file_bytes:
        raise RunLogError(
            f"{path} is truncated: {file_bytes} bytes, its HDF5 superblock says {eof_bytes}; "
            f"{_DAMAGED_HINT}"
        )
    return Superblock(offset_bytes=offset, version=version, flags=flags, eof_bytes=eof_bytes)
