"""Render the job's sbatch script: a pure function from parameters to text.

Why a pure function with keyword defaults (after submitit's ``_make_sbatch_string``): the
signature *is* the list of valid parameters, so a typo in a job file is caught before anything is
queued (:func:`validate_sbatch_options` lists the valid keys), and the rendered text can be
compared byte for byte against a golden file without a cluster.

The Jinja2 template (``templates/dynmo_job.sbatch.j2``) holds no paths: the venv, the output
directory, the config file and the MPI environment all come in as parameters.
"""

from __future__ import annotations

import inspect
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from .launch import LAUNCHERS, slurm_mpi_env

__all__ = [
    "TEMPLATE_PATH",
    "SbatchOptionError",
    "render_sbatch",
    "sbatch_parameters",
    "validate_sbatch_options",
]

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "templates" / "dynmo_job.sbatch.j2"
"""The repository's template; ``render_sbatch`` reads it on every call (it is tiny)."""


class SbatchOptionError(ValueError):
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
) -> str:
    """The sbatch script that runs ``python -m dynmo_hpc.manager CONFIG`` in the allocation.

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
            :mod:`dynmo_hpc.slurm.launch`).
        mpi_loopback_only: pin Open MPI to the ``lo`` interface: True for a cluster whose nodes
            all share one host (the test cluster, ``scripts/slurm_cluster.sh``), False elsewhere.
        python: the interpreter that runs the manager, after activation.
        extra_sbatch: more ``#SBATCH`` lines, verbatim, e.g. ``("--exclusive",)``.
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
    problems: list[str] = []

    def need_int(name: str, minimum: int) -> None:
        value = p[name]
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name}={value!r} must be an integer")
        elif value < minimum:
            problems.append(f"{name}={value} must be >= {minimum}")

    need_int("nodes", 1)
    need_int("tasks_per_node", 1)
    need_int("cpus_per_task", 1)
    need_int("gpus_per_node", 0)
    need_int("time_min", 1)
    need_int("signal_delay_s", 0)
    if not problems and p["signal_delay_s"] >= p["time_min"] * 60:
        problems.append(
            f"signal_delay_s={p['signal_delay_s']} is not less than time_min*60="
            f"{p['time_min'] * 60}: the preemption signal would come before the job starts; "
            "lower signal_delay_s or raise time_min"
        )
    mem_gb = p["mem_gb"]
    if mem_gb is not None and (
        isinstance(mem_gb, bool)
        or not isinstance(mem_gb, int | float)
        or not math.isfinite(mem_gb)
        or mem_gb <= 0
    ):
        problems.append(f"mem_gb={mem_gb!r} must be a positive number of GB (or None)")
    for name in ("job_name", "config_path", "output_dir", "python"):
        if not isinstance(p[name], str) or not p[name]:
            problems.append(f"{name}={p[name]!r} must be a non-empty string")
    for name in ("job_name", "output_dir", "partition", "account", "qos"):
        value = p[name]
        if isinstance(value, str) and value and not _SAFE_WORD.match(value):
            problems.append(
                f"{name}={value!r} has characters sbatch cannot take in an #SBATCH line "
                "(spaces, quotes, newlines); use letters, digits and _.+@%:/=,-"
            )
    if p["venv"] and p["conda_env"]:
        problems.append(
            f"venv={p['venv']!r} and conda_env={p['conda_env']!r} are both set; "
            "the job activates one environment: keep one of them"
        )
    if not isinstance(p["mpi_loopback_only"], bool):
        problems.append(f"mpi_loopback_only={p['mpi_loopback_only']!r} must be true or false")
    if p["launcher"] not in LAUNCHERS:
        problems.append(f"launcher={p['launcher']!r} must be one of {', '.join(LAUNCHERS)}")
    for name in ("modules", "extra_sbatch"):
        value = p[name]
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            problems.append(f"{name}={value!r} must be a list of strings (not one string)")
        elif any("\n" in v or not v.strip() for v in value):
            problems.append(f"{name}={list(value)!r} has an empty entry or a newline")
    if not problems:
        for line in p["extra_sbatch"]:
            if not line.startswith("-"):
                problems.append(
                    f"extra_sbatch entry {line!r} must be an sbatch flag such as '--exclusive'"
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
    template = env.from_string(TEMPLATE_PATH.read_text())
    mem_gb = p["mem_gb"]
    context = dict(p)
    context["mem_mb"] = None if mem_gb is None else math.ceil(mem_gb * 1024)
    mpi_env = slurm_mpi_env(p["launcher"], loopback_only=p["mpi_loopback_only"])
    context["mpi_env"] = sorted(mpi_env.items())
    return template.render(**context)
