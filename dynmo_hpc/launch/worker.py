"""Rank entry point: ``python -m mpi4py -m dynmo_hpc.launch.worker RUN_DIR/config.yaml``.

Started by a launcher on every rank. Running under ``python -m mpi4py`` matters: an uncaught
exception on any rank then calls ``MPI_Abort``, so the whole job ends within seconds with that
rank's traceback instead of the other ranks hanging in their next collective.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mpi4py import MPI

from dynmo_hpc import config as config_mod
from dynmo_hpc.handoff.oom import is_out_of_memory, record_out_of_memory
from dynmo_hpc.logging_utils import setup_logging
from dynmo_hpc.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    resume_from: Path | None = None
    restart = False
    if len(args) == 3 and args[1] == "--resume":
        resume_from = Path(args[2])
    elif len(args) == 2 and args[1] == "--restart":
        restart = True
    elif len(args) != 1:
        raise SystemExit(
            "usage: python -m mpi4py -m dynmo_hpc.launch.worker RUN_DIR/config.yaml "
            "[--resume CHECKPOINT_DIR | --restart]"
        )
    comm = MPI.COMM_WORLD
    setup_logging(comm.rank)
    config_path = Path(args[0])
    cfg = config_mod.load(config_path)
    try:
        Trainer(cfg, comm, config_path.parent, resume_from=resume_from, restart=restart).train()
    except BaseException as exc:
        if is_out_of_memory(exc):  # the manager falls back from a pack that does not fit
            record_out_of_memory(config_path.parent, comm.rank, exc)
        raise
    return 0


def fast_exit(code: int) -> None:
    """End the rank at once after a clean finish: every file is written and closed, so the 1-3 s
    of interpreter teardown (torch's modules, their finalizers) would only delay the launcher,
    and with it a resize's relaunch."""
    MPI.COMM_WORLD.Barrier()
    MPI.Finalize()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    fast_exit(main())
