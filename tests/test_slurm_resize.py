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
