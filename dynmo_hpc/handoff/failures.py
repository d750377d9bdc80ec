"""Failures of earlier MPI steps, waiting for the next step's rank 0 to put them in the run log.

The supervisor (:mod:`dynmo_hpc.launch.supervisor`) appends a record after each failed step;
rank 0 of the step that follows takes them all (the file is removed), so each is logged once.
A record may name another event kind under :data:`EVENT_KEY` (e.g. ``shrink_refused``): things
the process outside the step saw between steps, which only a rank can write to the run log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text

FAILURE_PENDING = "failure_pending.json"
"""Failures the next step's rank 0 logs to the run log (removed once logged)."""
EVENT_KEY = "event"
"""A record's run-log event kind when it is not ``failure`` (removed from the logged detail)."""


def take_pending_failures(run_dir: Path) -> list[dict[str, Any]]:
    """The new step's rank 0: failures not yet in the run log (the file is removed)."""
    path = run_dir / FAILURE_PENDING
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    path.unlink(missing_ok=True)
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def add_pending_failure(run_dir: Path, record: dict[str, Any]) -> None:
    """The supervisor: queue ``record`` for the next step's run log."""
    path = run_dir / FAILURE_PENDING
    try:
        records = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:
        records = []
    atomic_write_text(path, json.dumps([*records, record], indent=1))


def add_pending_event(run_dir: Path, kind: str, detail: dict[str, Any]) -> None:
    """The launcher: queue a ``kind`` event (not a failure) for the next step's run log."""
    add_pending_failure(run_dir, {**detail, EVENT_KEY: kind})


def event_kind(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A taken record's run-log event kind and its detail (without :data:`EVENT_KEY`)."""
    detail = dict(record)
    kind = detail.pop(EVENT_KEY, "failure")
    return (kind if isinstance(kind, str) and kind else "failure"), detail
