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

from dynmo_hpc.config.slurm import mem_mb, sbatch_option_problems
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.slurm.step import slurm_mpi_env

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
        cpus_per_task: ``--cpus-per-task``.
        time_min: ``--time`` in minutes.
        partition, account, qos: left out when None (the cluster's defaults apply).
        mem_gb: ``--mem`` per node, in GB (rendered in MB); None leaves it out.
        signal_delay_s: SIGUSR2 this many seconds before the time limit (``--signal=B:USR2@N``),
            so the manager can checkpoint before a timeout or preemption.
        venv: virtual environment directory to ``source <venv>/bin/activate``.
        conda_env: conda environment to activate instead (not together with ``venv``).
        modules: environment modules to ``module load``, in order, after ``module purge``.
        launcher: how the manager starts the ranks: ``srun`` (``srun --mpi=pmix``), ``mpirun``
            (the venv's Open MPI ``mpirun``), or ``auto`` (the manager picks; see
            :mod:`dynmo_hpc.slurm.step`).
        mpi_loopback_only: pin Open MPI to the ``lo`` interface: True for a cluster whose nodes
            all share one host (the test cluster, ``scripts/slurm_cluster.sh``), False elsewhere.
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


def _check(p: Mapping[str, Any]) -> None:
    """Raise SbatchOptionError for anything sbatch would reject or the job could not survive."""
    problems = sbatch_option_problems(p)
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
    mpi_env = slurm_mpi_env(p["launcher"], loopback_only=p["mpi_loopback_only"])
    context["mpi_env"] = sorted(mpi_env.items())
    return template.render(**context)
