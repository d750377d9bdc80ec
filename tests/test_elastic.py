"""Elastic packing on local ranks: the resize cycle, and a pack that is invisible to the math.

A job that packs from 4 to 2 stages mid-run (checkpoint, end the MPI step, relaunch on 2 ranks,
resume) must produce per-step losses, final weights and AdamW state bitwise equal to the same
job with packing off; its one run log must show the pack, the resize phase by phase, and the
ranks it held. The resize loop itself is tested with a fake step, in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynmo_hpc.balance.restart_overhead import estimated_restart_s
from dynmo_hpc.checkpoint import store
from dynmo_hpc.handoff import resize
from dynmo_hpc.handoff.failures import take_pending_failures
from dynmo_hpc.handoff.oom import OUT_OF_MEMORY, is_out_of_memory, record_out_of_memory
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.launch.supervisor import StepResult, supervise
from dynmo_hpc.runlog import load
from dynmo_hpc.runlog.report import write_report
from tests.helpers.elastic import run_static_and_packed
from tests.helpers.jobs import tiny_config
from tests.test_resume import assert_bitwise_equal

PACKING = [
    "elastic.enabled=true",
    "elastic.policy=node_hours",  # packing always pays per node-hour on a tiny model
    "elastic.max_slowdown=0.9",  # node_hours is bounded too: this test is about the resize
    "elastic.min_stages=2",
    "elastic.interval=1",
    "elastic.restart_overhead_s=0",
]
COMMON = ["pipeline.num_stages=4", "train.steps=8", "checkpoint.at_end=true"]


@pytest.mark.slow
@pytest.mark.mpi
def test_a_pack_from_four_to_two_stages_is_bitwise_invisible(tmp_path):
    runs = run_static_and_packed(tmp_path, COMMON, PACKING)
    static, packed, want, got, run = runs.static, runs.packed, runs.want, runs.got, runs.run
    assert got["losses"] == want["losses"]
    assert len(got["parts"]) == 3, f"did not end on 2 stages: {got['parts']}"
    for index in range(static.model.num_layers):
        g = store.load_layer(packed.run_dir / "checkpoint" / "step_8", index)
        w = store.load_layer(static.run_dir / "checkpoint" / "step_8", index)
        assert_bitwise_equal(g["module"], w["module"], f"layer {index} weights")
        assert_bitwise_equal(g["optimizer"], w["optimizer"], f"layer {index} AdamW state")

    ranks = runs.ranks
    assert ranks[0] == 4 and ranks[-1] == 2 and ranks == sorted(ranks, reverse=True)
    packs = run.events[run.events["kind"] == "pack"]["detail"].tolist()
    assert any(p["pack"] and p["to_stages"] == 2 for p in packs)
    (resized,) = run.events[run.events["kind"] == "resize"]["detail"].tolist()
    assert (resized["from_stages"], resized["to_stages"]) == (4, 2)
    phases = ("checkpoint_s", "step_exit_s", "shrink_s", "relaunch_s", "restore_s")
    assert all(resized[p] >= 0 for p in phases) and resized["relaunch_s"] > 0
    assert resized["total_s"] == pytest.approx(sum(resized[p] for p in phases))
    assert len(run.restarts) == 1 and run.superseded["steps"].empty  # nothing redone
    assert not (packed.run_dir / resize.RESIZE_REQUEST).exists()
    assert not (packed.run_dir / resize.RESIZE_PHASES).exists()

    report = write_report(packed.run_dir / "run.h5", tmp_path / "report")
    summary = report.summary
    assert "Resizes: 1" in summary and "4 -> 2 stages" in summary
    assert "rank-hours used" in summary
    assert (tmp_path / "report" / "nodes_throughput.png").is_file()


def test_the_resize_loop_shrinks_and_relaunches(tmp_path):
    """``supervise`` with a fake step: one resize request, then a clean finish."""
    cfg = tiny_config(tmp_path, "pipeline.num_stages=4", "job.name=loop")
    calls: list[tuple[int, Path | None, list[int] | None]] = []
    shrunk: list[int] = []

    def run_step(step_cfg, launch):
        assert launch.config_path.is_file()
        calls.append(
            (step_cfg.pipeline.num_stages, launch.resume_from, step_cfg.pipeline.partition)
        )
        if len(calls) == 1:
            resize.write_request(
                step_cfg.run_dir,
                {
                    "num_stages": 2,
                    "parts": [0, 3, 6],
                    "step": 4,
                    "checkpoint": str(tmp_path / "ck" / "step_4"),
                    "checkpoint_s": 0.5,
                    "requested_unix_s": 0.0,
                },
            )
        else:  # the new step finds the manager's phases
            phases = resize.take_phases(step_cfg.run_dir)
            assert phases is not None and phases["shrink_s"] == 1.25
            assert (phases["from_stages"], phases["to_stages"]) == (4, 2)
        return StepResult(0)

    def shrink(smaller):
        shrunk.append(smaller.pipeline.num_stages)
        return 1.25

    assert supervise(cfg, run_step, shrink).exit_code == 0
    assert calls == [(4, None, None), (2, tmp_path / "ck" / "step_4", [0, 3, 6])]
    assert shrunk == [2]
    assert "num_stages: 2" in (cfg.run_dir / "config.yaml").read_text()


def test_a_failed_step_ends_the_loop_with_its_code(tmp_path):
    cfg = tiny_config(tmp_path, "job.name=fails", "fault.max_restarts=0")
    outcome = supervise(cfg, lambda *_: StepResult(3), lambda _: 0.0)
    assert outcome.exit_code == 3 and outcome.gave_up.startswith("fault.max_restarts=0")


def test_a_job_that_never_stops_resizing_is_stopped(tmp_path):
    cfg = tiny_config(tmp_path, "job.name=loops")

    def run_step(step_cfg, launch):
        request = {"num_stages": 2, "parts": [0, 3, 6], "step": 1}
        resize.write_request(
            step_cfg.run_dir, {**request, "checkpoint": "x", "requested_unix_s": 0.0}
        )
        return StepResult(0)

    assert supervise(cfg, run_step, lambda _: 0.0).exit_code == 1


def _pack_then_oom(tmp_path, job):
    """A fake job: the first step packs 4 -> 2 stages, the packed step runs out of memory on
    rank 1, any later step finishes. Returns the config and the steps' (stages, partition,
    min_stages, resume_from)."""
    cfg = tiny_config(tmp_path, "pipeline.num_stages=4", f"job.name={job}")
    calls: list[tuple[int, list[int] | None, int, Path | None]] = []
    pack_checkpoint = tmp_path / "ck" / "step_4"

    def run_step(step_cfg, launch):
        calls.append(
            (
                step_cfg.pipeline.num_stages,
                step_cfg.pipeline.partition,
                step_cfg.elastic.min_stages,
                launch.resume_from,
            )
        )
        if len(calls) == 1:
            resize.write_request(
                step_cfg.run_dir,
                {
                    "num_stages": 2,
                    "from_parts": [0, 2, 3, 5, 6],
                    "parts": [0, 3, 6],
                    "step": 4,
                    "checkpoint": str(pack_checkpoint),
                    "requested_unix_s": 0.0,
                },
            )
            return StepResult(0)
        if len(calls) == 2:
            record_out_of_memory(step_cfg.run_dir, 1, MemoryError("cannot allocate 2 GiB"))
            return StepResult(1)
        return StepResult(0)

    return cfg, run_step, calls, pack_checkpoint


def test_an_out_of_memory_packed_step_falls_back_to_the_pre_pack_partition(tmp_path):
    """Main restarted the packed configuration, which failed the same way and gave up; the
    fallback resumes the pack's checkpoint on the 4 stages and partition before the pack, and
    never packs to 2 stages again."""
    cfg, run_step, calls, pack_checkpoint = _pack_then_oom(tmp_path, "oom_local")
    outcome = supervise(cfg, run_step, lambda _: 0.0, can_run=lambda _cfg: True)
    assert outcome.exit_code == 0 and outcome.gave_up == ""
    assert calls[1][:2] == (2, [0, 3, 6])
    assert calls[2] == (4, [0, 2, 3, 5, 6], 3, pack_checkpoint)
    assert not (cfg.run_dir / OUT_OF_MEMORY).exists()
    (failure,) = take_pending_failures(cfg.run_dir)
    assert failure["restarted"] and failure["fallback_stages"] == 4
    assert failure["out_of_memory"]["rank"] == 1


def test_an_out_of_memory_packed_step_without_its_nodes_stops_with_an_error(tmp_path):
    """Under SLURM the nodes of the pre-pack size were released (no ``can_run``): the job stops
    with an error that says so, instead of restarting a configuration that cannot fit."""
    cfg, run_step, calls, _ = _pack_then_oom(tmp_path, "oom_slurm")
    outcome = supervise(cfg, run_step, lambda _: 0.0)
    assert outcome.exit_code == 1 and len(calls) == 2
    assert outcome.gave_up.startswith("the packed step (2 stages) ran out of memory on rank 1")
    assert "nodes of the 4 stages before the pack were released" in outcome.gave_up
    assert "on 4 stages with elastic.min_stages=3" in outcome.gave_up


def test_out_of_memory_is_recognised_by_name():
    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError, without torch
        pass

    assert is_out_of_memory(MemoryError()) and is_out_of_memory(OutOfMemoryError("cuda"))
    assert not is_out_of_memory(RuntimeError("out of memory?"))


@pytest.mark.slow
@pytest.mark.mpi
def test_a_job_packs_on_its_own_measurements(tmp_path):
    """No forced decision: the ``throughput`` policy, the measured restart overhead
    (``restart_overhead_s`` null), no ``min_stages`` floor. One block is so wide that it sets
    the pace on any stage count, so fewer stages are at least as fast as the best 4-stage
    partition (a smaller fill-and-drain bubble) and the steps left repay the restart. The pack
    is one decision with the rebalance at its report, it is logged against the rebalanced
    partition and the original size, and the pack history reaches the checkpoint."""
    cfg = tiny_config(
        tmp_path,
        "job.name=own_pack",
        "pipeline.num_stages=4",
        "model.layer_d_ff=[64,64,64,65536]",
        "balance.algorithm=optimal",
        "train.steps=150",
        "train.log_interval=50",
        "checkpoint.at_end=true",
        "elastic.enabled=true",
        "elastic.policy=throughput",
    )
    assert cfg.elastic.restart_overhead_s is None and cfg.elastic.min_stages == 1
    rc, _ = launch_local(cfg, timeout_s=900)
    assert rc == 0
    run = load(cfg.run_dir / "run.h5")
    events = run.events
    packs = [
        (step, d)
        for step, kind, d in zip(events["step"], events["kind"], events["detail"], strict=True)
        if kind == "pack" and d["pack"]
    ]
    assert packs, "the job never packed"
    step, pack = packs[0]
    assert pack["policy"] == "throughput" and pack["from_stages"] == 4 and pack["to_stages"] < 4
    assert pack["overhead_node_s"] > 0  # measured, not assumed free
    assert pack["saving_node_s"] > pack["overhead_node_s"]
    assert pack["predicted_tokens_per_s_rebalanced"] >= pack["predicted_tokens_per_s_before"]
    assert pack["reference_tokens_per_s"] >= pack["predicted_tokens_per_s_rebalanced"]
    assert pack["predicted_tokens_per_s_after"] >= 0.9 * pack["reference_tokens_per_s"]
    # The simulator's restart estimate, from what the log holds, is the decision's overhead.
    launches = events[events["kind"] == "launch"]["detail"].tolist()
    assert launches, "the first launch logged no start-up"
    startup_s = float(launches[0]["startup_s"])
    earlier = events[(events["kind"] == "checkpoint") & (events["step"] < step)]["detail"]
    last_checkpoint_s = float(earlier.tolist()[-1]["seconds"]) if len(earlier) else None
    costs = run.layer_costs[run.layer_costs["step"] == step]
    state_bytes = float((costs["param_bytes"] + costs["grad_bytes"] + costs["optim_bytes"]).sum())
    estimate_s = estimated_restart_s(startup_s, last_checkpoint_s, state_bytes)
    assert pack["overhead_node_s"] == pytest.approx(estimate_s * pack["from_nodes"], rel=1e-6)
    same_report = events[(events["step"] == step) & (events["kind"] == "rebalance")]
    assert same_report.empty, "a rebalance was logged at the pack's report"
    assert any(k == "pack_result" for k in events["kind"])
    ranks = run.steps["num_ranks"].tolist()
    assert ranks[0] == 4 and ranks[-1] == pack["to_stages"]
    final = store.read_run_state(cfg.run_dir / "checkpoint" / "step_150")
    assert final["pack"]["original_stages"] == 4
    assert 0 < final["pack"]["correction"] <= 1
