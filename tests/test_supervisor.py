"""The restart loop and the failure reports, with fake MPI steps (no ranks are started)."""

from __future__ import annotations

import signal
from pathlib import Path

from dynmo_hpc.handoff import rank_status
from dynmo_hpc.handoff.failures import FAILURE_PENDING
from dynmo_hpc.launch.failure import describe_failure
from dynmo_hpc.launch.supervisor import StepLaunch, StepResult, supervise
from tests.helpers.jobs import tiny_config

OMPI_KILLED = """--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 27608 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------"""
OMPI_ABORT = """MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD
  Proc: [[16502,1],2]
  Errorcode: 1
"""
OMPI_EXIT = """prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-6020@1,3]
   Exit code:    124
"""
SRUN = "srun: error: node2: task 1: Killed\nsrun: Terminating StepId=12.0\n"
SRUN_EXIT = "srun: error: node1: task 0: Exited with exit code 3\n"
HYDRA = (
    "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
    "=   RANK 1 PID 4242 RUNNING AT n7\n=   KILLED BY SIGNAL: 11 (Segmentation fault)\n"
)
STATUS = {
    0: {"rank": 0, "pid": 10, "host": "a", "step": 4, "phase": "step"},
    1: {"rank": 1, "pid": 11, "host": "b", "step": 5, "phase": "migration"},
}


def test_each_launchers_report_names_the_rank_and_how_it_died() -> None:
    f = describe_failure(137, OMPI_KILLED, STATUS)
    assert (f.cause, f.rank, f.signal, f.pid, f.host) == ("signal", 1, 9, 27608, "vm")
    assert (f.step, f.phase) == (5, "migration")
    assert (
        f.describe() == "rank 1 (pid 27608 on vm) was killed by SIGKILL in step 6 (layer migration)"
    )
    f = describe_failure(1, OMPI_ABORT, {})
    assert (f.cause, f.rank, f.rank_exit_code) == ("abort", 2, 1)
    f = describe_failure(124, OMPI_EXIT, {})
    assert (f.cause, f.rank, f.rank_exit_code) == ("exit", 3, 124)
    f = describe_failure(137, SRUN, STATUS)
    assert (f.cause, f.rank, f.signal, f.host, f.pid) == ("signal", 1, 9, "node2", 11)
    f = describe_failure(3, SRUN_EXIT, STATUS)
    assert (f.cause, f.rank, f.rank_exit_code, f.step) == ("exit", 0, 3, 4)
    f = describe_failure(139, HYDRA, {})
    assert (f.cause, f.rank, f.signal, f.pid, f.host) == ("signal", 1, 11, 4242, "n7")
    f = describe_failure(1, "nothing useful", {})
    assert f.cause == "launcher" and f.describe().startswith("the MPI launcher exited with code 1")


def _fail_with(output: str, run_dir: Path, *, rank: int = 1, step: int = 5) -> StepResult:
    status = rank_status.RankStatus(run_dir, rank, attempt=0)
    status.update("step", step)
    status.close()
    return StepResult(137, output)


def test_a_repeated_failure_is_not_retried_again(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "job.name=repeats", "fault.max_restarts=5")
    launches: list[StepLaunch] = []

    def run_step(_cfg, launch: StepLaunch) -> StepResult:
        launches.append(launch)
        return _fail_with(OMPI_KILLED, cfg.run_dir)

    outcome = supervise(cfg, run_step, lambda _c: 0.0)
    assert outcome.exit_code == 137 and outcome.restarts == 1 and len(launches) == 2
    assert "same way at the same step twice" in outcome.gave_up
    # no checkpoint was written: the restart started over, appending to the run log
    assert launches[1].restart and launches[1].resume_from is None and launches[1].attempt == 1
    assert (cfg.run_dir / FAILURE_PENDING).is_file()


def test_restarts_stop_at_max_restarts_and_a_recovery_ends_the_loop(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "job.name=limits", "fault.max_restarts=2")
    steps = iter([5, 6, 7])

    def run_step(_cfg, launch: StepLaunch) -> StepResult:
        return _fail_with(OMPI_KILLED, cfg.run_dir, step=next(steps))

    outcome = supervise(cfg, run_step, lambda _c: 0.0)
    assert outcome.restarts == 2 and len(outcome.failures) == 3
    assert outcome.gave_up == "fault.max_restarts=2 restarts used"

    calls: list[StepLaunch] = []

    def fails_once(_cfg, launch: StepLaunch) -> StepResult:
        calls.append(launch)
        return _fail_with(SRUN, cfg.run_dir) if len(calls) == 1 else StepResult(0)

    outcome = supervise(cfg, fails_once, lambda _c: 0.0)
    assert outcome.exit_code == 0 and outcome.restarts == 1 and outcome.failures[0].rank == 1


def test_a_launcher_that_starts_no_rank_is_not_restarted(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "job.name=norank", "fault.max_restarts=3")
    outcome = supervise(cfg, lambda *_: StepResult(1, ""), lambda _c: 0.0)
    assert outcome.restarts == 0 and "no rank started" in outcome.gave_up


def test_an_interrupted_step_is_neither_restarted_nor_resized(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "job.name=stopped")
    calls = []

    def run_step(_cfg, launch: StepLaunch) -> StepResult:
        calls.append(launch)
        return StepResult(137, OMPI_KILLED, interrupted=int(signal.SIGINT))

    outcome = supervise(cfg, run_step, lambda _c: 0.0)
    assert len(calls) == 1 and outcome.interrupted == signal.SIGINT and not outcome.failures


def test_an_oom_after_a_replica_only_pack_falls_back_to_a_valid_config(tmp_path: Path) -> None:
    """Issue 42, defect 1: 2 x 2 -> 1 x 2 ran out of memory. The fallback is the 2 x 2 job
    with a replica floor of 2 (not ``min_stages = 3`` on 2 stages, an invalid config), and the
    next decision cannot choose 1 replica again."""
    from dynmo_hpc.balance.step_model import smaller_sizes
    from dynmo_hpc.handoff.resize import resized_config
    from dynmo_hpc.launch.supervisor import _fall_back, _unpacked

    cfg = tiny_config(tmp_path, "pipeline.replicas=2", "elastic.enabled=true")
    assert (cfg.pipeline.replicas, cfg.pipeline.num_stages) == (2, 2)
    parts = [0, 3, 6]
    request = {"checkpoint": str(tmp_path / "ck"), "from_parts": parts}
    unpacked = _unpacked(cfg, request)
    packed = resized_config(cfg, 2, parts, 1)
    fallback, why = _fall_back(packed, unpacked.cfg, {"rank": 1}, lambda c: True, {})
    assert why == ""
    fallback.validate()  # raised ConfigError: elastic.min_stages(3) > pipeline.num_stages(2)
    assert (fallback.pipeline.replicas, fallback.pipeline.num_stages) == (2, 2)
    assert (fallback.elastic.min_replicas, fallback.elastic.min_stages) == (2, 1)
    sizes = smaller_sizes(
        2,
        2,
        num_microbatches=4,
        min_stages=fallback.elastic.min_stages,
        min_replicas=fallback.elastic.min_replicas,
        ranks_per_node=1,
        num_layers=6,
    )
    assert sizes and all(r >= 2 for r, _ in sizes), sizes


def test_an_oom_after_a_stage_pack_raises_the_stage_floor_only(tmp_path: Path) -> None:
    """A pack 3 -> 2 stages (one replica) that ran out of memory: back to 3, min_stages 3."""
    from dynmo_hpc.handoff.resize import resized_config
    from dynmo_hpc.launch.supervisor import _fall_back, _unpacked

    cfg = tiny_config(tmp_path, "pipeline.num_stages=3", "elastic.enabled=true")
    unpacked = _unpacked(cfg, {"checkpoint": str(tmp_path / "ck"), "from_parts": [0, 2, 4, 6]})
    packed = resized_config(cfg, 2, [0, 3, 6])
    fallback, why = _fall_back(packed, unpacked.cfg, {"rank": 0}, lambda c: True, {})
    assert why == ""
    fallback.validate()
    assert (fallback.elastic.min_replicas, fallback.elastic.min_stages) == (1, 3)
    _, why = _fall_back(packed, unpacked.cfg, {"rank": 0}, None, {})
    assert "3 stages" in why and "elastic.min_stages=3" in why, why
