"""The HDF5 run log: one ``runs/<job>/run.h5`` per run, written by rank 0, readable any time.

Write with :class:`RunLogWriter`, read with :func:`load`; the layout is in :mod:`.schema` and
``docs/runlog.md``, derived numbers in :mod:`.metrics`, figures in :mod:`dynmo_hpc.report`.
"""

from __future__ import annotations

from dynmo_hpc.runlog.reader import RunLog, load
from dynmo_hpc.runlog.schema import SCHEMA_VERSION
from dynmo_hpc.runlog.writer import RunLogWriter

__all__ = ["SCHEMA_VERSION", "RunLog", "RunLogWriter", "load"]
