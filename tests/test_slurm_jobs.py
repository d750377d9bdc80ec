"""Tier 4: real training jobs on the 4-node test cluster, through submitit and through sbatch.

Each job trains the tiny model (tests/mpi_helpers.TINY) for 3 steps, one pipeline stage per node.
The tests check what the scheduler says (sacct), what the job wrote (run.h5, result.json), and
what the run log recorded about where it ran (num_nodes counts distinct SLURMD_NODENAME values),
so a job that "ran" on one node, or failed quietly, is caught.

The CLI tests run ``dynmo-hpc`` as a subprocess with the cluster's environment, as a user would;
the Python API test submits in-process, so SLURM_CONF goes into ``os.environ`` (submitit calls
sbatch and sacct with it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc import runlog
from dynmo_hpc.cli import main
from dynmo_hpc.slurm.submit import make_executor, resolve_for_cluster, submit, wait_for_job
from tests.helpers.jobs import TINY
from tests.helpers.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "default.yaml")
CLI = [sys.executable, "-m", "dynmo_hpc"]
JOB_TIMEOUT_S = 240.0
"""A 4-rank tiny job takes 15-30 s here; the machine is shared, so allow for a slow one."""

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def tiny(out_dir: Path, name: str, *, num_stages: int = 4) -> list[str]:
    """``--set`` overrides: the tiny model, 3 steps, one stage per node, loopback MPI."""
    return [
        *TINY,
        "train.steps=3",
        f"pipeline.num_stages={num_stages}",
        f"slurm.nodes={num_stages}",
        "slurm.loopback_only=true",
        "slurm.time_min=5",
        f"job.out_dir={out_dir}",
        f"job.name={name}",
    ]


def as_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def unique(stem: str) -> str:
    return f"{stem}-{os.getpid()}-{time.monotonic_ns() % 10**8}"


def run_cli(
    cluster: SlurmCluster, args: list[str], *, timeout_s: float = JOB_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [*CLI, *args], env=cluster.env, capture_output=True, text=True, timeout=timeout_s
    )
    return out


def assert_trained_on_four_nodes(run_dir: Path, context: str) -> None:
    log_path = run_dir / "run.h5"
    assert log_path.is_file(), f"{log_path} missing; {context}"
    steps = runlog.load(log_path).steps
    assert steps["step"].tolist() == [0, 1, 2], context
    assert set(steps["num_stages"]) == {4}, context
    assert set(steps["num_nodes"]) == {4}, f"the stages did not run one per node; {context}"
    assert (run_dir / "result.json").is_file(), context


@pytest.fixture
def cluster_environ(
    slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SlurmCluster]:
    """``os.environ`` pointed at the test cluster, for in-process submitit calls."""
    for name in list(os.environ):
        if name.startswith("SLURM"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    yield slurm_cluster


def test_submitit_job_trains_on_four_nodes(cluster_environ: SlurmCluster, tmp_path: Path) -> None:
    job = submit(JOB, overrides=tiny(tmp_path, unique("submitit")))
    assert not isinstance(job, list)
    try:
        state = wait_for_job(job, timeout_s=JOB_TIMEOUT_S)
    finally:
        job.cancel(check=False)  # no-op once it has ended
    logs = f"logs: {job.paths.stdout}, {job.paths.stderr}"
    assert state == "COMPLETED", f"submitit job {job.job_id} ended {state}; {logs}"
    assert cluster_environ.job_state(int(job.job_id)) == "COMPLETED", logs
    run_dir = Path(job.submission().args[0]).parent
    assert_trained_on_four_nodes(run_dir, logs)
    assert len(job.result()["losses"]) == 3


def wait_for_usr2(ready: str) -> bool:
    """Job body: say it is ready, then wait up to a minute for SIGUSR2."""
    got: list[int] = []
    signal.signal(signal.SIGUSR2, lambda *_: got.append(1))
    Path(ready).write_text("ready")
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(got)


def test_submitit_job_python_gets_the_time_limit_signal(
    cluster_environ: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``exec python``: the job's Python is the batch shell, so ``--signal=B:USR2@N`` reaches the
    process the manager runs in (without ``exec``, bash dies of it and the job FAILs).

    A stand-in body instead of the manager: this is about submitit's batch script.
    """
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the job imports this module
    overrides = [f"job.out_dir={tmp_path}", "pipeline.num_stages=1"]  # one node, one task
    cfg = resolve_for_cluster(config_mod.load(JOB, overrides))
    executor = make_executor(cfg, tmp_path / "submitit", job_name=unique("usr2"))
    ready = tmp_path / "ready"
    job = executor.submit(wait_for_usr2, str(ready))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline, f"job {job.job_id} never started"
            time.sleep(0.2)
        # What SLURM does signal_delay_s before the time limit, sent by hand.
        cluster_environ.run(["scancel", "--batch", "--signal=USR2", job.job_id])
        state = wait_for_job(job, timeout_s=120)
    finally:
        job.cancel(check=False)
    assert state == "COMPLETED", f"job {job.job_id} ended {state}; log {job.paths.stderr}"
    assert job.result() is True


def test_sbatch_script_trains_on_four_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    name = unique("sbatch")
    out = run_cli(
        slurm_cluster, ["sbatch", JOB, "--submit", "--wait", *as_args(tiny(tmp_path, name))]
    )
    found = re.search(r"submitted job (\d+)", out.stdout)
    assert found, f"no job id; stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    job_id = int(found.group(1))
    run_dir = tmp_path / name
    logs = f"logs: {run_dir}/{name}-{job_id}.out/.err\nstderr:\n{out.stderr}"
    assert out.returncode == 0, logs
    assert f"job {job_id} COMPLETED" in out.stdout
    assert slurm_cluster.job_state(job_id) == "COMPLETED", logs
    assert (run_dir / f"{name}-{job_id}.out").is_file()
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    assert_trained_on_four_nodes(run_dir, logs)


def test_sweep_is_one_job_array(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Two learning rates, two 2-stage tasks of one array; they share the 4 nodes."""
    name = unique("sweep")
    overrides = tiny(tmp_path, name, num_stages=2)
    out = run_cli(
        slurm_cluster,
        ["submit", JOB, "--wait", "--sweep", "train.lr=1e-3,3e-3", *as_args(overrides)],
    )
    context = f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.returncode == 0, context
    task_ids = re.findall(r"submitted job (\d+_\d+):", out.stdout)
    assert len(task_ids) == 2 and task_ids[0].split("_")[0] == task_ids[1].split("_")[0], context
    for task_id in task_ids:
        assert f"job {task_id} COMPLETED" in out.stdout, context
        acct = slurm_cluster.run(["sacct", "-X", "-n", "-P", "-j", task_id, "-o", "State"])
        assert acct.stdout.strip() == "COMPLETED", context
    for index, lr in enumerate(("0.001", "0.003")):
        run_dir = tmp_path / f"{name}-{index}-lr{lr}"
        assert (run_dir / "run.h5").is_file(), context
        assert runlog.load(run_dir / "run.h5").steps["step"].tolist() == [0, 1, 2], context
        assert f"lr: {float(lr)}" in (run_dir / "config.yaml").read_text()


def test_failed_jobs_are_reported_with_their_log(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A rank raises at step 0; both paths say FAILED, name the log, and exit 1.

    One stage on one node keeps it cheap; the two submissions run at the same time.
    """
    failing = [
        "fault.inject_step=0",
        "fault.inject_action=raise",
        "slurm.loopback_only=true",
        "fault.max_restarts=0",
    ]
    procs = {}
    for command, extra in (("submit", []), ("sbatch", ["--submit"])):
        overrides = [*tiny(tmp_path, unique(f"fail-{command}"), num_stages=1), *failing]
        procs[command] = subprocess.Popen(
            [*CLI, command, JOB, *extra, "--wait", *as_args(overrides)],
            env=slurm_cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for command, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
        context = f"{command}: stdout:\n{stdout}\nstderr:\n{stderr}"
        assert proc.returncode == 1, context
        found = re.search(r"error: job (\d+) FAILED .*; log (\S+) \(stderr (\S+)\)", stderr)
        assert found, context
        job_id, out_log, err_log = int(found.group(1)), Path(found.group(2)), Path(found.group(3))
        assert slurm_cluster.job_state(job_id) == "FAILED", context
        assert out_log.is_file(), context
        text = err_log.read_text()
        assert "injected failure on rank 0 at step 0" in text, f"{context}\n{err_log}:\n{text}"


def test_invalid_job_is_rejected_before_submission(
    cluster_environ: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against the real sinfo: an invalid or impossible request never reaches the queue.

    In-process (``main``), as the CLI start-up costs seconds per call on this machine.
    """
    cases = [
        (["pipeline.num_stages=4", "slurm.nodes=2"], "slurm.nodes(2) * slurm.tasks_per_node(1)"),
        (["slurm.partition=nope"], "valid: exclusive, shared (default)"),
        (["slurm.mem_gb=64"], "65536 MB (slurm.mem_gb=64.0)"),
    ]
    names = []
    for overrides, message in cases:
        name = unique("reject")
        names.append(name)
        for command, extra in (("submit", []), ("sbatch", ["--submit"])):
            common = as_args([f"job.out_dir={tmp_path}", f"job.name={name}", *overrides])
            rc = main([command, JOB, *extra, *common])
            out, err = capsys.readouterr()
            assert rc == 2, err
            assert out == "" and err.startswith("error: "), err
            assert err.count("\n") == 1 and message in err, err
    assert not any(tmp_path.iterdir()), "a rejected job wrote its run directory"
    acct = cluster_environ.run(["sacct", "-X", "-n", "-P", "-o", "JobName", "-S", "now-1hours"])
    assert not set(names) & set(acct.stdout.split()), "a rejected job reached the queue"
