"""With each scheme on, the real MPI pipeline's per-step losses equal the single-process run.

Every scheme changes the work (routing, shrinking, freezing, skipping blocks and tokens) and some
make discrete, data-dependent decisions (top-k routes, exits, kept attention blocks, which
structures to prune, when to freeze). Those decisions must come out the same on every partition:
the losses of 2 and 4 real ranks must match ``train_reference`` within 1e-5 relative. The
overrides (``SCHEME_OVERRIDES`` in ``tests/helpers/scheme_jobs.py``) make each mechanism act
within the four steps; the run log's ``scheme_stats`` events confirm that it did.

One ``mpiexec`` launch of 4 ranks runs every case with the library's own trainer
(``Trainer.train``), since rank start-up costs seconds: each 4-stage case on all four ranks, the
2-stage cases on the two halves of the world at once (each half its own communicator, with half
of the schemes). Run as a rank program by the test
(``python -m mpi4py tests/test_schemes_parity.py OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.model.schemes import BUILTIN_SCHEMES
from dynmo_hpc.pipeline.reference import train_reference
from dynmo_hpc.runlog import load
from tests.helpers.jobs import ROOT, assert_losses_close
from tests.helpers.scheme_jobs import scheme_acted, scheme_config, scheme_events

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BUILTIN_NAMES = [scheme.name for scheme in BUILTIN_SCHEMES]
"""Every built-in scheme, from the registry (a new one needs its SCHEME_OVERRIDES entry)."""

NUM_RANKS = 4
STAGE_COUNTS = (2, 4)


def case_config(out_dir: Path, scheme: str, num_stages: int) -> config_mod.JobConfig:
    return scheme_config(
        out_dir, scheme, f"pipeline.num_stages={num_stages}", f"job.name={scheme}_{num_stages}"
    )


# --------------------------------------------------------------------------------------------
# The rank program
# --------------------------------------------------------------------------------------------


def rank_main(out_dir: Path) -> None:
    from mpi4py import MPI

    from dynmo_hpc.pipeline.trainer import Trainer

    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank // 2, key=world.rank)
    runs = [(world, scheme, NUM_RANKS) for scheme in BUILTIN_NAMES]
    runs += [(half, scheme, 2) for scheme in BUILTIN_NAMES[world.rank // 2 :: 2]]
    losses: dict[str, list[float]] = {}
    for comm, scheme, num_stages in runs:
        cfg = case_config(out_dir, scheme, num_stages)
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
    """One ``mpiexec`` launch of the rank program for every case: (its directory, the losses
    of each run by job name)."""
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    out_dir = tmp_path_factory.mktemp("schemes_parity")
    rank_argv = [sys.executable, "-m", "mpi4py", __file__, str(out_dir)]
    cmd = LocalMpiLauncher().command(LaunchSpec(NUM_RANKS, rank_argv))
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_dir, json.loads((out_dir / "losses.json").read_text())


@pytest.mark.parametrize("num_stages", STAGE_COUNTS)
@pytest.mark.parametrize("scheme", BUILTIN_NAMES)
def test_scheme_losses_match_single_process(runs, scheme, num_stages):
    out_dir, losses = runs
    cfg = case_config(out_dir, scheme, num_stages)
    reference = train_reference(cfg)
    assert_losses_close(losses[cfg.job.name], reference.losses, rel=1e-5)
    events = scheme_events(load(cfg.run_dir / "run.h5").events)
    assert scheme_acted(scheme, events), f"{scheme} did not act in the parity run: {events}"


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
