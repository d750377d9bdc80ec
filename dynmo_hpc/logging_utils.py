"""Rank-aware logging: every line says which rank wrote it; only rank 0 speaks at INFO.

Why: with P ranks writing to one terminal, an unprefixed line is useless, and P copies of every
progress line drown the one that matters. Library code logs; only the CLI prints.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def env_rank() -> int:
    """The rank from the launcher's environment (Open MPI, MPICH/PMI, SLURM), 0 if none."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def setup_logging(rank: int | None = None, level: int | None = None) -> None:
    """Configure the ``dynmo_hpc`` logger: INFO on rank 0, WARNING elsewhere (or ``level``)."""
    rank = env_rank() if rank is None else rank
    if level is None:
        env_level = os.environ.get("DYNMO_LOG_LEVEL")
        level = getattr(logging, env_level.upper()) if env_level else None
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    logger = logging.getLogger("dynmo_hpc")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
