"""The most important property: pipelining changes the speed, never the numbers.

Per-step training losses of the real MPI pipeline (P ranks, 1F1B or GPipe, several microbatch
counts) must equal the single-process, non-pipelined reference within 1e-5 relative (fp32, same
seed). In practice they agree bitwise: the engine chains per-layer gradients in the same order as
one autograd backward, and gradient clipping sums per-layer norms in global layer order.
"""

from __future__ import annotations

import pytest
import torch

from dynmo_hpc.pipeline.checkpoint import load_layer, resolve
from dynmo_hpc.pipeline.reference import train_reference
from tests.helpers.jobs import assert_losses_close, run_job, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

CASES = [
    # (stages, microbatches, schedule)
    (1, 2, "1f1b"),
    (2, 1, "1f1b"),
    (2, 4, "1f1b"),
    (2, 3, "gpipe"),
    (4, 4, "1f1b"),
    (4, 6, "1f1b"),
    (4, 2, "gpipe"),
    (3, 5, "1f1b-slack"),
]


@pytest.mark.parametrize(("num_stages", "num_microbatches", "schedule"), CASES)
def test_losses_match_single_process(tmp_path, num_stages, num_microbatches, schedule):
    cfg = tiny_config(
        tmp_path,
        f"pipeline.num_stages={num_stages}",
        f"train.num_microbatches={num_microbatches}",
        f"pipeline.schedule={schedule}",
        "train.steps=10",
        f"job.name=parity_{num_stages}_{num_microbatches}_{schedule}",
    )
    reference = train_reference(cfg)
    result = run_job(cfg)
    assert_losses_close(result["losses"], reference.losses, rel=1e-5)
    assert result["losses"][-1] < result["losses"][0], "the model should learn"


def test_final_parameters_match_reference(tmp_path):
    """The checkpoint written by a 4-stage run holds the reference's final weights."""
    cfg = tiny_config(
        tmp_path, "pipeline.num_stages=4", "checkpoint.at_end=true", "job.name=params"
    )
    reference = train_reference(cfg)
    run_job(cfg)
    directory = resolve(cfg.run_dir)[0].path  # the newest checkpoint
    for index, state in reference.state.items():
        saved = load_layer(directory, index)
        assert saved["index"] == index
        for name, tensor in state.items():
            torch.testing.assert_close(saved["module"][name], tensor, rtol=1e-5, atol=1e-7)
        # AdamW moments and step counts are saved with the weights.
        opt_state = saved["optimizer"]["state"]
        assert opt_state and all(float(s["step"]) == cfg.train.steps for s in opt_state.values())


def test_torch_distributed_transport_matches_reference(tmp_path):
    """runtime.p2p=torch (gloo here, NCCL on GPUs) gives the same losses as the reference."""
    cfg = tiny_config(tmp_path, "pipeline.num_stages=2", "runtime.p2p=torch", "job.name=p2p_torch")
    reference = train_reference(cfg)
    result = run_job(cfg)
    assert_losses_close(result["losses"], reference.losses, rel=1e-5)
