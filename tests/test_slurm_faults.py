"""Tier 4: preemption and a crashed rank on the real test cluster.

* SIGUSR2 to the batch process (``scancel --signal=USR2 --batch``, what ``--signal=B:USR2@N``
  sends before the time limit) in the middle of training, once through submitit and once
  through sbatch: the ranks checkpoint at the next step boundary, the job is requeued (submitit's
  ``checkpoint()``; ``scontrol requeue`` for sbatch) and resumes, ending COMPLETED under its job
  id, with ``preempt`` and ``restart`` events in one run log and per-step losses bitwise equal
  to an uninterrupted run's. (The test cluster holds a requeued job for 10 s, its
  ``cred_expire``; SLURM's default is 120 s.)
* One rank SIGKILLed mid-run (``fault.inject_*``): the manager restarts the MPI step from the
  newest checkpoint inside the same allocation; the job completes with the same losses.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynmo_hpc import runlog
from dynmo_hpc.handoff import rank_status
from dynmo_hpc.launch.local import run_local
from dynmo_hpc.slurm.submit import submit, wait_for_job
from tests.helpers.jobs import read_result, tiny_config
from tests.helpers.slurm_cluster import SlurmCluster
from tests.test_slurm_jobs import as_args, cluster_environ, tiny, unique  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "default.yaml")
STEPS = 40
TIMEOUT_S = 300.0

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _overrides(out_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        *tiny(out_dir, name, num_stages=2),
        f"train.steps={STEPS}",
        "checkpoint.every_steps=10",
        "slurm.time_min=10",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of the same job run locally, uninterrupted (they do not depend on where
    or on how many stages it runs)."""
    cfg = tiny_config(
        tmp_path_factory.mktemp("ref"),
        "pipeline.num_stages=2",
        f"train.steps={STEPS}",
        "job.name=ref",
    )
    assert run_local(cfg, timeout_s=240).exit_code == 0
    losses: list[float] = read_result(cfg.run_dir)["losses"]
    return losses


def _signal_mid_run(cluster: SlurmCluster, job_id: int, run_dir: Path) -> None:
    """Wait until rank 0 of the job's first run is a few steps in, then send SIGUSR2."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        status = rank_status.read_all(run_dir).get(0)
        if status and status["attempt"] == 0 and status["step"] >= 5:
            break
        state = cluster.job_state(job_id)
        assert not state.startswith(("FAILED", "CANCELLED", "COMPLETED")), state
        time.sleep(0.1)
    else:
        raise AssertionError(f"job {job_id} did not reach step 5")
    cluster.run(["scancel", "--signal=USR2", "--batch", str(job_id)])


def _check_requeued_run(
    cluster: SlurmCluster, job_id: int, run_dir: Path, reference: list[float], context: str
) -> None:
    assert cluster.job_state(job_id) == "COMPLETED", context
    run = runlog.load(run_dir / "run.h5")
    kinds = run.events["kind"].tolist()
    assert "preempt" in kinds and "restart" in kinds, f"{kinds}; {context}"
    (preempt,) = run.events[run.events["kind"] == "preempt"]["detail"].tolist()
    assert preempt["signal"] == 12 and 5 <= preempt["completed_steps"] < STEPS, preempt
    assert run.steps["loss"].tolist() == reference, context
    result = read_result(run_dir)
    assert result["completed_steps"] == STEPS and result["losses"] == reference
    requeues = cluster.run(["sacct", "-n", "-X", "-D", "-P", "-j", str(job_id), "-o", "State"])
    assert "REQUEUED" in requeues.stdout or "PREEMPTED" in requeues.stdout, requeues.stdout


def _sbatch_submit(
    cluster: SlurmCluster, tmp_path: Path, name: str, *extra: str
) -> tuple[int, Path, str]:
    """``dynmo-hpc sbatch JOB --submit`` with the test's overrides: (job id, run dir, context)."""
    out = subprocess.run(
        [sys.executable, "-m", "dynmo_hpc", "sbatch", JOB, "--submit",
         *as_args(_overrides(tmp_path, name, *extra))],
        env=cluster.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r"submitted job (\d+)", out.stdout)
    assert found, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    job_id, run_dir = int(found.group(1)), tmp_path / name
    return job_id, run_dir, f"logs {run_dir}/{name}-{job_id}.out/.err"


def test_submitit_job_is_requeued_after_sigusr2_and_resumes_exactly(
    cluster_environ: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    reference: list[float],
) -> None:
    job = submit(JOB, overrides=_overrides(tmp_path, unique("requeue-submitit")))
    assert not isinstance(job, list)
    run_dir = Path(job.submission().args[0]).parent
    context = f"logs {job.paths.stdout}, {job.paths.stderr}"
    try:
        _signal_mid_run(cluster_environ, int(job.job_id), run_dir)
        state = wait_for_job(job, timeout_s=TIMEOUT_S)
    finally:
        job.cancel(check=False)
    assert state == "COMPLETED", context
    _check_requeued_run(cluster_environ, int(job.job_id), run_dir, reference, context)


def test_sbatch_job_is_requeued_after_sigusr2_and_resumes_exactly(
    slurm_cluster: SlurmCluster, tmp_path: Path, reference: list[float]
) -> None:
    name = unique("requeue-sbatch")
    job_id, run_dir, context = _sbatch_submit(slurm_cluster, tmp_path, name)
    try:
        _signal_mid_run(slurm_cluster, job_id, run_dir)
        assert slurm_cluster.wait(job_id, timeout_s=TIMEOUT_S) == "COMPLETED", context
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    _check_requeued_run(slurm_cluster, job_id, run_dir, reference, context)


def test_a_sigkilled_rank_on_the_cluster_is_restarted_in_the_allocation(
    slurm_cluster: SlurmCluster, tmp_path: Path, reference: list[float]
) -> None:
    name = unique("rank-killed")
    inject = ["fault.inject_step=15", "fault.inject_rank=1"]
    job_id, run_dir, context = _sbatch_submit(slurm_cluster, tmp_path, name, *inject)
    try:
        assert slurm_cluster.wait(job_id, timeout_s=TIMEOUT_S) == "COMPLETED", context
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    run = runlog.load(run_dir / "run.h5")
    (failure,) = run.events[run.events["kind"] == "failure"]["detail"].tolist()
    assert (failure["rank"], failure["signal"], failure["step"]) == (1, 9, 15), failure
    assert failure["restarted"] is True and failure["from"].endswith("step_10"), failure
    assert run.steps["loss"].tolist() == reference, context
