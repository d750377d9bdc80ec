"""A real run log opens in the HDF5 command-line tools of a Linux distribution (Debian's h5dump
1.10), not only in the h5py that wrote it: clusters, MATLAB and older h5py builds read HDF5
1.10 to 1.14, and a file in HDF5 2.0's format is unreadable there."""

from __future__ import annotations

import subprocess

import h5py
import pytest

from tests.helpers.jobs import run_job, tiny_config
from tests.helpers.system_tools import require_tool


@pytest.mark.slow
@pytest.mark.mpi
def test_distribution_h5dump_reads_a_real_run_log(tmp_path):
    h5dump = require_tool("h5dump", "hdf5-tools")
    cfg = tiny_config(tmp_path, "pipeline.num_stages=2", "job.name=h5dump")
    result = run_job(cfg)
    path = cfg.run_dir / "run.h5"

    header = subprocess.run([h5dump, "-H", str(path)], capture_output=True, text=True, timeout=60)
    assert header.returncode == 0, header.stderr
    assert "*ERROR*" not in header.stdout + header.stderr, header.stdout[-2000:]
    for name in ("steps", "stage_times", "layer_costs", "partitions", "events", "event_detail"):
        assert f'DATASET "{name}"' in header.stdout, f"h5dump does not list /{name}"

    steps = subprocess.run(
        [h5dump, "-d", "/steps", "-m", "%.17g", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert steps.returncode == 0, steps.stderr
    assert "*ERROR*" not in steps.stdout + steps.stderr
    # Every loss the run reported appears, at full precision, in h5dump's output.
    for loss in result["losses"]:
        assert f"{loss:.17g}" in steps.stdout, f"loss {loss!r} not in h5dump's /steps"

    with h5py.File(path, "r") as f:  # the format's superblock is 1.10's, not 2.0's
        assert f.id.get_create_plist().get_version()[0] <= 3
