"""A rank that ran out of memory says so, for the manager's fallback after a pack.

A packed step puts more layers on each stage than the step before it; if one of them no longer
fits, the same configuration fails the same way on every restart. The rank that hits the error
(Python's ``MemoryError``, torch's ``OutOfMemoryError`` on a GPU) writes ``out_of_memory.json``
before the exception ends the step; the manager (:func:`~dynmo_hpc.launch.supervisor.supervise`)
takes it after the failed step and falls back to the pre-pack partition, or stops with an error
that says why. A rank killed by the kernel's OOM killer (SIGKILL) cannot write it: that failure
is an ordinary restart.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text

OUT_OF_MEMORY = "out_of_memory.json"
"""Written by a rank that ran out of memory; taken (removed) by the manager."""
OOM_ERROR_NAMES = frozenset({"MemoryError", "OutOfMemoryError"})
"""Exception class names that mean "out of memory" (torch's is matched by name, so that this
module needs no torch)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or a class it derives from) is an out-of-memory error."""
    return any(cls.__name__ in OOM_ERROR_NAMES for cls in type(exc).__mro__)


def record_out_of_memory(run_dir: Path, rank: int, exc: BaseException) -> None:
    """A rank: say that it ran out of memory (best effort: the step is ending anyway)."""
    detail = {"rank": rank, "type": type(exc).__name__, "message": str(exc)[:500]}
    with contextlib.suppress(OSError):
        atomic_write_text(run_dir / OUT_OF_MEMORY, json.dumps(detail))


def take_out_of_memory(run_dir: Path) -> dict[str, Any] | None:
    """The manager: the record of a rank that ran out of memory (removed once read), or None."""
    path = run_dir / OUT_OF_MEMORY
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return data if isinstance(data, dict) else None
