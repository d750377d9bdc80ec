from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

from dynmo_hpc.launch.mpi_impl import SESSION_DIR_ENV
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (session fixture for the SLURM tests)

# The tests' own mpiexec calls keep their session directories in one folder of this test run,
# away from stale ones that killed mpiexecs left in /tmp (dynmo_hpc.launch.mpi_impl.
# session_dir_env); the launcher makes a fresh one per launch inside it.
_MPI_SESSIONS = tempfile.mkdtemp(prefix="dynmo-tests-mpi-")
os.environ.setdefault(SESSION_DIR_ENV, _MPI_SESSIONS)
atexit.register(shutil.rmtree, _MPI_SESSIONS, True)


def _gpu_tier_runs() -> bool:
    """The GPU tier runs where torch sees a CUDA device, or where DYNMO_GPU_TIER=1 asks for it
    (then a missing device fails the tier instead of leaving it out)."""
    if os.environ.get("DYNMO_GPU_TIER") == "1":
        return True
    import torch

    return bool(torch.cuda.is_available())


def pytest_report_header(config):  # type: ignore[no-untyped-def]
    if _gpu_tier_runs():
        return "GPU tier: runs (tests marked gpu)"
    return (
        "GPU tier: not collected, torch sees no CUDA device; on a GPU machine it runs by "
        "itself, or `make test-gpu` runs only it"
    )


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Leave the CUDA tests out of a CPU-only run (reported in the header, not as skips)."""
    if _gpu_tier_runs():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
