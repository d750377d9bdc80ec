"""benchmarks/sim_scale.py: how a scheme's measured blocks are laid over a deeper model, and one
real replay of a run log at 8 stages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dynmo_hpc.sim.replay import CostReport
from tests.helpers.jobs import ROOT, run_job, tiny_config


def _script() -> ModuleType:
    path = ROOT / "benchmarks" / "sim_scale.py"
    spec = importlib.util.spec_from_file_location("sim_scale", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_scale"] = module
    spec.loader.exec_module(module)
    return module


sim_scale = _script()


def test_periodic_schemes_repeat_and_depth_schemes_stretch() -> None:
    # MoD routes every other block: the pattern must keep its parity when repeated.
    assert sim_scale.source_blocks("mod", 4, 8) == [0, 1, 2, 3, 0, 1, 2, 3]
    # Freezing goes front to back: block j takes the block at the same relative depth.
    assert sim_scale.source_blocks("freezing", 4, 8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sim_scale.source_blocks("early_exit", 3, 4) == [0, 0, 1, 2]


def test_deepen_keeps_embedding_and_head() -> None:
    report = CostReport(
        forward_s=[0.5, 1.0, 2.0, 0.25],
        backward_s=[1.0, 2.0, 4.0, 0.5],
        num_params=[10, 20, 40, 5],
        layer_bytes=[100, 200, 400, 50],
    )
    deep = sim_scale.deepen(report, [0, 1, 1])
    assert deep.forward_s == [0.5, 1.0, 2.0, 2.0, 0.25]
    assert deep.num_params == [10, 20, 40, 40, 5]
    assert deep.layer_bytes == [100, 200, 400, 400, 50]


def test_scheme_of_a_config() -> None:
    assert sim_scale.scheme_of({"schemes": {"moe": None, "mod": {}}}) == "mod"
    assert sim_scale.scheme_of({"schemes": {"moe": None}}) == "plain"


@pytest.mark.mpi
def test_a_real_run_log_replays_at_eight_stages(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "pipeline.num_stages=2", "train.steps=4")
    run_job(cfg)
    rows = sim_scale.simulate_run(cfg.run_dir / "run.h5", [8], 4, 100.0)
    (row,) = rows
    assert row["stages"] == 8 and row["blocks"] == 24 and row["microbatches"] == 32
    assert set(row["tokens_per_s"]) == {"uniform", "megatron", "parameters", "optimal", "diffusion"}
    assert all(v > 0 for v in row["tokens_per_s"].values())
    assert row["paper"] == pytest.approx(float("nan"), nan_ok=True)  # plain: no paper figure
