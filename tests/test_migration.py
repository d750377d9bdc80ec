"""Live migration changes where layers run, never what the network computes.

The same job, once with balancing forced to a new partition every 2 steps and once static, must
produce bitwise-equal per-step losses and final parameters (weights and AdamW state move with
their layer; clipping sums per-layer norms in global order, so the partition does not matter).

Every run trains in one ``mpiexec`` launch (:mod:`tests.helpers.rank_program`): the 4-stage pair
on all four ranks, the 2-stage pairs (fp32, then bf16) on the two halves of the world at once,
the one-stage runs on single ranks at once.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint.store import load_layer, resolve
from dynmo_hpc.runlog import load
from tests.helpers import rank_program
from tests.helpers.jobs import read_result, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BALANCERS = ["optimal", "diffusion", "parameters"]


def migration_configs(
    out_dir: Path, num_stages: int, precision: str = "fp32"
) -> tuple[config_mod.JobConfig, ...]:
    """The static and the moving job on ``num_stages`` stages in ``precision``."""
    common = [
        f"pipeline.num_stages={num_stages}",
        "train.steps=10",
        "checkpoint.at_end=true",
        "balance.interval=2",
        f"train.precision={precision}",
    ]
    out = (
        out_dir / f"p{num_stages}"
        if precision == "fp32"
        else out_dir / f"p{num_stages}_{precision}"
    )
    static = tiny_config(out / "static", *common, "balance.algorithm=static")
    moving = tiny_config(
        out / "moving", *common, "balance.algorithm=optimal", "balance.force_moves=true"
    )
    return static, moving


def one_stage_config(out_dir: Path, algorithm: str) -> config_mod.JobConfig:
    return tiny_config(
        out_dir / f"one_{algorithm}",
        "pipeline.num_stages=1",
        f"balance.algorithm={algorithm}",
        "balance.interval=1",
        "train.steps=3",
        "checkpoint.at_end=true",
    )


def runs(out_dir: Path) -> rank_program.Runs:
    static_4, moving_4 = migration_configs(out_dir, 4)
    static_2, moving_2 = migration_configs(out_dir, 2)
    static_bf16, moving_bf16 = migration_configs(out_dir, 2, "bf16")
    one_stage = [(f"self{i}", one_stage_config(out_dir, a)) for i, a in enumerate(BALANCERS)]
    return [
        ("half0", static_2),
        ("half1", moving_2),
        ("half0", static_bf16),
        ("half1", moving_bf16),
        *one_stage,
        ("world", static_4),
        ("world", moving_4),
    ]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the one launch that trained every run."""
    out = tmp_path_factory.mktemp("migration")
    rank_program.launch(__file__, out)
    return out


@pytest.mark.parametrize(("num_stages", "precision"), [(2, "fp32"), (4, "fp32"), (2, "bf16")])
def test_forced_migration_is_bitwise_invisible(out_dir, num_stages, precision):
    static_cfg, moving_cfg = migration_configs(out_dir, num_stages, precision)
    static = read_result(static_cfg.run_dir)
    moving = read_result(moving_cfg.run_dir)
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

    # A step that migrated waited for it: its row is written once the migration is done, and its
    # time (and so its tokens/s) spans the load report and the migration.
    steps = log.steps.set_index("step")
    for _, row in migrations.iterrows():
        step_row = steps.loc[row["step"]]
        assert step_row["wall_s"] >= row["wall_s"], "step logged before its migration ended"
        assert step_row["step_time_s"] >= row["detail"]["seconds"] > 0
    assert steps["step_time_s"].tolist() == moving["step_time_s"]
    tokens_per_s = [moving_cfg.tokens_per_step / t for t in moving["step_time_s"]]
    assert moving["tokens_per_s"] == pytest.approx(tokens_per_s)
    assert steps["tokens_per_s"].tolist() == moving["tokens_per_s"]

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


@pytest.mark.parametrize("algorithm", BALANCERS)
def test_one_stage_trains_with_a_balancer(out_dir, algorithm):
    """One stage has no link to measure (bandwidth inf) and nothing to move: the job trains,
    reports, never migrates, and its checkpoint's run state is strict JSON."""
    cfg = one_stage_config(out_dir, algorithm)
    result = read_result(cfg.run_dir)
    assert result["completed_steps"] == 3 and len(result["losses"]) == 3
    assert result["parts"] == [0, cfg.model.num_layers]
    log = load(cfg.run_dir / "run.h5")
    assert log.report_steps() == [0, 1, 2]
    assert not set(log.events["kind"]) & {"rebalance", "migrate", "error"}
    state_text = (resolve(cfg.run_dir)[0].path / "run_state.json").read_text()

    def refuse(constant):
        raise AssertionError(f"run_state.json holds {constant}, which is not JSON")

    state = json.loads(state_text, parse_constant=refuse)
    assert state["balancer"]["bandwidth_bytes_per_s"] is None
    assert state["balancer"]["num_reports"] == 3


if __name__ == "__main__":
    rank_program.train_all(runs(Path(sys.argv[1])))
