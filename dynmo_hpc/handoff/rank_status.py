"""Each rank's last known whereabouts, readable after it dies: ``<run dir>/ranks/rank_<r>.json``.

A rank killed by SIGKILL cannot say where it was, so every rank keeps one small file up to date
as it moves between phases (step, load report, migration, checkpoint). The file is opened once
and rewritten in place with one ``pwrite`` of a fixed-size record: no rename, no fsync, no new
inode per update, so it costs microseconds and no metadata traffic on a shared file system. The
process outside the MPI step (:mod:`dynmo_hpc.launch.supervisor`) reads the files after a failed
step to tell which step and phase each rank had reached, and the tests use them to find a
rank's PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

STATUS_DIR = "ranks"
RECORD_BYTES = 512
"""Every record is padded to this size, so an in-place rewrite always covers the last one."""


def status_dir(run_dir: Path) -> Path:
    return run_dir / STATUS_DIR


def clear(run_dir: Path) -> None:
    """Forget the previous step's ranks (the launcher calls it before starting a step)."""
    shutil.rmtree(status_dir(run_dir), ignore_errors=True)


class RankStatus:
    """One rank's status file; :meth:`update` records the phase it is entering."""

    def __init__(self, run_dir: Path, rank: int, attempt: int) -> None:
        directory = status_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank_{rank}.json", os.O_WRONLY | os.O_CREAT, 0o644)
        self._base = {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "attempt": attempt,
        }

    def update(self, phase: str, step: int) -> None:
        record = json.dumps({**self._base, "phase": phase, "step": step, "unix_s": time.time()})
        data = record.encode()[: RECORD_BYTES - 1].ljust(RECORD_BYTES - 1) + b"\n"
        os.pwrite(self._fd, data, 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def read_all(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last record, by rank; unreadable or half-written files are left out."""
    found: dict[int, dict[str, Any]] = {}
    directory = status_dir(run_dir)
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("rank_*.json")):
        try:
            record = json.loads(path.read_bytes().strip() or b"null")
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            found[record["rank"]] = record
    return found
