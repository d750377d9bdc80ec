"""Many small training runs in one ``mpiexec`` launch: a test file as its own rank program.

Starting a rank costs seconds (Python, torch, ``torch._dynamo``), far more than a few steps of
the tiny test model, so a test file with many real multi-rank runs trains them all in one launch
of 4 ranks: :func:`launch` runs the file under ``mpiexec`` (``python -m mpi4py FILE OUT``, so an
exception on any rank aborts the job), and the file's ``__main__`` calls :func:`train_all`,
which trains each run with the library's own :class:`~dynmo_hpc.train.trainer.Trainer` on
the communicator named for it. Each run writes what a launched job writes (``result.json`` on its
rank 0, ``run.h5``, its checkpoints) in its own run directory; the tests read those files.

Communicators: ``world`` (all 4 ranks), ``half0`` / ``half1`` (ranks 0-1 / 2-3: two 2-stage runs
at once), ``trio`` (ranks 0-2) and ``self0`` .. ``self3`` (one rank alone, ``MPI.COMM_SELF``).
A rank trains the runs of its communicators in list order, so runs on disjoint communicators
overlap. ``runtime.p2p=torch`` sets up ``torch.distributed`` once per process: a run with it
goes last on its ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dynmo_hpc import config as config_mod
from tests.helpers.jobs import ROOT

NUM_RANKS = 4

Runs = Sequence[tuple[str, config_mod.JobConfig]]
"""(communicator name, job) per run, in the order the ranks train them."""


def launch(program: str, out_dir: Path, timeout_s: float = 600) -> None:
    """Run ``program`` (a test file) on :data:`NUM_RANKS` local ranks with ``out_dir`` as its
    argument; it must exit 0."""
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    rank_argv = [sys.executable, "-m", "mpi4py", program, str(out_dir)]
    cmd = LocalMpiLauncher().command(LaunchSpec(NUM_RANKS, rank_argv))
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def train_all(runs: Runs) -> None:
    """On each rank: train every run whose communicator holds this rank, in order."""
    from mpi4py import MPI

    from dynmo_hpc.train.trainer import Trainer

    world = MPI.COMM_WORLD
    if world.size != NUM_RANKS:
        raise ValueError(f"the rank program runs on {NUM_RANKS} ranks, not {world.size}")
    half = world.Split(color=world.rank // 2, key=world.rank)
    trio = world.Split(color=0 if world.rank < 3 else MPI.UNDEFINED, key=world.rank)
    comms = {"world": world, f"half{world.rank // 2}": half, f"self{world.rank}": MPI.COMM_SELF}
    if trio != MPI.COMM_NULL:
        comms["trio"] = trio
    for name, cfg in runs:
        comm = comms.get(name)
        if comm is None:
            continue
        if comm.size != cfg.pipeline.world_size:
            raise ValueError(  # an exception under `python -m mpi4py` aborts every rank
                f"{cfg.job.name}: {cfg.pipeline.world_size} ranks on {name} of {comm.size}"
            )
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        Trainer(cfg, comm, cfg.run_dir).train()
    world.Barrier()
