"""The run log of a real training run tells the same story as the run itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import pytest

from dynmo_hpc.checkpoint import store
from dynmo_hpc.launch.local import openmpi_env
from dynmo_hpc.launch.rundir import prepare_run_dir
from dynmo_hpc.runlog import load
from dynmo_hpc.runlog.report import write_report
from tests.helpers.jobs import ROOT, run_job, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_two_rank_run_log_matches_training(tmp_path):
    cfg = tiny_config(
        tmp_path, "train.steps=6", "balance.interval=3", "pipeline.partition=[0, 2, 6]"
    )
    result = run_job(cfg)
    log = load(cfg.run_dir / "run.h5")
    assert log.end_status == "ok"
    assert log.steps["step"].tolist() == list(range(6))
    assert log.steps["loss"].tolist() == result["losses"]  # the values printed and returned
    assert log.steps["tokens_per_s"].tolist() == pytest.approx(result["tokens_per_s"])
    assert set(log.steps["num_stages"]) == {2} and set(log.steps["num_ranks"]) == {2}
    assert len(log.stage_times) == 6 * 2
    assert (log.stage_times["compute_s"] > 0).all()
    assert log.report_steps() == [2, 5]
    assert log.parts_at(2) == [0, 2, 6] and log.parts_at(5) == [0, 2, 6]
    costs = log.layer_costs[log.layer_costs["step"] == 5].sort_values("layer")
    assert costs["layer"].tolist() == list(range(6))
    assert (costs["forward_s"] > 0).all() and (costs["backward_s"] > 0).all()
    # AdamW: two moments per parameter, plus a step counter per tensor.
    extra = costs["optim_bytes"] - 2 * costs["param_bytes"]
    assert ((extra >= 0) & (extra < 1024)).all()
    assert log.config["pipeline"]["num_stages"] == 2
    assert log.attrs["schema_version"] >= 1

    report = write_report(cfg.run_dir / "run.h5", tmp_path / "report")
    assert len(report.png_paths) >= 5
    assert all(os.path.getsize(p) > 1000 for p in report.png_paths.values())


def start_training(cfg) -> subprocess.Popen:
    """Start a 2-rank training run in its own process group (so a test can signal or kill it)."""
    config_path = prepare_run_dir(cfg)
    mpiexec = ROOT / ".venv/bin/mpiexec"
    return subprocess.Popen(
        [
            str(mpiexec) if mpiexec.exists() else "mpiexec",
            "-n",
            "2",
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "dynmo_hpc.launch.worker",
            str(config_path),
        ],
        env={**os.environ, **openmpi_env()},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_steps(h5, num_steps: int, timeout_s: float = 120) -> int:
    """Poll the run log while the run writes it (SWMR) until it holds ``num_steps`` steps."""
    deadline = time.time() + timeout_s
    seen = 0
    while time.time() < deadline and seen < num_steps:
        time.sleep(0.5)
        if h5.exists():
            try:
                seen = len(load(h5).steps)
            except (OSError, KeyError):
                seen = 0
    assert seen >= num_steps, f"training did not get going ({seen} steps logged)"
    return seen


def test_sigkill_mid_training_leaves_a_readable_log(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "train.steps=400",
        "balance.interval=1",
        "pipeline.num_stages=2",
        "job.name=killed",
    )
    h5 = cfg.run_dir / "run.h5"
    proc = start_training(cfg)
    try:
        wait_for_steps(h5, 5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    log = load(h5)
    assert len(log.steps) >= 5
    assert log.steps["step"].tolist() == list(range(len(log.steps)))
    assert log.end_status is None  # never closed
    with h5py.File(h5, "r", swmr=True) as f:
        assert "config_yaml" in f.attrs


def test_sigusr2_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    """SLURM's pre-timeout / preemption signal: all ranks stop after the same step, checkpoint."""
    cfg = tiny_config(tmp_path, "train.steps=400", "balance.interval=1", "job.name=preempted")
    h5 = cfg.run_dir / "run.h5"
    proc = start_training(cfg)
    try:
        wait_for_steps(h5, 3)
        proc.send_signal(signal.SIGUSR2)  # mpiexec forwards it to every rank
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = load(h5)
    preempt = log.events[log.events["kind"] == "preempt"]
    assert len(preempt) == 1 and log.end_status == "ok"
    completed = int(preempt["detail"].iloc[0]["completed_steps"])
    assert 3 <= completed < 400 and len(log.steps) == completed
    step_dir = cfg.run_dir / "checkpoint" / f"step_{completed}"
    assert store.verify(step_dir) is None
    state = json.loads((step_dir / "run_state.json").read_text())
    assert state["step"] == completed
