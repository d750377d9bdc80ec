"""The run directory ``<job.out_dir>/<job.name>/``: where the ranks read their config and write.

Both launch paths (local ``mpiexec`` and the in-allocation manager) call :func:`prepare_run_dir`
before starting ranks, so the ranks always load the resolved config that was really run (every
``--set`` override applied), and that file stays beside the run log for later inspection.
"""

from __future__ import annotations

from pathlib import Path

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.config import JobConfig


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Create ``runs/<job>/``, write the resolved config the ranks will load; return its path."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    atomic_write_text(config_path, cfg.to_yaml())
    return config_path
