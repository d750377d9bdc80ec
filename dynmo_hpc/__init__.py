"""dynmo_hpc: dynamic load balancing for pipeline-parallel training of dynamic LLMs (DynMo).

Entry points: the ``dynmo-hpc`` CLI (``run``, ``plan``, ``report``, ``sbatch``, ``submit``) and,
from Python, :func:`dynmo_hpc.submit` for SLURM submission through submitit.
"""

from __future__ import annotations

from typing import Any

from dynmo_hpc.version import __version__

__all__ = ["__version__", "submit"]


def submit(config_or_path: Any, **slurm_options: Any) -> Any:
    """Submit a job to SLURM with submitit; see :func:`dynmo_hpc.slurm.submit.submit`."""
    from dynmo_hpc.slurm.submit import submit as _submit

    return _submit(config_or_path, **slurm_options)
