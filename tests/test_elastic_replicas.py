"""Packing a job with replicas on local ranks: 2 replicas x 2 stages pack to 1 x 2.

The pack keeps the global batch and the partition; only the microbatches' split over replicas
changes, so the losses after it equal the uninterrupted 2 x 2 run's within the reassociation
bound of docs/data_parallel.md (``REASSOCIATION_REL``), and before it bitwise. The resize loop's
handling of a replica count is also checked with a fake step, in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dynmo_hpc.handoff import resize
from dynmo_hpc.launch.supervisor import StepResult, supervise
from dynmo_hpc.runlog.report import write_report
from tests.helpers.elastic import run_static_and_packed
from tests.helpers.jobs import assert_losses_close, tiny_config
from tests.test_data_parallel import REASSOCIATION_REL

PACKING = [
    "elastic.enabled=true",
    "elastic.policy=node_hours",  # one pipeline gives more tokens per worker-hour than two
    "elastic.max_slowdown=0.9",  # node_hours is bounded too: this test is about the resize
    "elastic.min_stages=2",  # so the only smaller size is 1 replica x 2 stages
    "elastic.interval=1",
    "elastic.restart_overhead_s=0",
]
COMMON = [
    "pipeline.replicas=2",
    "pipeline.num_stages=2",
    "train.num_microbatches=4",
    "train.steps=8",
    "checkpoint.at_end=true",
]


@pytest.mark.slow
@pytest.mark.mpi
def test_two_replicas_pack_to_one_with_the_same_losses(tmp_path):
    runs = run_static_and_packed(tmp_path, COMMON, PACKING)
    packed, want, got, run = runs.packed, runs.want, runs.got, runs.run
    assert len(got["parts"]) == 3, f"did not end on 2 stages: {got['parts']}"

    ranks = runs.ranks
    assert ranks[0] == 4 and ranks[-1] == 2 and ranks == sorted(ranks, reverse=True)
    packs = [p for p in run.events[run.events["kind"] == "pack"]["detail"] if p["pack"]]
    assert packs and (packs[0]["from_replicas"], packs[0]["to_replicas"]) == (2, 1)
    assert (packs[0]["from_stages"], packs[0]["to_stages"]) == (2, 2)
    assert packs[0]["parts"] == packs[0]["from_parts"], "the partition is kept"
    (resized,) = run.events[run.events["kind"] == "resize"]["detail"].tolist()
    assert (resized["from_replicas"], resized["to_replicas"]) == (2, 1)
    assert (resized["from_nodes"], resized["to_nodes"]) == (4, 2)
    assert "replicas: 1" in (packed.run_dir / "config.yaml").read_text()

    summary = write_report(packed.run_dir / "run.h5", tmp_path / "report").summary
    assert "2 x 2 -> 1 x 2 (replicas x stages), 4 -> 2 nodes" in summary, summary

    first_packed = ranks.index(2)
    assert got["losses"][:first_packed] == want["losses"][:first_packed]  # the same run so far
    assert_losses_close(got["losses"], want["losses"], rel=REASSOCIATION_REL)
    assert got["losses"][-1] < got["losses"][0], "the model should learn"


def test_the_resize_loop_relaunches_on_fewer_replicas(tmp_path):
    """``supervise`` with a fake step: a request for 1 replica x 2 stages relaunches the job
    with ``pipeline.replicas: 1`` on the same partition, and the phases name both sizes."""
    cfg = tiny_config(tmp_path, *COMMON, "job.name=loop")
    calls: list[tuple[int, int]] = []

    def run_step(step_cfg, launch):
        calls.append((step_cfg.pipeline.replicas, step_cfg.pipeline.num_stages))
        if len(calls) == 1:
            resize.write_request(
                step_cfg.run_dir,
                {
                    "num_stages": 2,
                    "num_replicas": 1,
                    "parts": [0, 3, 6],
                    "step": 4,
                    "checkpoint": str(tmp_path / "ck" / "step_4"),
                    "requested_unix_s": 0.0,
                },
            )
        else:
            phases = resize.take_phases(step_cfg.run_dir)
            assert phases is not None
            assert (phases["from_replicas"], phases["to_replicas"]) == (2, 1)
        return StepResult(0)

    shrunk: list[int] = []
    assert (
        supervise(cfg, run_step, lambda c: shrunk.append(c.pipeline.world_size) or 0.0).exit_code
        == 0
    )
    assert calls == [(2, 2), (1, 2)] and shrunk == [2]
    assert "replicas: 1" in Path(cfg.run_dir / "config.yaml").read_text()
