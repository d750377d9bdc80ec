"""Reading the SLURM job environment: pure, from patched environments (no cluster needed).

The environments below are trimmed copies of what the test cluster really exported (batch script,
srun step, array task, after a shrink's resize script), so the parser is held to SLURM's actual
output, not to our idea of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from dynmo_hpc.slurm import (
    SlurmEnvError,
    expand_hostlist,
    expand_per_node_counts,
    in_slurm_job,
    read_slurm_env,
)

# From `env` in the batch script of `sbatch -N4 --ntasks-per-node=1 --cpus-per-task=1 -J capjob`.
BATCH_ENV = {
    "SLURMD_NODENAME": "node1",
    "SLURM_CPUS_PER_TASK": "1",
    "SLURM_JOBID": "8",
    "SLURM_JOB_CPUS_PER_NODE": "1(x4)",
    "SLURM_JOB_ID": "8",
    "SLURM_JOB_NAME": "capjob",
    "SLURM_JOB_NODELIST": "node[1-4]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[1-4]",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_SUBMIT_DIR": "/tmp/envcap",
    "SLURM_TASKS_PER_NODE": "1(x4)",
}

# Task 1 of `srun -N4 -n4` inside that job.
STEP_ENV = {
    **BATCH_ENV,
    "SLURMD_NODENAME": "node2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[1-4]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}

# What slurm_job_8_resize.sh did after `scontrol update JobId=8 NumNodes=2`.
RESIZED_ENV = {
    **{
        k: v
        for k, v in BATCH_ENV.items()
        if k not in ("SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE")
    },
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
}


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Replace os.environ's SLURM variables with a given set; returns the setter."""

    def use(env: dict[str, str]) -> None:
        for name in list(os.environ):
            if name.startswith("SLURM"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return use


# --- host lists ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("node1", ["node1"]),
        ("node[1-4]", ["node1", "node2", "node3", "node4"]),
        (
            "node[1-3,5],gpu[01-02]",
            ["node1", "node2", "node3", "node5", "gpu01", "gpu02"],
        ),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("a,b[2],c", ["a", "b2", "c"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[7]", ["n7"]),
        (" node[1-2] ", ["node1", "node2"]),
        ("x[0-0]", ["x0"]),
        ("host-a.example.org", ["host-a.example.org"]),
    ],
)
def test_expand_hostlist(spec: str, expected: list[str]) -> None:
    assert expand_hostlist(spec) == expected


@pytest.mark.parametrize(
    "spec",
    ["", "node[1-", "node]1[", "node[]", "node[3-1]", "node[a-b]", "node[1-2],,x", "n[[1]]"],
)
def test_expand_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(SlurmEnvError, match="HINT:"):
        expand_hostlist(spec)


# --- per-node counts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("1", [1]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1(x4)", [1, 1, 1, 1]),
        ("4,2(x2)", [4, 2, 2]),
        ("0(x2)", [0, 0]),
    ],
)
def test_expand_per_node_counts(spec: str, expected: list[int]) -> None:
    assert expand_per_node_counts(spec) == expected


@pytest.mark.parametrize("spec", ["", "x", "2(3)", "2(x0)", "2(x)", "-1", "1,,2"])
def test_expand_per_node_counts_rejects_malformed(spec: str) -> None:
    with pytest.raises(SlurmEnvError, match="HINT:"):
        expand_per_node_counts(spec)


# --- whole environments -------------------------------------------------------------------------


def test_in_slurm_job_follows_job_id(environ: Callable[[dict[str, str]], None]) -> None:
    environ({})
    assert not in_slurm_job()
    environ({"SLURM_CONF": "/x/slurm.conf"})  # a cluster address is not a job
    assert not in_slurm_job()
    environ(BATCH_ENV)
    assert in_slurm_job()
    assert in_slurm_job({"SLURM_JOBID": "3"})
    assert not in_slurm_job({})


def test_batch_script(environ: Callable[[dict[str, str]], None]) -> None:
    environ(BATCH_ENV)
    env = read_slurm_env()
    assert env.job_id == 8
    assert env.job_name == "capjob"
    assert env.node_list == ("node1", "node2", "node3", "node4")
    assert env.num_nodes == 4
    assert env.master_node == "node1"
    assert env.tasks_per_node == (1, 1, 1, 1)
    assert env.num_tasks == 4
    assert env.cpus_per_node == (1, 1, 1, 1)
    assert env.cpus_per_task == 1
    assert env.node_name == "node1"
    assert env.step_id is None
    assert env.step_node_list is None
    assert env.submit_dir == "/tmp/envcap"
    assert not env.is_array_task
    assert env.array_job_id is None


def test_srun_step(environ: Callable[[dict[str, str]], None]) -> None:
    environ(STEP_ENV)
    env = read_slurm_env()
    assert (env.proc_id, env.local_id, env.node_id) == (1, 0, 1)
    assert env.node_name == "node2"
    assert env.step_id == 0
    assert env.step_node_list == env.node_list


def test_step_on_a_subset_of_the_nodes() -> None:
    """`srun -N2 -n3` in a 4-node job: SLURM_NNODES/NTASKS describe the step, not the job."""
    env = read_slurm_env(
        {
            **STEP_ENV,
            "SLURM_NNODES": "2",
            "SLURM_NODELIST": "node[1-2]",
            "SLURM_NTASKS": "3",
            "SLURM_NPROCS": "3",
            "SLURM_TASKS_PER_NODE": "2,1",
            "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_TASKS_PER_NODE": "2,1",
        }
    )
    assert env.num_nodes == 4
    assert env.step_node_list == ("node1", "node2")
    assert env.tasks_per_node == (2, 1)
    assert env.num_tasks == 3


def test_array_task() -> None:
    env = read_slurm_env(
        {
            **BATCH_ENV,
            "SLURM_JOB_ID": "10",
            "SLURM_ARRAY_JOB_ID": "9",
            "SLURM_ARRAY_TASK_ID": "0",
        }
    )
    assert env.job_id == 10
    assert (env.array_job_id, env.array_task_id) == (9, 0)
    assert env.is_array_task


def test_after_resize_script() -> None:
    env = read_slurm_env(RESIZED_ENV)
    assert env.node_list == ("node1", "node2")
    assert env.num_nodes == 2
    assert env.tasks_per_node is None
    assert env.num_tasks is None
    assert env.cpus_per_node == (1, 1)


def test_heterogeneous_tasks_per_node() -> None:
    env = read_slurm_env(
        {
            "SLURM_JOB_ID": "5",
            "SLURM_JOB_NODELIST": "node[1-3,5],gpu[01-02]",
            "SLURM_TASKS_PER_NODE": "2(x3),1(x3)",
            "SLURM_NTASKS": "9",
            "SLURM_JOB_CPUS_PER_NODE": "4(x6)",
        }
    )
    assert env.num_nodes == 6
    assert env.tasks_per_node == (2, 2, 2, 1, 1, 1)
    assert env.master_node == "node1"


def test_old_names_are_accepted() -> None:
    env = read_slurm_env({"SLURM_JOBID": "4", "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "2"})
    assert (env.job_id, env.node_list, env.num_tasks) == (4, ("n1", "n2"), 2)


def test_default_reads_os_environ(environ: Callable[[dict[str, str]], None]) -> None:
    environ({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "c[1-2]"})
    assert read_slurm_env().node_list == ("c1", "c2")


def test_env_is_frozen() -> None:
    env = read_slurm_env(BATCH_ENV)
    with pytest.raises(AttributeError):
        env.job_id = 3  # type: ignore[misc]


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"SLURM_JOB_ID": None, "SLURM_JOBID": None}, "not inside a SLURM job"),
        ({"SLURM_JOB_NODELIST": None, "SLURM_NODELIST": None}, "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not an integer"),
        ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES=3"),
        ({"SLURM_TASKS_PER_NODE": "1(x3)"}, "covers 3 nodes"),
        ({"SLURM_NTASKS": "5", "SLURM_NPROCS": "5"}, "sums to 4"),
        ({"SLURM_JOB_CPUS_PER_NODE": "1(x5)"}, "covers 5 nodes"),
        ({"SLURM_ARRAY_TASK_ID": "2"}, "only one of SLURM_ARRAY_JOB_ID"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside"),
        ({"SLURM_JOB_NODELIST": "node[1-"}, "unclosed"),
        ({"SLURM_CPUS_PER_TASK": "two"}, "SLURM_CPUS_PER_TASK='two'"),
    ],
)
def test_errors_name_the_variable_and_end_with_a_hint(
    patch: dict[str, str | None], message: str
) -> None:
    env = dict(BATCH_ENV)
    for name, value in patch.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    with pytest.raises(SlurmEnvError, match=message) as info:
        read_slurm_env(env)
    assert "HINT: " in str(info.value)
