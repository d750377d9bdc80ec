"""The run directory ``<job.out_dir>/<job.name>/``: where the ranks read their config and write.

Both launch paths (local ``mpiexec`` and the in-allocation manager) call :func:`prepare_run_dir`
before starting ranks, so the ranks always load the resolved config that was really run (every
``--set`` override applied), and that file stays beside the run log for later inspection.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.config import JobConfig
from dynmo_hpc.errors import LaunchError

log = logging.getLogger(__name__)

RUN_OUTPUTS = ("run.h5", "result.json", "checkpoint", "report")
"""What a run leaves in its directory and ``--overwrite`` removes (``config.yaml`` is rewritten
by every launch; SLURM logs, ``job.sbatch`` and ``submitit/`` are kept)."""

OUTPUT_WHAT = {
    "run.h5": "run log",
    "result.json": "result",
    "checkpoint": "checkpoints",
    "report": "report",
}
"""What each of :data:`RUN_OUTPUTS` is, in the words ``--overwrite`` prints."""


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Create ``runs/<job>/``, write the resolved config the ranks will load; return its path."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    atomic_write_text(config_path, cfg.to_yaml())
    return config_path


def run_outputs(run_dir: Path) -> list[str]:
    """The names of an earlier run's outputs present in ``run_dir``."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def describe_outputs(run_dir: Path, found: list[str]) -> str:
    """``run.h5 (run log), checkpoint/ (checkpoints: step_2, step_4), ...``: what
    ``--overwrite`` is about to remove, each path with what it is (checkpoints by step)."""
    shown = []
    for name in found:
        path = run_dir / name
        what = OUTPUT_WHAT.get(name, "output")
        if name == "checkpoint" and path.is_dir():
            steps = sorted(
                (p.name for p in path.iterdir() if p.name.startswith("step_")),
                key=lambda n: (len(n), n),
            )
            what += f": {', '.join(steps)}" if steps else ": none complete"
        shown.append(f"{path}{'/' if path.is_dir() else ''} ({what})")
    return ", ".join(shown)


LOCK_FILE = ".lock"
"""Held (``flock``) by the process that runs the job: the CLI locally, the manager on SLURM."""


def _lock_holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["unix_s"])))
        return f"pid {info['pid']} on {info['host']}, since {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _busy(run_dir: Path) -> str:
    return (
        f"{run_dir} is in use by a running job ({_lock_holder(run_dir / LOCK_FILE)}); "
        "HINT: wait for it to end, stop it, or run this one under another job.name "
        "(--set job.name=...)"
    )


@contextlib.contextmanager
def lock_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold the run directory for one job; a second job on it fails at once, naming the first.

    Why: two jobs with the same ``job.name`` would interleave their run logs and checkpoints.
    The lock is an ``flock`` on ``<run dir>/.lock``: the kernel drops it when the holder dies,
    however it dies, so a crashed run never leaves a stale lock behind.

    Raises:
        LaunchError: another process holds the lock.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_path = run_dir / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(_busy(run_dir)) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "unix_s": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        os.close(fd)


def is_locked(run_dir: Path) -> bool:
    """True while a job holds ``run_dir`` (a probe: the lock is released at once)."""
    lock_path = run_dir / LOCK_FILE
    if not lock_path.is_file():
        return False
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def refuse_if_locked(run_dir: Path) -> None:
    """Raise :class:`LaunchError` naming the holder while a running job holds ``run_dir``
    (a resume submitted while the run it continues is still running would share its files)."""
    if is_locked(run_dir):
        raise LaunchError(_busy(run_dir))


def claim_run_dir(run_dir: Path, *, overwrite: bool, locked_by_us: bool = False) -> None:
    """Make ``run_dir`` ready for a new run: refuse one that holds a run, or clear it.

    Why: two runs writing one directory would interleave their run logs and checkpoints, and a
    silently replaced run log is lost work. ``overwrite=True`` removes the earlier outputs
    (:data:`RUN_OUTPUTS`: run log, result, checkpoints, report), naming each in a warning first.
    Checkpoints go too: kept, a later ``--resume`` or crash restart of the new run could pick
    the old run's newer step and mix the two runs' weights.

    Raises:
        LaunchError: the directory holds a run and ``overwrite`` is False, or a running job
            holds it (unless ``locked_by_us``: the caller holds :func:`lock_run_dir`).
    """
    if not locked_by_us:
        refuse_if_locked(run_dir)
    found = run_outputs(run_dir)
    if not found:
        return
    if not overwrite:
        raise LaunchError(
            f"{run_dir} already holds a run ({', '.join(found)}); HINT: add --resume to continue "
            "it from its newest checkpoint, --overwrite to replace it, or choose another "
            "job.name (--set job.name=...)"
        )
    log.warning("--overwrite: removing %s", describe_outputs(run_dir, found))
    for name in found:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
