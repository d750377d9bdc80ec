"""Shrinking a SLURM job, as pure functions: which nodes stay, and the environment after."""

from __future__ import annotations

import pytest

from dynmo_hpc.slurm.environment import read_slurm_env
from dynmo_hpc.slurm.resize import compress_counts, nodes_to_keep, resized_env

NODES = ["node1", "node2", "node3", "node4"]


def test_the_managers_node_is_always_kept():
    assert nodes_to_keep(NODES, "node1", 2) == ["node1", "node2"]
    assert nodes_to_keep(NODES, "node3", 2) == ["node1", "node3"]
    assert nodes_to_keep(NODES, "node4", 1) == ["node4"]
    assert nodes_to_keep(NODES, None, 3) == ["node1", "node2", "node3"]
    with pytest.raises(ValueError, match=r"1\.\.4"):
        nodes_to_keep(NODES, "node1", 0)


def test_compress_counts():
    assert compress_counts([2, 2, 2, 1]) == "2(x3),1"
    assert compress_counts([4]) == "4"
    assert compress_counts([1, 2, 1]) == "1,2,1"


def test_environment_after_a_shrink_reads_back_as_the_smaller_job():
    before = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node[1-4]",
        "SLURM_NODELIST": "node[1-4]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_JOB_CPUS_PER_NODE": "2(x3),1",
        "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4",
        "SLURM_TASKS_PER_NODE": "1(x4)",
        "SLURMD_NODENAME": "node1",
    }
    changes = resized_env(before, ["node1", "node4"])
    assert changes["SLURM_JOB_CPUS_PER_NODE"] == "2,1"
    assert changes["SLURM_NTASKS"] is None and changes["SLURM_TASKS_PER_NODE"] is None
    after = {k: v for k, v in {**before, **changes}.items() if v is not None}
    env = read_slurm_env(after)
    assert env.node_list == ("node1", "node4") and env.num_nodes == 2
    assert env.num_tasks is None and env.tasks_per_node is None
    assert env.cpus_per_node == (2, 1)


def _fake_slurm(monkeypatch, squeue_node_lists):
    """scontrol times out; each squeue call answers the next node list."""
    import subprocess

    from dynmo_hpc.slurm import resize
    from dynmo_hpc.slurm.scheduler import SlurmTimeout

    answers = iter(squeue_node_lists)

    def run(argv, **kw):
        if argv[0] == "scontrol":
            raise SlurmTimeout("scontrol update ... did not answer in 60 s")
        return subprocess.CompletedProcess(argv, 0, stdout=next(answers) + "\n", stderr="")

    monkeypatch.setattr(resize, "run_command", run)


def test_an_scontrol_timeout_is_not_a_refusal_once_the_shrink_shows(monkeypatch, tmp_path):
    """Issue 42, defect 6: scontrol timed out but SLURM applied the shrink (late): the shrink
    succeeded, so the manager updates its environment instead of going on with the old list."""
    from dynmo_hpc.slurm.resize import shrink_job

    _fake_slurm(monkeypatch, ["node[1-4]", "node[1-2]"])
    assert shrink_job(7, ["node1", "node2"], tmp_path, confirm_s=5, poll_s=0.01) >= 0.0


def test_an_scontrol_timeout_with_no_shrink_is_refused_naming_the_nodes(monkeypatch, tmp_path):
    from dynmo_hpc.errors import SubmitError
    from dynmo_hpc.slurm.resize import shrink_job

    _fake_slurm(monkeypatch, ["node[1-4]"] * 1000)
    with pytest.raises(SubmitError, match=r"still held node1,node2,node3,node4 .* HINT"):
        shrink_job(7, ["node1", "node2"], tmp_path, confirm_s=0.05, poll_s=0.01)
