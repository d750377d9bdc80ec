"""SLURM support: the job environment, sbatch rendering, and the MPI launch inside an allocation.

One module per concern, each a pure function of data (environment variables, parameters), so all of
it is testable without a cluster; the real cluster tests live in ``tests/test_slurm_cluster.py``.
"""

from __future__ import annotations

from dynmo_hpc.slurm.environment import (
    SlurmEnv,
    SlurmEnvError,
    expand_hostlist,
    expand_per_node_counts,
    in_slurm_job,
    read_slurm_env,
)
from dynmo_hpc.slurm.sbatch import (
    SbatchOptionError,
    render_sbatch,
    sbatch_parameters,
    validate_sbatch_options,
)
from dynmo_hpc.slurm.step import LAUNCHERS, mpi_step_argv, resolve_launcher, slurm_mpi_env

__all__ = [
    "LAUNCHERS",
    "SbatchOptionError",
    "SlurmEnv",
    "SlurmEnvError",
    "expand_hostlist",
    "expand_per_node_counts",
    "in_slurm_job",
    "mpi_step_argv",
    "read_slurm_env",
    "render_sbatch",
    "resolve_launcher",
    "sbatch_parameters",
    "slurm_mpi_env",
    "validate_sbatch_options",
]
