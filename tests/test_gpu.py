"""The GPU tier: the same promises on CUDA (left out of a run where torch sees no GPU: conftest).

Pipeline parity with the single-process reference, migration bitwise-invisible, one dynamic
scheme training through migrations, and a 2-rank migration benchmark. With one GPU both ranks
share it, so p2p goes over MPI with host staging (NCCL refuses two ranks on one device); with
two or more, over NCCL (``runtime.p2p=torch``, batched sends).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dynmo_hpc.checkpoint.store import load_layer, resolve
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import ROOT, assert_losses_close, run_job, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    """Asked for by DYNMO_GPU_TIER=1 on a machine without a GPU: fail, do not pretend."""
    assert torch.cuda.is_available(), (
        "no CUDA device visible to torch (CPU build or no GPU); the GPU tier needs one"
    )


def _gpu(*overrides: str) -> list[str]:
    p2p = "torch" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "mpi"
    return ["runtime.device=cuda", f"runtime.p2p={p2p}", *overrides]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gpu_pipeline_matches_reference(tmp_path, schedule):
    cfg = tiny_config(
        tmp_path, *_gpu("pipeline.num_stages=2", f"pipeline.schedule={schedule}", "train.steps=6")
    )
    result = run_job(cfg)
    reference = train_reference(cfg)  # the reference runs on CPU: fp32 agreement, not bitwise
    assert_losses_close(result["losses"], reference.losses, rel=1e-4)


def test_gpu_migration_is_bitwise_invisible(tmp_path):
    common = _gpu("pipeline.num_stages=2", "train.steps=8", "checkpoint.at_end=true")
    static_cfg = tiny_config(tmp_path / "static", *common)
    moving_cfg = tiny_config(
        tmp_path / "moving", *common, "balance.algorithm=optimal", "balance.force_moves=true"
    )
    static, moving = run_job(static_cfg), run_job(moving_cfg)
    assert moving["losses"] == static["losses"]
    assert moving["parts"] != static["parts"]
    a_dir, b_dir = resolve(static_cfg.run_dir)[0].path, resolve(moving_cfg.run_dir)[0].path
    for index in range(moving_cfg.model.num_layers):
        a, b = load_layer(a_dir, index), load_layer(b_dir, index)
        for name, tensor in a["module"].items():
            assert torch.equal(tensor, b["module"][name]), (index, name)
        for pid, state in a["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, b["optimizer"]["state"][pid][key]), (index, pid, key)


def test_gpu_dynamic_scheme_trains_through_migrations(tmp_path):
    cfg = tiny_config(
        tmp_path,
        *_gpu("pipeline.num_stages=2", "train.steps=8", "balance.algorithm=optimal"),
        "balance.force_moves=true",
        job="jobs/stress/early_exit.yaml"
        if (ROOT / "jobs/stress/early_exit.yaml").exists()
        else "jobs/default.yaml",
    )
    result = run_job(cfg)
    assert len(result["losses"]) == 8 and all(v == v for v in result["losses"])


def test_gpu_migration_bench_runs(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_migration.py"), "--reps", "3"]
    cmd += ["--device", "cuda", "--json", str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["d_model"] for r in rows] == [256, 512, 1024]
    assert all(r["migrate_s"] > 0 and r["migrate_ratio_median"] > 0 for r in rows)
    print(proc.stdout)
