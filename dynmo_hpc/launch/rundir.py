"""The run directory ``<job.out_dir>/<job.name>/``: where the ranks read their config and write.

Both launch paths (local ``mpiexec`` and the in-allocation manager) call :func:`prepare_run_dir`
before starting ranks, so the ranks always load the resolved config that was really run (every
``--set`` override applied), and that file stays beside the run log for later inspection.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.config import JobConfig
from dynmo_hpc.errors import LaunchError

RUN_OUTPUTS = ("run.h5", "result.json", "checkpoint", "report")
"""What a run leaves in its directory (``config.yaml`` is rewritten by every launch)."""


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


def claim_run_dir(run_dir: Path, *, overwrite: bool) -> None:
    """Make ``run_dir`` ready for a new run: refuse one that holds a run, or clear it.

    Why: two runs writing one directory would interleave their run logs and checkpoints, and a
    silently replaced run log is lost work. ``overwrite=True`` removes the earlier outputs.

    Raises:
        LaunchError: the directory holds a run and ``overwrite`` is False.
    """
    found = run_outputs(run_dir)
    if not found:
        return
    if not overwrite:
        raise LaunchError(
            f"{run_dir} already holds a run ({', '.join(found)}); HINT: add --resume to continue "
            "it from its newest checkpoint, --overwrite to replace it, or choose another "
            "job.name (--set job.name=...)"
        )
    for name in found:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
