"""The HDF5 run log: one ``runs/<job>/run.h5`` per run, written by rank 0, readable any time.

Write with :class:`RunLogWriter`, read with :func:`load`; the layout is in :mod:`.schema` and
``docs/runlog.md``, derived numbers in :mod:`.metrics`, figures in :mod:`dynmo_hpc.runlog.report`.

``load`` and ``RunLog`` are imported on first use: they need pandas, which the writer on rank 0
does not, and every rank's start-up time counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynmo_hpc.runlog.schema import SCHEMA_VERSION
from dynmo_hpc.runlog.writer import RunLogWriter

if TYPE_CHECKING:
    from dynmo_hpc.runlog.reader import RunLog, load

__all__ = ["SCHEMA_VERSION", "RunLog", "RunLogWriter", "load"]


def __getattr__(name: str) -> Any:
    if name in ("RunLog", "load"):
        from dynmo_hpc.runlog import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
