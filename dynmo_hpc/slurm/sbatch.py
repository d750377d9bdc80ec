"""Render the job's sbatch script: a pure function from parameters to text.

Why a pure function with keyword defaults (after submitit's ``_make_sbatch_string``): the
signature *is* the list of valid parameters, so a typo in a job file is caught before anything is
queued (:func:`validate_sbatch_options` lists the valid keys), and the rendered text can be
compared byte for byte against a golden file without a cluster.

The Jinja2 template (``dynmo_hpc/templates/dynmo_job.sbatch.j2``, package data) holds no paths:
the venv, the output directory, the config file and the MPI environment all come in as parameters.
"""

from __future__ import annotations

import inspect
import re
import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jinja2

from dynmo_hpc.config.slurm import (
    MPI_IMPLEMENTATIONS,
    SRUN_MPI_PLUGINS,
    mem_mb,
    sbatch_option_problems,
)
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.slurm.step import slurm_mpi_env, srun_mpi_plugin

__all__ = [
    "TEMPLATE_NAME",
    "SbatchOptionError",
    "render_sbatch",
    "sbatch_parameters",
    "validate_sbatch_options",
]

TEMPLATE_NAME = "dynmo_job.sbatch.j2"
"""The template, shipped inside the package (``dynmo_hpc/templates/``), so a wheel has it."""


def template_text() -> str:
    """The packaged template's text (read through importlib.resources: works from a wheel)."""
    return (resources.files("dynmo_hpc") / "templates" / TEMPLATE_NAME).read_text()


class SbatchOptionError(DynmoError, ValueError):
    """An unknown or impossible sbatch option; the message says what is valid."""


def render_sbatch(
    *,
    job_name: str,
    config_path: str,
    output_dir: str,
    nodes: int = 1,
    tasks_per_node: int = 1,
    gpus_per_node: int = 0,
    gpus_per_task: int = 0,
    gpu_bind: str | None = None,
    nccl_defaults: bool = False,
    cpus_per_task: int = 1,
    time_min: int = 30,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    mem_gb: float | None = None,
    signal_delay_s: int = 120,
    venv: str | None = None,
    conda_env: str | None = None,
    modules: Sequence[str] = (),
    launcher: str = "auto",
    mpi: str = "auto",
    mpi_implementation: str = "openmpi",
    mpi_loopback_only: bool = False,
    python: str = "python",
    extra_sbatch: Sequence[str] = (),
    resume_from: str | None = None,
) -> str:
    """The sbatch script that runs ``python -m dynmo_hpc.slurm.manager CONFIG`` in the allocation.

    Args:
        job_name: ``--job-name``; also names the log files ``<output_dir>/<job_name>-<id>.out``.
        config_path: job YAML the manager loads (resolved by the caller; relative paths are taken
            from the submit directory).
        output_dir: directory of the ``.out`` / ``.err`` files; must exist when the job starts.
        nodes: ``--nodes``.
        tasks_per_node: ``--ntasks-per-node``: MPI ranks per node.
        gpus_per_node: ``--gpus-per-node``; 0 leaves it out.
        gpus_per_task: ``--gpus-per-task``; 0 leaves it out (:func:`gpu_request` sets it for a
            CUDA job that names no per-node count).
        gpu_bind: ``--gpu-bind`` (e.g. ``single:1``: each task its own GPU); None leaves it out.
        nccl_defaults: export the usual NCCL settings, each only where the environment has not
            set it (:data:`NCCL_DEFAULTS`).
        cpus_per_task: ``--cpus-per-task``.
        time_min: ``--time`` in minutes.
        partition, account, qos: left out when None (the cluster's defaults apply).
        mem_gb: ``--mem`` per node, in GB (rendered in MB); None leaves it out.
        signal_delay_s: SIGUSR2 this many seconds before the time limit (``--signal=B:USR2@N``),
            so the manager can checkpoint before a timeout or preemption.
        venv: virtual environment directory to ``source <venv>/bin/activate``.
        conda_env: conda environment to activate instead (not together with ``venv``).
        modules: environment modules to ``module load``, in order, after ``module purge``.
        launcher: how the manager starts the ranks: ``srun`` (``srun --mpi=<plugin>``), ``mpirun``
            (the venv's ``mpirun``), or ``auto`` (the manager picks; see
            :mod:`dynmo_hpc.slurm.step`).
        mpi: SLURM's MPI plugin (``slurm.mpi``: auto, pmix, pmi2, cray_shasta, none).
        mpi_implementation: ``openmpi`` or ``mpich``, the MPI the job's mpi4py loads
            (:func:`dynmo_hpc.launch.mpi_impl.detect`): which variables the script exports.
        mpi_loopback_only: pin Open MPI to the ``lo`` interface: True for a cluster whose nodes
            all share one host (the test cluster, ``scripts/slurm_cluster.sh``), False elsewhere;
            no effect on MPICH.
        python: the interpreter that runs the manager, after activation.
        extra_sbatch: more ``#SBATCH`` lines, verbatim, e.g. ``("--exclusive",)``.
        resume_from: a ``checkpoint/step_<n>`` directory the job's first run continues from
            (``--resume`` to the manager); a requeued run continues from the run's newest
            checkpoint instead. None: a new run.
    """
    params = dict(locals())
    _check(params)
    return _render(params)


def sbatch_parameters() -> dict[str, Any]:
    """Every valid parameter with its default (``inspect.Parameter.empty`` for required ones)."""
    return {
        name: param.default for name, param in inspect.signature(render_sbatch).parameters.items()
    }


def validate_sbatch_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Check a dict of options (e.g. a job file's ``slurm:`` section) before anything is queued.

    Returns the full parameter dict, defaults filled in, ready for ``render_sbatch(**result)``.

    Raises:
        SbatchOptionError: for unknown keys (listing the valid ones), missing required keys,
            wrong types, or impossible combinations (the message says which and why).
    """
    valid = sbatch_parameters()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listing = "\n".join(f"  - {name}{_default_text(valid[name])}" for name in valid)
        raise SbatchOptionError(
            f"unknown sbatch option(s): {', '.join(unknown)}.\nValid options are:\n{listing}"
        )
    missing = [
        name
        for name, default in valid.items()
        if default is inspect.Parameter.empty and name not in options
    ]
    if missing:
        raise SbatchOptionError(f"missing required sbatch option(s): {', '.join(missing)}")
    params = {
        name: options.get(name, default)
        for name, default in valid.items()
        if name in options or default is not inspect.Parameter.empty
    }
    _check(params)
    return params


def _default_text(default: Any) -> str:
    return " (required)" if default is inspect.Parameter.empty else f" (default {default!r})"


_SAFE_WORD = re.compile(r"^[A-Za-z0-9_.+@%:/=,-]+$")
"""What may appear in an ``#SBATCH`` value: sbatch does no shell quoting there."""


NCCL_DEFAULTS: tuple[tuple[str, str], ...] = (
    ("NCCL_DEBUG", "WARN"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
)
"""NCCL settings a CUDA job's script exports unless its environment already has them (a site
module or the user): warnings in the job's log, and a failed collective ends the step instead of
hanging it until the phase timeout."""


def gpu_request(device: str, gpus_per_node: int) -> dict[str, Any]:
    """The GPU parameters of the script for ``runtime.device`` and ``slurm.gpus_per_node``.

    A CUDA job gets its GPUs the SLURM way: ``--gpus-per-node`` when the job names a count per
    node, else ``--gpus-per-task=1`` (one rank per GPU); either way ``--gpu-bind=single:1``, so
    each rank sees one GPU of its own, and the NCCL defaults. Other devices keep the per-node
    count as given (a CPU job asks for none).

    Example:
        >>> gpu_request("cuda", 0)
        {'gpus_per_node': 0, 'gpus_per_task': 1, 'gpu_bind': 'single:1', 'nccl_defaults': True}
        >>> gpu_request("cpu", 0)
        {'gpus_per_node': 0, 'gpus_per_task': 0, 'gpu_bind': None, 'nccl_defaults': False}
    """
    if device != "cuda":
        return {
            "gpus_per_node": gpus_per_node,
            "gpus_per_task": 0,
            "gpu_bind": None,
            "nccl_defaults": False,
        }
    return {
        "gpus_per_node": gpus_per_node,
        "gpus_per_task": 0 if gpus_per_node else 1,
        "gpu_bind": "single:1",
        "nccl_defaults": True,
    }


def _check(p: Mapping[str, Any]) -> None:
    """Raise SbatchOptionError for anything sbatch would reject or the job could not survive."""
    problems = sbatch_option_problems(p)
    if p["mpi_implementation"] not in MPI_IMPLEMENTATIONS:
        problems.append(
            f"mpi_implementation={p['mpi_implementation']!r} must be one of "
            f"{', '.join(MPI_IMPLEMENTATIONS)}"
        )
    elif p["mpi"] in SRUN_MPI_PLUGINS:
        try:
            srun_mpi_plugin(p["mpi"], p["mpi_implementation"])
        except ValueError as exc:
            problems.append(str(exc))
    gpt = p["gpus_per_task"]
    if isinstance(gpt, bool) or not isinstance(gpt, int) or gpt < 0:
        problems.append(f"gpus_per_task={gpt!r} must be an integer >= 0")
    elif gpt and p["gpus_per_node"]:
        problems.append(
            f"gpus_per_task={gpt} and gpus_per_node={p['gpus_per_node']} are both set: ask "
            "for GPUs one way"
        )
    bind = p["gpu_bind"]
    if bind is not None and (not isinstance(bind, str) or not _SAFE_WORD.match(bind)):
        problems.append(f"gpu_bind={bind!r} must be a SLURM --gpu-bind value such as single:1")
    if p.get("resume_from") is not None and (
        not isinstance(p["resume_from"], str) or not p["resume_from"]
    ):
        problems.append(f"resume_from={p['resume_from']!r} must be a checkpoint path or None")
    for name in ("job_name", "config_path", "output_dir", "python"):
        if not isinstance(p[name], str) or not p[name]:
            problems.append(f"{name}={p[name]!r} must be a non-empty string")
    for name in ("job_name", "output_dir"):
        value = p[name]
        if isinstance(value, str) and value and not _SAFE_WORD.match(value):
            problems.append(
                f"{name}={value!r} has characters sbatch cannot take in an #SBATCH line "
                "(spaces, quotes, newlines); use letters, digits and _.+@%:/=,-"
            )
    if problems:
        raise SbatchOptionError(
            "invalid sbatch options:\n" + "\n".join(f"  - {m}" for m in problems)
        )


def _render(p: Mapping[str, Any]) -> str:
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # shell, not HTML; values are quoted with `q` where the shell reads them
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    template = env.from_string(template_text())
    context = dict(p)
    context["mem_mb"] = mem_mb(p["mem_gb"])
    mpi_env = slurm_mpi_env(
        p["launcher"],
        loopback_only=p["mpi_loopback_only"],
        implementation=p["mpi_implementation"],
        mpi=p["mpi"],
    )
    context["mpi_env"] = sorted(mpi_env.items())
    context["nccl_env"] = list(NCCL_DEFAULTS)
    return template.render(**context)
