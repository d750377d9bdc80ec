"""The natural job set (``jobs/natural/``): each scheme where its literature puts it, on one model.

What a user who writes their own job would run: a Llama over a trained BPE vocabulary, MoE and
MoD in every other block, pruning over every block ranked globally, freezing front first, CALM's
exit after every block, one sparse-attention density for all layers. The static checks read the
job files (a later edit that moves a scheme where it shows off fails here); the smoke runs train
every job of the set on 2 MPI ranks at a tiny width, with each scheme's timing pulled into the
first steps, and check from the run log that the scheme acted.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli import main
from dynmo_hpc.cli.bench import scheme_jobs
from dynmo_hpc.config.scheme_sections import every_other_block
from dynmo_hpc.runlog import load
from tests.helpers.jobs import ROOT, prepare_small_corpus
from tests.helpers.scheme_jobs import scheme_acted, scheme_events

NATURAL = ROOT / "jobs" / "natural"
SCHEMES = [name for name in scheme_jobs() if name != "plain"]


def _load(name: str) -> config_mod.JobConfig:
    return config_mod.load(NATURAL / scheme_jobs()[name])


def test_the_set_has_a_job_per_scheme_and_the_control_and_nothing_else() -> None:
    assert sorted(p.name for p in NATURAL.glob("*.yaml")) == sorted(scheme_jobs().values())


@pytest.mark.parametrize("name", list(scheme_jobs()))
def test_every_job_trains_the_same_llama_on_a_trained_bpe_vocabulary(name: str) -> None:
    cfg, plain = _load(name), _load("plain")
    assert cfg.model == plain.model and cfg.model.arch == "llama"
    assert cfg.data.tokenizer is not None and cfg.data.tokenizer.train
    assert 8192 <= cfg.data.tokenizer.vocab_size <= 32768
    # The same training; only the step the scheme's steady state starts at is the job's own.
    assert cfg.train == replace(plain.train, steady_state_step=cfg.train.steady_state_step)
    assert cfg.pipeline == plain.pipeline and cfg.balance == plain.balance
    assert cfg.schemes.enabled == ([] if name == "plain" else [name])
    text = (NATURAL / scheme_jobs()[name]).read_text()
    assert text.startswith("# NATURAL SET")


def test_each_scheme_sits_where_its_literature_puts_it() -> None:
    blocks = _load("plain").model.num_blocks
    moe = _load("moe").schemes.moe
    assert moe.layers == every_other_block(blocks) and moe.top_k == 2  # GShard
    assert _load("mod").schemes.mod.layers == every_other_block(blocks)
    assert _load("mod").schemes.mod.capacity == 0.125  # Raposo et al.
    pruning = _load("pruning").schemes.pruning
    assert pruning.layers is None and pruning.scope == "global"
    assert _load("early_exit").schemes.early_exit.layers is None  # CALM: after every block
    freezing = _load("freezing").schemes.freezing
    assert freezing.max_frozen_layers is not None and freezing.max_frozen_layers <= blocks
    sparse = _load("sparse_attention").schemes.sparse_attention
    assert sparse.layers is None and sparse.layer_density is None  # one density for all


TINY_WIDTH = [
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.num_microbatches=4",
    "train.steps=6",
    "train.steady_state_step=null",
    "train.log_interval=1",
    "balance.interval=2",
    "checkpoint.every_steps=0",
    "checkpoint.at_end=false",
]
"""The jobs' own 12 blocks and schemes, at a width a smoke run trains in seconds."""

SOON = {
    "plain": [],
    "pruning": [
        "schemes.pruning.start_step=1",
        "schemes.pruning.end_step=5",
        "schemes.pruning.interval_steps=2",
    ],
    "freezing": [
        "schemes.freezing.start_step=1",
        "schemes.freezing.interval_steps=1",
        "schemes.freezing.threshold=100.0",  # every change counts as small: the prefix grows
    ],
    "early_exit": ["schemes.early_exit.threshold=0.0"],  # every token leaves at block 1
    "moe": [],
    "mod": [],
    "sparse_attention": [
        "schemes.sparse_attention.block_size=8",
        "schemes.sparse_attention.drift_end_step=2",
    ],
}
"""Each scheme's timing pulled into the first of 6 steps."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small corpus tokenized with a 512-token BPE trained on it (the jobs ask for 8192)."""
    return prepare_small_corpus(tmp_path_factory.mktemp("natural"))


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(scheme_jobs()))
def test_every_natural_job_trains_on_two_ranks_and_its_scheme_acts(
    name: str, prepared: Path, tmp_path: Path
) -> None:
    sets = [*TINY_WIDTH, *SOON[name], f"data.path={prepared}", f"job.out_dir={tmp_path}"]
    argv = ["run", str(NATURAL / scheme_jobs()[name])]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 0
    log = load(tmp_path / name / "run.h5")
    assert log.steps["num_stages"].eq(2).all() and len(log.steps) == 6
    meta = json.loads((prepared / "meta.json").read_text())
    assert log.config["model"]["vocab_size"] == meta["vocab_size"]
    if name != "plain":
        assert scheme_acted(name, scheme_events(log.events)), name
