"""The most important property: pipelining changes the speed, never the numbers.

Per-step training losses of the real MPI pipeline (P ranks, 1F1B or GPipe, several microbatch
counts) must equal the single-process, non-pipelined reference within 1e-5 relative (fp32, same
seed). In practice they agree bitwise: the engine chains per-layer gradients in the same order as
one autograd backward, and gradient clipping sums per-layer norms in global layer order.

One ``mpiexec`` launch of 4 ranks trains every case with the library's own trainer
(``Trainer.train``), since rank start-up costs seconds: the 4-stage cases on all four ranks, the
2-stage cases on the two halves of the world at once (each half its own communicator), the
1-stage case on rank 0 alone (``MPI.COMM_SELF``). The ``torch.distributed`` transport runs on
the second half, last (its process group spans that half only). Run as a rank program by the
test (``python -m mpi4py tests/test_pipeline_parity.py OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.pipeline.checkpoint import load_layer, resolve
from dynmo_hpc.pipeline.reference import train_reference
from tests.helpers.jobs import ROOT, assert_losses_close, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

NUM_RANKS = 4

CASES = [
    # (stages, microbatches, schedule)
    (1, 2, "1f1b"),
    (2, 1, "1f1b"),
    (2, 4, "1f1b"),
    (2, 3, "gpipe"),
    (4, 4, "1f1b"),
    (4, 6, "1f1b"),
    (4, 2, "gpipe"),
]


def case_config(out_dir: Path, num_stages: int, num_microbatches: int, schedule: str):
    return tiny_config(
        out_dir,
        f"pipeline.num_stages={num_stages}",
        f"train.num_microbatches={num_microbatches}",
        f"pipeline.schedule={schedule}",
        "train.steps=10",
        f"job.name=parity_{num_stages}_{num_microbatches}_{schedule}",
    )


def params_config(out_dir: Path) -> config_mod.JobConfig:
    return tiny_config(
        out_dir, "pipeline.num_stages=4", "checkpoint.at_end=true", "job.name=params"
    )


def torch_p2p_config(out_dir: Path) -> config_mod.JobConfig:
    return tiny_config(out_dir, "pipeline.num_stages=2", "runtime.p2p=torch", "job.name=p2p_torch")


RUN_ON = {
    # CASES entry -> the communicator of the rank program that trains it
    (1, 2, "1f1b"): "self0",
    (2, 1, "1f1b"): "half0",
    (2, 4, "1f1b"): "half0",
    (2, 3, "gpipe"): "half1",
    (4, 4, "1f1b"): "world",
    (4, 6, "1f1b"): "world",
    (4, 2, "gpipe"): "world",
}


def _runs(out_dir: Path) -> list[tuple[str, config_mod.JobConfig]]:
    """Every run of the rank program, in order, with the communicator it trains on: "world",
    "half0" / "half1" (ranks 0-1 / 2-3), "self0" (rank 0 alone)."""
    runs = [(RUN_ON[case], case_config(out_dir, *case)) for case in CASES]
    runs.append(("world", params_config(out_dir)))
    runs.append(("half1", torch_p2p_config(out_dir)))  # last: it sets up torch.distributed
    return runs


# --------------------------------------------------------------------------------------------
# The rank program
# --------------------------------------------------------------------------------------------


def rank_main(out_dir: Path) -> None:
    from mpi4py import MPI

    from dynmo_hpc.pipeline.trainer import Trainer

    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank // 2, key=world.rank)
    comms = {"world": world, f"half{world.rank // 2}": half}
    if world.rank == 0:
        comms["self0"] = MPI.COMM_SELF
    losses: dict[str, list[float]] = {}
    for key, cfg in _runs(out_dir):
        comm = comms.get(key)
        if comm is None:
            continue
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        result = Trainer(cfg, comm, cfg.run_dir).train()
        if comm.rank == 0:
            losses[cfg.job.name] = list(result.losses)
    gathered = world.gather(losses, root=0)
    if gathered is not None:
        merged = {name: got for part in gathered for name, got in part.items()}
        (out_dir / "losses.json").write_text(json.dumps(merged))


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[float]]]:
    """One ``mpiexec`` launch of the rank program for every run: (its directory, the losses of
    each run by job name)."""
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    out_dir = tmp_path_factory.mktemp("pipeline_parity")
    rank_argv = [sys.executable, "-m", "mpi4py", __file__, str(out_dir)]
    cmd = LocalMpiLauncher().command(LaunchSpec(NUM_RANKS, rank_argv))
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = json.loads((out_dir / "losses.json").read_text())
    assert sorted(losses) == sorted(cfg.job.name for _, cfg in _runs(out_dir))
    return out_dir, losses


@pytest.mark.parametrize(("num_stages", "num_microbatches", "schedule"), CASES)
def test_losses_match_single_process(runs, num_stages, num_microbatches, schedule):
    out_dir, losses = runs
    cfg = case_config(out_dir, num_stages, num_microbatches, schedule)
    reference = train_reference(cfg)
    got = losses[cfg.job.name]
    assert_losses_close(got, reference.losses, rel=1e-5)
    assert got[-1] < got[0], "the model should learn"


def test_final_parameters_match_reference(runs):
    """The checkpoint written by a 4-stage run holds the reference's final weights."""
    out_dir, _ = runs
    cfg = params_config(out_dir)
    reference = train_reference(cfg)
    directory = resolve(cfg.run_dir)[0].path  # the newest checkpoint
    for index, state in reference.state.items():
        saved = load_layer(directory, index)
        assert saved["index"] == index
        for name, tensor in state.items():
            torch.testing.assert_close(saved["module"][name], tensor, rtol=1e-5, atol=1e-7)
        # AdamW moments and step counts are saved with the weights.
        opt_state = saved["optimizer"]["state"]
        assert opt_state and all(float(s["step"]) == cfg.train.steps for s in opt_state.values())


def test_torch_distributed_transport_matches_reference(runs):
    """runtime.p2p=torch (gloo here, NCCL on GPUs) gives the same losses as the reference."""
    out_dir, losses = runs
    cfg = torch_p2p_config(out_dir)
    reference = train_reference(cfg)
    assert_losses_close(losses[cfg.job.name], reference.losses, rel=1e-5)


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
