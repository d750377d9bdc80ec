"""The stress scheme jobs (``jobs/stress/``) show each scheme's steady state at 2 stages.

They are built to unbalance the uniform split (docs/schemes.md); the natural set, each scheme
where its literature puts it, is checked in ``tests/test_natural_jobs.py``.

DynMo's gain over the static uniform split only exists where the uniform split is out of
balance for most of a run and where the pipeline's fill and drain leave room for it. These
checks read only the job files, so a later edit that brings back 4 microbatches, a late ramp or
an interleaved placement (which each uniform stage sees equally) fails here rather than only in a
bench run.
"""

from __future__ import annotations

import itertools

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance.static import uniform
from dynmo_hpc.cli.bench import scheme_jobs
from dynmo_hpc.config.scheme_sections import every_other_block
from tests.helpers.jobs import ROOT

SCHEME_JOBS = [name for name in scheme_jobs() if name != "plain"]


def _load(name: str) -> config_mod.JobConfig:
    return config_mod.load(ROOT / "jobs" / "stress" / scheme_jobs()[name])


def _blocks_per_stage(cfg: config_mod.JobConfig, blocks: list[int]) -> list[int]:
    """How many of ``blocks`` (global layer indices) each stage of the uniform split holds."""
    parts = uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages)
    return [sum(lo <= b < hi for b in blocks) for lo, hi in itertools.pairwise(parts)]


@pytest.mark.parametrize("name", SCHEME_JOBS)
def test_scheme_job_runs_many_microbatches_and_steps(name: str) -> None:
    cfg = _load(name)
    assert cfg.pipeline.num_stages == 2
    assert cfg.train.num_microbatches >= 16, "the 1F1B fill and drain would hide the imbalance"
    assert 100 <= cfg.train.steps <= 200


def test_ramps_end_early_in_the_run() -> None:
    """Pruning ends by a quarter of the run, sparse attention's drift by a fifth; MoD and early
    exit act from the first step; freezing may start checking from step 5."""
    pruning = _load("pruning")
    assert pruning.schemes.pruning.end_step <= pruning.train.steps // 4
    sparse = _load("sparse_attention")
    assert sparse.schemes.sparse_attention.drift_end_step <= sparse.train.steps // 5
    mod = _load("mod").schemes.mod
    assert mod.initial_capacity is None or mod.anneal_end_step == 0
    assert _load("early_exit").schemes.early_exit.start_step == 0
    assert _load("freezing").schemes.freezing.start_step <= 5


@pytest.mark.parametrize("name", ["moe", "mod"])
def test_moe_and_mod_blocks_are_uneven_across_the_uniform_split(name: str) -> None:
    """Interleaved in every other block, each uniform stage holds as many routed blocks as the
    other and the uniform split stays balanced; the jobs place them unevenly."""
    cfg = _load(name)
    section = cfg.schemes[name]
    blocks = section.layers or (
        every_other_block(cfg.model.num_blocks)
        if name == "mod"
        else list(range(1, cfg.model.num_blocks + 1))
    )
    counts = _blocks_per_stage(cfg, blocks)
    assert max(counts) >= min(counts) + 4, counts
    assert _blocks_per_stage(cfg, every_other_block(cfg.model.num_blocks)) == [4, 4]
