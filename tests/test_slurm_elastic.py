"""Tier 4: elastic packing on the real 4-node test cluster, through submitit and through sbatch.

``jobs/elastic.yaml`` starts on 4 nodes (one stage each) in the exclusive partition, so a node it
holds can run nothing else. The job packs with its own elastic settings (the ``throughput``
policy, its ``max_slowdown``, the measured restart overhead): no override forces the decision;
the overrides only shorten the run and place it on the test cluster. Each test checks, while the
job is still training:

- ``squeue`` and ``scontrol show job`` show it holding 2 nodes;
- ``sinfo`` shows the other two idle;
- a second exclusive 2-node job starts on them and finishes while the first still runs;

and afterwards that the first job ended COMPLETED under its one job id, with a run log that shows
the resize and 4 then 2 nodes held.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dynmo_hpc import runlog
from dynmo_hpc.slurm.submit import submit, wait_for_job
from tests.helpers.slurm_cluster import SlurmCluster
from tests.test_slurm_jobs import as_args, cluster_environ, unique  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "elastic.yaml")
TIMEOUT_S = 300.0

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def overrides(out_dir: Path, name: str) -> list[str]:
    return [
        f"job.out_dir={out_dir}",
        f"job.name={name}",
        "slurm.nodes=4",
        "slurm.partition=exclusive",
        "slurm.loopback_only=true",
        "slurm.time_min=10",
        "train.steps=70",
        "train.log_interval=10",
    ]


def _job_nodes(cluster: SlurmCluster, job_id: int) -> tuple[str, str]:
    """(state, node list) of a queued or running job, ('', '') once it left the queue."""
    out = cluster.run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%N"], check=False)
    state, _, nodes = out.stdout.strip().partition("|")
    return state, nodes


def check_pack_on_the_cluster(
    cluster: SlurmCluster, job_id: int, run_dir: Path, context: Callable[[], str]
) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:  # until the job holds 2 nodes
        state, nodes = _job_nodes(cluster, job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job ended: {state}; {context()}"
        if state == "RUNNING" and nodes == "node[1-2]":
            break
        assert time.monotonic() < deadline, f"no shrink; nodes {nodes}; {context()}"
        time.sleep(0.5)
    show = cluster.run(["scontrol", "show", "job", str(job_id)]).stdout
    assert re.search(r"\bNumNodes=2\b", show) and "NodeList=node[1-2]" in show, show
    idle = cluster.run(["sinfo", "-h", "-N", "-p", "exclusive", "-t", "idle", "-o", "%N"])
    assert set(idle.stdout.split()) == {"node3", "node4"}, idle.stdout

    where = run_dir.parent / f"{run_dir.name}-other.out"
    other = cluster.sbatch(
        "-p", "exclusive", "-N", "2", "-J", unique("other"), "-o", str(where),
        "--wrap", "srun printenv SLURMD_NODENAME",
    )  # fmt: skip
    assert cluster.wait(other, timeout_s=120) == "COMPLETED"
    state, nodes = _job_nodes(cluster, job_id)
    assert state == "RUNNING" and nodes == "node[1-2]", (
        f"the first job should still be training on node[1-2]: {state} {nodes}; {context()}"
    )
    assert sorted(where.read_text().split()) == ["node3", "node4"], where.read_text()


def check_run_log(cluster: SlurmCluster, job_id: int, run_dir: Path, context: str) -> None:
    assert cluster.job_state(job_id) == "COMPLETED", context
    run = runlog.load(run_dir / "run.h5")
    nodes = run.steps["num_nodes"].tolist()
    assert nodes[0] == 4 and nodes[-1] == 2 and len(run.steps) == 70, context
    (resized,) = run.events[run.events["kind"] == "resize"]["detail"].tolist()
    assert (resized["from_nodes"], resized["to_nodes"], resized["hosts"]) == (4, 2, 2)
    assert resized["shrink_s"] > 0 and resized["total_s"] < 60, resized
    assert (run_dir / "result.json").is_file()


def test_submitit_job_packs_from_four_nodes_to_two(
    cluster_environ: SlurmCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    job = submit(JOB, overrides=overrides(tmp_path, unique("elastic-submitit")))
    assert not isinstance(job, list)
    run_dir = Path(job.submission().args[0]).parent

    def context() -> str:
        return f"logs {job.paths.stdout}, {job.paths.stderr}"

    try:
        check_pack_on_the_cluster(cluster_environ, int(job.job_id), run_dir, context)
        state = wait_for_job(job, timeout_s=TIMEOUT_S)
    finally:
        job.cancel(check=False)
    assert state == "COMPLETED", context()
    check_run_log(cluster_environ, int(job.job_id), run_dir, context())


def test_sbatch_job_packs_from_four_nodes_to_two(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    name = unique("elastic-sbatch")
    sbatch_pack_and_complete(slurm_cluster, JOB, overrides(tmp_path, name), tmp_path / name)


def sbatch_pack_and_complete(
    slurm_cluster: SlurmCluster, job_file: str, args: list[str], run_dir: Path
) -> int:
    """Submit ``job_file`` with ``dynmo-hpc sbatch --submit``, check the pack on the cluster
    (freed nodes used by another job), that it ends COMPLETED, and its run log; the job id."""
    out = subprocess.run(
        [sys.executable, "-m", "dynmo_hpc", "sbatch", job_file, "--submit", *as_args(args)],
        env=slurm_cluster.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r"submitted job (\d+)", out.stdout)
    assert found, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    job_id = int(found.group(1))

    def context() -> str:
        return f"logs {run_dir}/{run_dir.name}-{job_id}.out/.err"

    try:
        check_pack_on_the_cluster(slurm_cluster, job_id, run_dir, context)
        assert slurm_cluster.wait(job_id, timeout_s=TIMEOUT_S) == "COMPLETED", context()
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    check_run_log(slurm_cluster, job_id, run_dir, context())
    return job_id


REFUSING_SCONTROL = """#!/bin/bash
# Test shim: SLURM refuses every shrink of a running job; every other scontrol call is real.
if [ "${1:-}" = update ]; then
    echo "slurm_update error: Requested operation is presently disabled" >&2
    exit 1
fi
exec {real} "$@"
"""


def test_sbatch_job_whose_shrink_is_refused_completes_at_the_original_size(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``scontrol update`` refused inside the job (a shim first on the PATH the job inherits):
    the job trains on at 4 stages from the pack's checkpoint and ends COMPLETED."""
    real = shutil.which("scontrol", path=slurm_cluster.env.get("PATH"))
    assert real, "scontrol not found on the cluster's PATH"
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text(REFUSING_SCONTROL.replace("{real}", real))
    (shims / "scontrol").chmod(0o755)
    env = {**slurm_cluster.env, "PATH": f"{shims}:{slurm_cluster.env['PATH']}"}
    name = unique("elastic-refused")
    out = subprocess.run(
        [sys.executable, "-m", "dynmo_hpc", "sbatch", JOB, "--submit",
         *as_args(overrides(tmp_path, name))],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r"submitted job (\d+)", out.stdout)
    assert found, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    job_id = int(found.group(1))
    run_dir = tmp_path / name
    context = f"logs {run_dir}/{name}-{job_id}.out/.err"
    try:
        assert slurm_cluster.wait(job_id, timeout_s=TIMEOUT_S) == "COMPLETED", context
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    run = runlog.load(run_dir / "run.h5")
    assert len(run.steps) == 70 and set(run.steps["num_nodes"].tolist()) == {4}, context
    assert set(run.steps["num_stages"].tolist()) == {4}, context
    kinds = run.events["kind"].tolist()
    assert "resize" not in kinds, context
    (refused,) = run.events[run.events["kind"] == "shrink_refused"]["detail"].tolist()
    assert (refused["from_stages"], refused["to_stages"]) == (4, 2), refused
    assert "presently disabled" in refused["message"], refused
    assert (run_dir / "result.json").is_file()


REPLICAS_JOB = str(ROOT / "jobs" / "elastic_replicas.yaml")


def test_sbatch_job_with_two_replicas_packs_to_one_and_frees_two_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """``jobs/elastic_replicas.yaml``: 2 replicas x 2 stages on 4 nodes pack to 1 x 2 with the
    job's own policy (node_hours) and bound; the two freed nodes run another job while the
    first trains on, and it ends COMPLETED on the same global batch.

    The one override besides the placement and the run length: ``elastic.restart_overhead_s=2``.
    A replica pack saves about one 2 x 2 step's time in node-seconds per step (a third more
    tokens per node-hour, not the same speed on half the nodes), so the 65 steps this test can
    afford repay a restart of a few seconds, not the start-up of four ranks on a loaded 2-core
    host; the job file's own 200 steps are for that. The pays-off rule itself is tested in
    tests/test_packing_replicas.py."""
    name = unique("replicas-sbatch")
    args = [*overrides(tmp_path, name), "elastic.restart_overhead_s=2"]
    run_dir = tmp_path / name
    job_id = sbatch_pack_and_complete(slurm_cluster, REPLICAS_JOB, args, run_dir)

    def context() -> str:
        return f"logs {run_dir}/{name}-{job_id}.out/.err"

    run = runlog.load(run_dir / "run.h5")
    assert run.steps["num_ranks"].tolist()[0] == 4 and run.steps["num_ranks"].tolist()[-1] == 2
    assert set(run.steps["num_stages"].tolist()) == {2}, context()
    (resized,) = run.events[run.events["kind"] == "resize"]["detail"].tolist()
    assert (resized["from_replicas"], resized["to_replicas"]) == (2, 1), resized
    assert "replicas: 1" in (run_dir / "config.yaml").read_text()
    acct = slurm_cluster.run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"])
    assert "COMPLETED" in acct.stdout.split(), acct.stdout
