"""With each scheme on, the real MPI pipeline's per-step losses equal the single-process run.

Every scheme changes the work (routing, shrinking, freezing, skipping blocks and tokens) and some
make discrete, data-dependent decisions (top-k routes, exits, kept attention blocks, which
structures to prune, when to freeze). Those decisions must come out the same on every partition:
the losses of 2 and 4 real ranks must match ``train_reference`` within 1e-5 relative. The
overrides (``SCHEME_OVERRIDES`` in ``tests/helpers/scheme_jobs.py``) make each mechanism act
within the four steps; the run log's ``scheme_stats`` events confirm that it did.

Every run trains in one ``mpiexec`` launch (:mod:`tests.helpers.rank_program`): each 4-stage run
on all four ranks, the 2-stage runs on the two halves of the world at once. The llama family
runs each scheme it supports on 2 stages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.schemes import BUILTIN_SCHEMES
from dynmo_hpc.runlog import load
from dynmo_hpc.testing.reference import train_reference
from tests.helpers import rank_program
from tests.helpers.jobs import assert_losses_close, read_result
from tests.helpers.scheme_jobs import (
    LLAMA,
    arch_schemes,
    scheme_acted,
    scheme_config,
    scheme_events,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BUILTIN_NAMES = [scheme.name for scheme in BUILTIN_SCHEMES]
"""Every built-in scheme, from the registry (a new one needs its SCHEME_OVERRIDES entry)."""


def case_config(out_dir: Path, scheme: str, num_stages: int) -> config_mod.JobConfig:
    return scheme_config(
        out_dir, scheme, f"pipeline.num_stages={num_stages}", f"job.name={scheme}_{num_stages}"
    )


LLAMA_NAMES = arch_schemes("llama")
"""The schemes the llama family supports (each with its pipeline parity run on 2 stages)."""


def llama_config(out_dir: Path, scheme: str) -> config_mod.JobConfig:
    return scheme_config(
        out_dir, scheme, *LLAMA, "pipeline.num_stages=2", f"job.name=llama_{scheme}"
    )


def runs(out_dir: Path) -> rank_program.Runs:
    on_world = [("world", case_config(out_dir, scheme, 4)) for scheme in BUILTIN_NAMES]
    on_halves = [
        (f"half{i % 2}", case_config(out_dir, scheme, 2)) for i, scheme in enumerate(BUILTIN_NAMES)
    ]
    on_halves_llama = [
        (f"half{i % 2}", llama_config(out_dir, scheme)) for i, scheme in enumerate(LLAMA_NAMES)
    ]
    return [*on_world, *on_halves, *on_halves_llama]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the one launch that trained every run."""
    out = tmp_path_factory.mktemp("schemes_parity")
    rank_program.launch(__file__, out)
    return out


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("scheme", BUILTIN_NAMES)
def test_scheme_losses_match_single_process(out_dir, scheme, num_stages):
    cfg = case_config(out_dir, scheme, num_stages)
    reference = train_reference(cfg)
    result = read_result(cfg.run_dir)
    assert_losses_close(result["losses"], reference.losses, rel=1e-5)
    events = scheme_events(load(cfg.run_dir / "run.h5").events)
    assert scheme_acted(scheme, events), f"{scheme} did not act in the parity run: {events}"


@pytest.mark.parametrize("scheme", LLAMA_NAMES)
def test_llama_scheme_losses_match_single_process(out_dir, scheme):
    cfg = llama_config(out_dir, scheme)
    reference = train_reference(cfg)
    result = read_result(cfg.run_dir)
    assert_losses_close(result["losses"], reference.losses, rel=1e-5)
    events = scheme_events(load(cfg.run_dir / "run.h5").events)
    assert scheme_acted(scheme, events), f"{scheme} did not act on llama: {events}"


if __name__ == "__main__":
    rank_program.train_all(runs(Path(sys.argv[1])))
