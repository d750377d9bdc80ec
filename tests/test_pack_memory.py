"""Memory for the packing decision: what a stage may hold (the allocation's limits, not the
hardware's), and what a layer holds on any stage of a smaller pipeline (safe under 1F1B)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynmo_hpc.pipeline.costs import LayerSize, LoadReport
from dynmo_hpc.train import capacity, pack_inputs
from tests.helpers.jobs import tiny_config

GIB = 1 << 30


def test_slurm_mem_per_node_is_megabytes():
    assert capacity.slurm_mem_per_node_bytes({"SLURM_MEM_PER_NODE": "4096"}) == 4 * GIB
    for unset in ({}, {"SLURM_MEM_PER_NODE": ""}, {"SLURM_MEM_PER_NODE": "0"}):
        assert capacity.slurm_mem_per_node_bytes(unset) is None  # --mem=0: the whole node
    assert capacity.slurm_mem_per_node_bytes({"SLURM_MEM_PER_NODE": "4G"}) is None


def test_cgroup_limits_v1_and_v2():
    assert capacity.parse_cgroup_limit("8589934592\n") == 8 * GIB
    assert capacity.parse_cgroup_limit("max\n") is None  # v2: no limit
    assert capacity.parse_cgroup_limit("9223372036854771712\n") is None  # v1: no limit
    assert capacity.parse_cgroup_limit("") is None


def test_cgroup_paths_follow_proc_self_cgroup():
    root = Path("/cg")
    v2 = capacity.cgroup_limit_paths("0::/system.slice/slurmstepd.scope/job_7\n", root)
    assert v2[0] == root / "system.slice/slurmstepd.scope/job_7/memory.max"
    v1 = capacity.cgroup_limit_paths("4:memory:/slurm/uid_0/job_7\n3:cpuset:/\n", root)
    assert v1[0] == root / "memory/slurm/uid_0/job_7/memory.limit_in_bytes"
    assert root / "memory.max" in v1  # a container sees its own group at the root


def test_the_first_readable_cgroup_file_decides():
    files = {
        Path("/proc/self/cgroup"): "0::/job_7\n",
        Path("/sys/fs/cgroup/job_7/memory.max"): "2147483648\n",
        Path("/sys/fs/cgroup/memory.max"): "max\n",
    }

    def read(path: Path) -> str:
        if path not in files:
            raise FileNotFoundError(path)
        return files[path]

    assert capacity.read_cgroup_limit_bytes(read) == 2 * GIB
    del files[Path("/sys/fs/cgroup/job_7/memory.max")]
    assert capacity.read_cgroup_limit_bytes(read) is None  # "max" at the root: no limit
    files.clear()
    assert capacity.read_cgroup_limit_bytes(read) is None


def test_host_capacity_is_the_tightest_limit_shared_by_the_ranks():
    assert capacity.host_capacity_bytes(64 * GIB, 4) == 16 * GIB
    assert capacity.host_capacity_bytes(64 * GIB, 4, slurm_mem_bytes=8 * GIB) == 2 * GIB
    assert (
        capacity.host_capacity_bytes(64 * GIB, 2, slurm_mem_bytes=8 * GIB, cgroup_limit_bytes=GIB)
        == GIB / 2
    )


def test_device_capacity_keeps_a_headroom():
    # 80 GiB device, 30 GiB free, this stage holds 10 GiB: 40 GiB less 8 GiB headroom
    assert capacity.device_capacity_bytes(30 * GIB, 80 * GIB, 10 * GIB) == 32 * GIB
    assert capacity.device_capacity_bytes(1 * GIB, 80 * GIB, 0) == 0.0


def test_stage_capacity_reads_the_allocation(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path)
    assert cfg.balance.capacity_bytes is None
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "1024")  # 1 GiB, far below any machine's RAM
    monkeypatch.setattr(capacity, "read_cgroup_limit_bytes", lambda: None)
    cpu = pack_inputs.stage_capacity_bytes(cfg, torch.device("cpu"), 4)
    assert cpu == GIB / 4
    # a GPU: its free memory plus this stage's reserve, less 10 % of the total (faked)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * GIB)
    assert pack_inputs.stage_capacity_bytes(cfg, torch.device("cuda", 0), 1) == 32 * GIB


def _report(state_bytes, peaks):
    sizes = [LayerSize(1, b, 0, 0) for b in state_bytes]
    n = len(state_bytes)
    return LoadReport(
        step=4, forward_s=[0.0] * n, backward_s=[0.0] * n, sizes=sizes, peak_mem_bytes=peaks
    )


def test_layer_memory_divides_a_stage_peak_by_the_microbatches_it_held():
    # 4 stages of 2 layers (100 bytes of state each), M = 8, 1F1B: stage s held 4 - s
    # microbatches, each stage's peak is 200 + 40 * (4 - s): 40 bytes a microbatch, 20 a layer
    report = _report([100] * 8, [200 + 40 * (4 - s) for s in range(4)])
    memory = pack_inputs.layer_memory(report, [0, 2, 4, 6, 8], 8, "1f1b")
    assert memory.fixed_bytes == [100.0] * 8
    assert memory.activation_bytes == pytest.approx([20.0] * 8)
    # GPipe: every stage held all 8
    gpipe = pack_inputs.layer_memory(report, [0, 2, 4, 6, 8], 8, "gpipe")
    assert gpipe.activation_bytes[-1] == pytest.approx(40 / 8 / 2)


def test_a_last_stage_layer_moved_to_stage_0_is_priced_at_p_microbatches():
    """The last stage of 4 held 1 microbatch; on 3 stages its layer may land on stage 0, which
    holds 3: the estimate must cover 3 (scaling the stage's peak, as main did, covers 1)."""
    report = _report([100] * 8, [200 + 40 * (4 - s) for s in range(4)])
    memory = pack_inputs.layer_memory(report, [0, 2, 4, 6, 8], 8, "1f1b")
    from dynmo_hpc.balance.packing import layer_memory_at, microbatches_in_flight

    in_flight = microbatches_in_flight(3, 8, "1f1b")
    priced = layer_memory_at(memory.fixed_bytes, memory.activation_bytes, in_flight)
    assert in_flight == 3 and priced[-1] == pytest.approx(100 + 3 * 20)
    main_estimate = 100 * max(1.0, 240 / 200)  # state x the last stage's peak / state
    assert priced[-1] > main_estimate


def test_a_changed_num_microbatches_keeps_the_pack_decision_running(tmp_path):
    """Issue 42, defect 3: a checkpoint of a 4-replica job carries ``original_replicas=4``;
    resumed with an accepted ``train.num_microbatches=6`` on 2 replicas, the next pack decision
    raised ``ValueError original_replicas=4 must ... divide num_microbatches=6``. The reference
    size becomes the largest runnable one (3 replicas)."""
    cfg = tiny_config(
        tmp_path,
        "pipeline.replicas=2",
        "train.num_microbatches=6",
        "elastic.enabled=true",
        "elastic.interval=1",
        "train.steps=20",
    )
    packer = pack_inputs.PackController(cfg, world_size=4, num_nodes=1, device=torch.device("cpu"))
    packer.restore({"original_stages": 2, "original_replicas": 4, "correction": 1.0})
    assert packer.history.original_replicas == 3
    report = _report([100] * 6, [1000, 1000])
    plan = packer.consider(
        report,
        [0.1] * 6,
        [0, 3, 6],
        bandwidth_bytes_per_s=1e9,
        measured_step_s=1.0,
    )
    assert plan is not None and plan.candidates
    assert pack_inputs.runnable_replicas(4, 1, 5) == 1
    assert pack_inputs.runnable_replicas(2, 2, 6) == 2
