"""Atomic file writes: a crash never leaves a half-written file under its real name.

Each write goes to a temporary file in the same directory, is fsynced, then renamed over the
target (``os.replace`` is atomic on POSIX file systems), and the directory is fsynced after the
rename, so the new entry itself survives a power loss: without it a file system may persist the
data yet lose the name, and a checkpoint manifest written this way could point at nothing once
the older checkpoints are pruned. Used for configs, results and checkpoints. Kept free of torch
so the CLI can use it without importing torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make ``directory``'s entries (renames, creations, removals) durable.

    A no-op where a directory cannot be opened for fsync (some platforms and file systems
    refuse): there the rename's own ordering is all there is.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (creating the parent directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
