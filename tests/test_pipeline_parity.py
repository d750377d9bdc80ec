"""The most important property: pipelining changes the speed, never the numbers.

Per-step training losses of the real MPI pipeline (P ranks, 1F1B or GPipe, several microbatch
counts) must equal the single-process, non-pipelined reference within 1e-5 relative (fp32, same
seed). In practice they agree bitwise: the engine chains per-layer gradients in the same order as
one autograd backward, and gradient clipping sums per-layer norms in global layer order.

Every run trains in one ``mpiexec`` launch (:mod:`tests.helpers.rank_program`): the 4-stage runs
on all four ranks, the 3-stage run on ranks 0-2, the 2-stage runs on the two halves of the world
at once, the 1-stage run on rank 0 alone. The ``torch.distributed`` transport runs last on the
second half (its process group spans that half). Tied embeddings run on 1 and 2 stages, both
families, and 2 replicas of 2 stages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint.store import load_layer, resolve
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.testing.reference import train_reference
from tests.helpers import rank_program
from tests.helpers.jobs import assert_losses_close, read_result, tiny_config
from tests.helpers.scheme_jobs import SCHEME_OVERRIDES

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
RUN_ON = {
    # CASES entry -> the communicator it trains on (tests/helpers/rank_program.py)
    (1, 2, "1f1b"): "self0",
    (2, 1, "1f1b"): "half0",
    (2, 4, "1f1b"): "half0",
    (2, 3, "gpipe"): "half1",
    (4, 4, "1f1b"): "world",
    (4, 6, "1f1b"): "world",
    (4, 2, "gpipe"): "world",
    (3, 5, "1f1b-slack"): "trio",
}


def case_config(
    out_dir: Path, num_stages: int, num_microbatches: int, schedule: str
) -> config_mod.JobConfig:
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


def llama_config(out_dir: Path) -> config_mod.JobConfig:
    """A Llama with grouped-query attention (2 query heads share 1 key/value head)."""
    return tiny_config(
        out_dir,
        "model.arch=llama",
        "model.num_kv_heads=1",
        "model.rope_theta=500.0",
        "pipeline.num_stages=2",
        "train.steps=10",
        "job.name=parity_llama",
    )


TIED_CASES = [
    # (arch, stages, replicas, communicator)
    ("gpt2", 2, 1, "half1"),
    ("llama", 2, 1, "half0"),
    ("gpt2", 1, 1, "self2"),
    ("gpt2", 2, 2, "world"),
]
TIED_WEIGHT = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}


def tied_config(out_dir: Path, arch: str, num_stages: int, replicas: int) -> config_mod.JobConfig:
    """Tied embeddings, clipping active every step, a checkpoint at the end."""
    return tiny_config(
        out_dir,
        f"model.arch={arch}",
        "model.tie_embeddings=true",
        f"pipeline.num_stages={num_stages}",
        f"pipeline.replicas={replicas}",
        "train.num_microbatches=4",
        "train.steps=8",
        "train.grad_clip=0.05",
        "checkpoint.at_end=true",
        f"job.name=tied_{arch}_{num_stages}x{replicas}",
    )


def tied_freezing_config(out_dir: Path) -> config_mod.JobConfig:
    """Tied gpt2 on 2 stages with freezing that freezes the embedding within the run."""
    return tiny_config(
        out_dir,
        "model.tie_embeddings=true",
        "pipeline.num_stages=2",
        "train.steps=6",
        "checkpoint.at_end=true",
        *SCHEME_OVERRIDES["freezing"],
        "job.name=tied_freezing",
    )


def torch_p2p_config(out_dir: Path) -> config_mod.JobConfig:
    return tiny_config(out_dir, "pipeline.num_stages=2", "runtime.p2p=torch", "job.name=p2p_torch")


def runs(out_dir: Path) -> rank_program.Runs:
    return [
        *[(RUN_ON[case], case_config(out_dir, *case)) for case in CASES],
        ("world", params_config(out_dir)),
        ("half0", llama_config(out_dir)),
        *[(comm, tied_config(out_dir, *case)) for *case, comm in TIED_CASES],
        ("half0", tied_freezing_config(out_dir)),
        ("half1", torch_p2p_config(out_dir)),  # last: it sets up torch.distributed
    ]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the one launch that trained every run."""
    out = tmp_path_factory.mktemp("pipeline_parity")
    rank_program.launch(__file__, out)
    return out


def _losses(cfg: config_mod.JobConfig) -> list[float]:
    losses: list[float] = read_result(cfg.run_dir)["losses"]
    return losses


@pytest.mark.parametrize(("num_stages", "num_microbatches", "schedule"), CASES)
def test_losses_match_single_process(out_dir, num_stages, num_microbatches, schedule):
    cfg = case_config(out_dir, num_stages, num_microbatches, schedule)
    reference = train_reference(cfg)
    losses = _losses(cfg)
    assert_losses_close(losses, reference.losses, rel=1e-5)
    assert losses[-1] < losses[0], "the model should learn"


def test_final_parameters_match_reference(out_dir):
    """The checkpoint written by a 4-stage run holds the reference's final weights."""
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


def test_llama_losses_match_single_process(out_dir):
    """The llama family pipelines with the same numbers as the single-process reference."""
    cfg = llama_config(out_dir)
    reference = train_reference(cfg)
    losses = _losses(cfg)
    assert_losses_close(losses, reference.losses, rel=1e-5)
    assert losses[-1] < losses[0], "the model should learn"


@pytest.mark.parametrize(("arch", "num_stages", "replicas", "comm"), TIED_CASES)
def test_tied_embeddings_match_the_reference_and_stay_bitwise_equal(
    out_dir, arch, num_stages, replicas, comm
):
    """Tied: the first and last stage sum the two copies' gradients (one stage: locally), so
    the losses are the reference's and, after every step, the copies are bitwise equal."""
    cfg = tied_config(out_dir, arch, num_stages, replicas)
    reference = train_reference(cfg)
    assert_losses_close(_losses(cfg), reference.losses, rel=1e-5)
    directory = resolve(cfg.run_dir)[0].path
    last = cfg.model.num_layers - 1
    embedding = load_layer(directory, 0)["module"][TIED_WEIGHT[arch]]
    head = load_layer(directory, last)["module"]["lm_head.weight"]
    assert torch.equal(embedding, head), "the tied copies differ after training"
    torch.testing.assert_close(embedding, reference.state[0][TIED_WEIGHT[arch]])
    initial = build_layer(cfg, 0).get_parameter(TIED_WEIGHT[arch])
    assert not torch.equal(embedding, initial), "the tied weight should have trained"


def test_a_frozen_tied_embedding_still_trains_its_token_table_through_the_head(out_dir):
    """Freezing layer 0 freezes its position table; the tied token table is one parameter with
    the head's and keeps training, on the pipeline as in the reference."""
    cfg = tied_freezing_config(out_dir)
    reference = train_reference(cfg)
    assert_losses_close(_losses(cfg), reference.losses, rel=1e-5)
    directory = resolve(cfg.run_dir)[0].path
    embedding = load_layer(directory, 0)["module"]
    head = load_layer(directory, cfg.model.num_layers - 1)["module"]
    assert bool(embedding["frozen"]), "the embedding should have frozen"
    assert torch.equal(embedding["wte.weight"], head["lm_head.weight"])
    torch.testing.assert_close(embedding["wte.weight"], reference.state[0]["wte.weight"])


def test_torch_distributed_transport_matches_reference(out_dir):
    """runtime.p2p=torch (gloo here, NCCL on GPUs) gives the same losses as the reference."""
    cfg = torch_p2p_config(out_dir)
    reference = train_reference(cfg)
    assert_losses_close(_losses(cfg), reference.losses, rel=1e-5)


if __name__ == "__main__":
    rank_program.train_all(runs(Path(sys.argv[1])))
