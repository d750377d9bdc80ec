"""Data parallel x pipeline, the pure parts: which rank is which stage of which replica, how the
replicas split a step's microbatches, the gradient buckets, the load report over replicas, the
config rules, the SLURM allocation and the run log's per-replica stage times (no MPI here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.pipeline.costs import LayerSize, RankReport, assemble_load_report
from dynmo_hpc.pipeline.grad_sync import plan_buckets
from dynmo_hpc.pipeline.topology import (
    Topology,
    check_world,
    nodes_of_replica,
    rank_of,
    replica_microbatches,
)
from dynmo_hpc.runlog import load, metrics
from dynmo_hpc.runlog.writer import RunLogWriter
from dynmo_hpc.slurm.submit import executor_parameters, sbatch_parameters_for
from tests.helpers.jobs import ROOT, TINY


def _cfg(*overrides: str) -> config_mod.JobConfig:
    return config_mod.load(ROOT / "jobs/default.yaml", [*TINY, *overrides])


# --- the rank grid ------------------------------------------------------------------------------


def test_every_rank_is_one_stage_of_one_replica() -> None:
    num_stages, num_replicas = 3, 2
    seen = set()
    for rank in range(num_stages * num_replicas):
        topo = Topology(world_size=6, rank=rank, num_stages=num_stages, num_replicas=num_replicas)
        assert rank_of(topo.replica, topo.stage, num_stages) == rank
        assert topo.pipeline_ranks[topo.stage] == rank
        assert topo.data_ranks[topo.replica] == rank
        assert topo.writes_layers == (topo.replica == 0)
        seen.add((topo.replica, topo.stage))
    assert seen == {(r, s) for r in range(2) for s in range(3)}
    # a replica's stages are consecutive ranks; a stage's copies are P apart
    topo = Topology(world_size=6, rank=4, num_stages=3, num_replicas=2)
    assert (topo.replica, topo.stage) == (1, 1)
    assert topo.pipeline_ranks == [3, 4, 5]
    assert topo.data_ranks == [1, 4]


def test_one_replica_is_the_pipeline_as_before() -> None:
    for rank in range(4):
        topo = Topology(world_size=4, rank=rank, num_stages=4, num_replicas=1)
        assert (topo.replica, topo.stage) == (0, rank)
        assert topo.data_ranks == [rank]
        assert list(topo.microbatches(8)) == list(range(8))


def test_a_world_of_the_wrong_size_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"MPI world size \(4\) != pipeline.replicas\(2\) \* "):
        check_world(4, 3, 2)
    with pytest.raises(ConfigError, match="HINT: launch with -n 6"):
        Topology(world_size=4, rank=0, num_stages=3, num_replicas=2)
    with pytest.raises(ValueError, match="outside"):
        Topology(world_size=4, rank=4, num_stages=2, num_replicas=2)


def test_the_replicas_split_the_global_batch_exactly() -> None:
    for num_replicas, num_microbatches in [(1, 4), (2, 4), (2, 6), (3, 6), (4, 4)]:
        blocks = [
            list(replica_microbatches(r, num_replicas, num_microbatches))
            for r in range(num_replicas)
        ]
        assert [mb for block in blocks for mb in block] == list(range(num_microbatches))
        assert {len(block) for block in blocks} == {num_microbatches // num_replicas}
    with pytest.raises(ConfigError, match=r"not divisible by pipeline\.replicas"):
        replica_microbatches(0, 4, 6)


def test_block_placement_keeps_a_replica_on_few_nodes() -> None:
    # one replica per node when a node holds a whole pipeline
    assert [nodes_of_replica(r, 2, 2) for r in range(2)] == [[0], [1]]
    # a pipeline longer than a node spans the fewest nodes it can
    assert [nodes_of_replica(r, 4, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [nodes_of_replica(r, 3, 2) for r in range(2)] == [[0, 1], [1, 2]]
    # one rank per node (SLURM's default here): a replica spans P nodes
    assert nodes_of_replica(1, 3, 1) == [3, 4, 5]


# --- gradient buckets ---------------------------------------------------------------------------


def test_buckets_hold_whole_consecutive_layers() -> None:
    assert plan_buckets([10, 10, 30, 5], 20) == [[0, 1], [2], [3]]
    assert plan_buckets([], 20) == []
    assert plan_buckets([5, 5, 5], 100) == [[0, 1, 2]]
    sizes = [7, 3, 12, 1, 1, 40, 2]
    buckets = plan_buckets(sizes, 12)
    assert [pos for bucket in buckets for pos in bucket] == list(range(len(sizes)))
    for bucket in buckets:
        assert len(bucket) == 1 or sum(sizes[p] for p in bucket) <= 12


# --- the load report over replicas --------------------------------------------------------------


def _rank(layers: dict[int, float], mem: int) -> RankReport:
    return RankReport(
        forward_s=dict(layers),
        backward_s={i: 2 * v for i, v in layers.items()},
        sizes={i: LayerSize(10 * (i + 1), 40, 40, 80) for i in layers},
        peak_mem_bytes=mem,
    )


def test_a_layer_costs_what_its_slowest_replica_measured() -> None:
    ranks = [
        _rank({0: 1.0, 1: 1.0}, 100),  # replica 0, stage 0
        _rank({2: 3.0}, 200),  # replica 0, stage 1
        _rank({0: 1.5, 1: 0.5}, 150),  # replica 1, stage 0
        _rank({2: 2.0}, 120),  # replica 1, stage 1
    ]
    report = assemble_load_report(7, 3, ranks, num_replicas=2)
    assert report.forward_s == [1.5, 1.0, 3.0]
    assert report.backward_s == [3.0, 2.0, 6.0]
    assert report.peak_mem_bytes == [150, 200]
    assert report.num_params == [10, 20, 30]
    # one replica: as before, peak memory per stage
    single = assemble_load_report(7, 3, ranks[:2])
    assert single.forward_s == [1.0, 1.0, 3.0] and single.peak_mem_bytes == [100, 200]


def test_a_replica_that_disagrees_about_the_partition_stops_the_report() -> None:
    ranks = [_rank({0: 1.0}, 1), _rank({1: 1.0, 2: 1.0}, 1)]
    ranks += [_rank({0: 1.0, 1: 1.0}, 1), _rank({1: 1.0, 2: 1.0}, 1)]
    with pytest.raises(RuntimeError, match="layer 1 reported by rank 3 and rank 2"):
        assemble_load_report(0, 3, ranks, num_replicas=2)
    with pytest.raises(RuntimeError, match=r"no rank of ranks 2..3 reported layers \[0\]"):
        assemble_load_report(0, 3, [*ranks[:2], _rank({}, 1), ranks[3]], num_replicas=2)
    with pytest.raises(ValueError, match="do not split into 2 replicas"):
        assemble_load_report(0, 3, ranks[:3], num_replicas=2)


# --- config -------------------------------------------------------------------------------------


def test_replicas_default_to_one_and_multiply_the_world() -> None:
    assert _cfg().pipeline.replicas == 1
    cfg = _cfg("pipeline.replicas=2", "pipeline.num_stages=3", "train.num_microbatches=6")
    assert cfg.pipeline.world_size == 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pipeline.replicas=0"], r"pipeline.replicas=0 must be >= 1"),
        (
            ["pipeline.replicas=3", "train.num_microbatches=4"],
            r"train.num_microbatches\(4\) is not divisible by pipeline.replicas\(3\).*"
            r"HINT: set train.num_microbatches to a multiple of 3 \(e.g. 3\)",
        ),
        (
            ["pipeline.replicas=2", "fault.inject_step=1", "fault.inject_rank=4"],
            r"fault.inject_rank=4 is not a rank of the job's 4 ranks.*HINT: pick 0..3",
        ),
    ],
)
def test_bad_replica_settings_name_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(*overrides)
    assert "HINT:" in str(info.value) or "must be >= 1" in str(info.value)


def test_a_fault_may_target_a_rank_of_the_second_replica() -> None:
    cfg = _cfg("pipeline.replicas=2", "fault.inject_step=1", "fault.inject_rank=3")
    assert cfg.fault.inject_rank == 3


# --- SLURM: the allocation asks for R x P tasks (text only, no cluster) ---------------------------


def test_sbatch_and_submitit_ask_for_every_replicas_ranks() -> None:
    cfg = _cfg("pipeline.replicas=2", "pipeline.num_stages=2")
    assert sbatch_parameters_for(cfg, Path("c.yaml"))["nodes"] == 4
    params = executor_parameters(cfg)
    assert params["nodes"] * params["ntasks_per_node"] == 4
    packed = _cfg(
        "pipeline.replicas=2", "pipeline.num_stages=2", "slurm.nodes=2", "slurm.tasks_per_node=2"
    )
    assert sbatch_parameters_for(packed, Path("c.yaml"))["nodes"] == 2
    with pytest.raises(ConfigError, match=r"= 2 < pipeline.replicas\(2\) \* pipeline.num_stages"):
        _cfg("pipeline.replicas=2", "pipeline.num_stages=2", "slurm.nodes=2")


# --- the run log: per-replica stage times -------------------------------------------------------


def test_stage_times_record_each_replica_and_the_slowest_sets_the_imbalance(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.h5"
    with RunLogWriter(path, config_yaml="{}", meta={"num_replicas": 2}) as w:
        # ranks 0, 1: replica 0's stages; ranks 2, 3: replica 1's
        w.log_stage_times(
            step=0,
            compute_s=[1.0, 2.0, 3.0, 1.0],
            idle_s=[0.1, 0.2, 0.3, 0.4],
            num_replicas=2,
            allreduce_s=[0.01, 0.02, 0.03, 0.04],
        )
        w.log_stage_times(step=1, compute_s=[1.0, 1.0], idle_s=[0.0, 0.0])
        with pytest.raises(ValueError, match="do not split into 2 replicas"):
            w.log_stage_times(step=2, compute_s=[1.0] * 3, idle_s=[0.0] * 3, num_replicas=2)
    st = load(path).stage_times
    step0 = st[st["step"] == 0]
    assert step0["replica"].tolist() == [0, 0, 1, 1]
    assert step0["stage"].tolist() == [0, 1, 0, 1]
    assert step0["allreduce_s"].tolist() == [0.01, 0.02, 0.03, 0.04]
    assert math.isnan(st[st["step"] == 1]["allreduce_s"].iloc[0])
    imb = metrics.imbalance(st).set_index("step")
    # per stage, the slowest replica: stage 0 = 3.0, stage 1 = 2.0
    assert imb.loc[0, "num_stages"] == 2
    assert imb.loc[0, "max_compute_s"] == 3.0
    assert imb.loc[0, "imbalance"] == pytest.approx(3.0 / 2.5)


def test_gradients_round_trip_through_the_buckets_and_missing_ones_become_zeros() -> None:
    """The flat-buffer path on one rank (a sum over one replica is the identity): every
    gradient comes back in place, across buckets; a parameter another replica has a gradient
    for gets zeros here, one nobody has keeps None."""
    from types import SimpleNamespace

    import torch
    from mpi4py import MPI

    from dynmo_hpc.pipeline.grad_sync import GradReducer, _pack, _unpack

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)]
    for layer in layers[:2]:
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
    slots = [SimpleNamespace(index=i, module=m) for i, m in enumerate(layers)]
    want = [[p.grad.clone() for p in m.parameters()] for m in layers[:2]]
    reducer = GradReducer(MPI.COMM_SELF, slots, bucket_bytes=40)  # several buckets
    reducer.active = True  # COMM_SELF: run the real path, a sum over one rank
    sync = reducer.finish()
    assert sync.num_buckets == 3 and sync.started_in_backward == 0
    for layer, expected in zip(layers[:2], want, strict=True):
        for p, g in zip(layer.parameters(), expected, strict=True):
            assert torch.equal(p.grad, g)
    assert layers[2].weight.grad is None and layers[2].bias.grad is None  # none anywhere
    # layer 2: its weight has a gradient on another replica (the MAX says so), its bias on none
    bucket = _pack(list(layers[2].parameters()))
    assert bucket.has_grad.tolist() == [0, 0]
    bucket.has_grad[0] = 1
    _unpack(bucket)
    assert torch.equal(layers[2].weight.grad, torch.zeros_like(layers[2].weight))
    assert layers[2].bias.grad is None


def test_buckets_start_as_the_last_backward_finalises_their_layers() -> None:
    """The backward runs positions last to first; a bucket is ready once all its layers are."""
    from dynmo_hpc.pipeline.grad_sync import ready_buckets

    buckets = plan_buckets([10, 10, 30, 5], 20)  # [[0, 1], [2], [3]]
    final: set[int] = set()
    ready_after = []
    for pos in (3, 2, 1, 0):
        final.add(pos)
        ready_after.append(ready_buckets(buckets, final))
    assert ready_after == [[2], [1, 2], [1, 2], [0, 1, 2]]
    # one bucket holding everything starts only after the first layer: no overlap
    assert ready_buckets([[0, 1, 2]], {1, 2}) == []


def test_the_reducer_starts_buckets_during_the_backward_on_one_rank() -> None:
    """Driving ``layer_final`` as the last backward does starts each bucket once, in the same
    order on every replica; ``finish`` starts the rest (layers the backward never reached)."""
    from types import SimpleNamespace

    import torch
    from mpi4py import MPI

    from dynmo_hpc.pipeline.grad_sync import GradReducer

    layers = [torch.nn.Linear(2, 2) for _ in range(4)]
    for layer in layers:
        for p in layer.parameters():
            p.grad = torch.ones_like(p)
    slots = [SimpleNamespace(index=i, module=m) for i, m in enumerate(layers)]
    reducer = GradReducer(MPI.COMM_SELF, slots, bucket_bytes=24)  # one layer (24 B) per bucket
    reducer.active = True
    for pos in (3, 2):  # the backward stops above layer 2 (no_grad_below)
        reducer.layer_final(pos)
    assert sorted(reducer.posted) == [2, 3]
    sync = reducer.finish()
    assert (sync.num_buckets, sync.started_in_backward) == (4, 2)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for m in layers for p in m.parameters())


def test_the_bucket_size_must_be_positive() -> None:
    from dynmo_hpc.config.sections import PipelineSection

    PipelineSection(grad_bucket_mb=0.5).validate()
    for bad in (0.0, -1.0, float("nan"), 1e6):
        with pytest.raises(ConfigError, match=r"pipeline\.grad_bucket_mb"):
            PipelineSection(grad_bucket_mb=bad).validate()


def test_the_replica_count_may_change_on_resume() -> None:
    from dynmo_hpc.config.resume_rules import KeyRule, classify

    assert classify("pipeline.replicas") is KeyRule.FREE


def test_only_a_rank_that_writes_layers_puts_them_in_the_checkpoint(tmp_path: Path) -> None:
    """Replica 0 writes each layer; a rank of another replica (``writes_layers=False``) holds
    the same layers and writes none (one rank here, ``COMM_SELF``)."""
    from types import SimpleNamespace

    import torch
    from mpi4py import MPI

    from dynmo_hpc.checkpoint import resume, store

    module = torch.nn.Linear(2, 2)
    slot = SimpleNamespace(index=0, module=module, optimizer=torch.optim.AdamW(module.parameters()))
    stage = SimpleNamespace(slots=[slot])
    for writes, run_dir in [(True, tmp_path / "r0"), (False, tmp_path / "r1")]:
        directory, _, _ = resume.save(
            MPI.COMM_SELF, run_dir, 1, stage, 2, {"step": 1}, writes_layers=writes
        )
        names = set(store.manifest_files(directory))
        layer = store.layer_name(0)
        assert (layer in names) == writes and (directory / layer).exists() == writes
        assert store.RUN_STATE in names
