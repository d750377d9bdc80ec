"""Live migration changes where layers run, never what the network computes.

The same job, once with balancing forced to a new partition every 2 steps and once static, must
produce bitwise-equal per-step losses and final parameters (weights and AdamW state move with
their layer; clipping sums per-layer norms in global order, so the partition does not matter).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dynmo_hpc.pipeline.checkpoint import load_layer, resolve
from dynmo_hpc.runlog import load
from tests.helpers.jobs import run_job, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("num_stages", [2, 4])
def test_forced_migration_is_bitwise_invisible(tmp_path, num_stages):
    common = [
        f"pipeline.num_stages={num_stages}",
        "train.steps=10",
        "checkpoint.at_end=true",
        "balance.interval=2",
    ]
    static_cfg = tiny_config(tmp_path / "static", *common, "balance.algorithm=static")
    moving_cfg = tiny_config(
        tmp_path / "moving", *common, "balance.algorithm=optimal", "balance.force_moves=true"
    )
    static = run_job(static_cfg)
    moving = run_job(moving_cfg)
    assert moving["losses"] == static["losses"]  # bitwise

    log = load(moving_cfg.run_dir / "run.h5")
    migrations = log.events[log.events["kind"] == "migrate"]
    # Reports after steps 1, 3, 5, 7 and 9: every one but the last migrates (after the last
    # step a migration cannot pay back, so none is planned).
    assert len(migrations) == 4, "force_moves should migrate at every report but the last"
    assert migrations["step"].tolist() == [1, 3, 5, 7]
    assert moving["parts"] == migrations["detail"].iloc[-1]["new_parts"]
    # Each report's partition is contiguous, ordered and has no empty stage.
    for step in log.report_steps():
        parts = log.parts_at(step)
        assert parts[0] == 0 and parts[-1] == moving_cfg.model.num_layers
        assert all(b > a for a, b in itertools.pairwise(parts))
    for _, row in migrations.iterrows():
        assert row["detail"]["bytes_moved"] > 0 and row["detail"]["num_moves"] >= 1

    static_dir = resolve(static_cfg.run_dir)[0].path  # the newest checkpoint (step_10)
    moving_dir = resolve(moving_cfg.run_dir)[0].path
    for index in range(moving_cfg.model.num_layers):
        a = load_layer(static_dir, index)
        b = load_layer(moving_dir, index)
        for name, tensor in a["module"].items():
            assert torch.equal(tensor, b["module"][name]), f"layer {index} {name}"
        for pid, state in a["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, b["optimizer"]["state"][pid][key]), (index, pid, key)
