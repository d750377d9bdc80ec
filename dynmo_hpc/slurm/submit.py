"""Submit a job to SLURM with submitit: validate everything first, then queue the job manager.

The contract (the rendered-sbatch path, ``dynmo-hpc sbatch``, keeps the same one):

* **Validate before anything is queued.** The config (with ``--set`` overrides and SLURM options)
  is loaded strictly, every sweep point included; the request is then checked against the
  cluster's partitions (:func:`~dynmo_hpc.slurm.scheduler.check_fits_cluster`): an unknown
  partition, too many nodes, or more CPUs, memory or GPUs per node than the nodes have is an
  error that lists what is valid. A bad job never waits in a queue only to be rejected.
* **The job manager runs once in the allocation** (submitit's ``use_srun=False``) while the job
  holds all its nodes; it starts the ranks as one MPI step (:mod:`dynmo_hpc.slurm.manager`).
* **Status:** :func:`wait_for_job` returns the final scheduler state (``COMPLETED``,
  ``FAILED``, ``TIMEOUT``, ...) from sacct; ``job.paths.stdout``/``stderr`` are the logs.
* **Cancel:** ``job.cancel()``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.config.strict_yaml import parse_yaml
from dynmo_hpc.launch import preflight
from dynmo_hpc.launch.mpi_impl import detect
from dynmo_hpc.launch.rundir import claim_run_dir, prepare_run_dir, refuse_if_locked
from dynmo_hpc.slurm.requeue import ManagerJob, run_in_allocation
from dynmo_hpc.slurm.sbatch import NCCL_DEFAULTS, gpu_request
from dynmo_hpc.slurm.scheduler import (
    TERMINAL_STATES,
    SubmitError,
    check_fits_cluster,
    query_partitions,
)

if TYPE_CHECKING:
    import submitit

log = logging.getLogger(__name__)

__all__ = [
    "SubmitError",
    "executor_parameters",
    "load_job",
    "make_executor",
    "parse_sweep",
    "resolve_for_cluster",
    "run_in_allocation",
    "sbatch_parameters_for",
    "submit",
    "submitit_python",
    "sweep_configs",
    "wait_for_job",
]

# --------------------------------------------------------------------------------------------
# The job: config, SLURM options, sweeps (pure)
# --------------------------------------------------------------------------------------------


def load_job(
    config_or_path: config_mod.JobConfig | str | Path,
    overrides: Sequence[str] = (),
    slurm_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], str]:
    """The job as plain data with ``--set`` overrides and SLURM options applied; and its source.

    Returns raw data (validated later, per sweep point, by :func:`config_mod.from_dict`), so a
    sweep can change any key before validation.
    """
    if isinstance(config_or_path, config_mod.JobConfig):
        data, source = config_or_path.to_dict(), "<JobConfig>"
    else:
        data, source = config_mod.load_yaml(config_or_path), str(config_or_path)
    data = config_mod.apply_overrides(data, list(overrides))
    if slurm_options:
        valid = {f.name: f for f in _slurm_fields()}
        unknown = sorted(set(slurm_options) - set(valid))
        if unknown:
            listing = ", ".join(f"{name}={_field_default(f)!r}" for name, f in valid.items())
            raise config_mod.ConfigError(
                f"unknown SLURM option(s) {', '.join(unknown)}; valid options (with defaults) "
                f"are: {listing}. HINT: pass them as keyword arguments, e.g. nodes=4"
            )
        if data.get("slurm") is None:
            data["slurm"] = {}
        section = data["slurm"]
        if not isinstance(section, dict):
            raise config_mod.ConfigError(f"{source}: slurm must be a mapping of SLURM options")
        section.update(copy.deepcopy(dict(slurm_options)))
    return data, source


def _slurm_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(config_mod.SlurmSection))


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``section.key=v1,v2,...`` -> ``("section.key", [v1, v2, ...])``, values parsed as YAML.

    The values are read as one YAML flow list, so lists work too (``pipeline.partition=[0,3,6],
    [0,2,6]``). ``1e-3`` (a string to YAML 1.1) is read as the number it looks like.

    Example:
        >>> parse_sweep("train.lr=1e-3,3e-3")
        ('train.lr', [0.001, 0.003])
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or len([p for p in key.split(".") if p]) < 2 or not raw.strip():
        raise config_mod.ConfigError(
            f"--sweep {text!r}: expected section.key=v1,v2,...; HINT: e.g. --sweep "
            "train.lr=1e-3,3e-3"
        )
    # The job files' reader: no base-60 numbers (slurm.time_min=1:00:00,2:00:00), no aliases.
    values = parse_yaml(
        f"[{raw}]", f"--sweep {text!r}", hint="separate values with commas, e.g. 1e-3,3e-3"
    )
    values = [float(v) if isinstance(v, str) and _FLOAT.match(v) else v for v in values]
    if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
        raise config_mod.ConfigError(
            f"--sweep {text!r} repeats a value; HINT: list each value once"
        )
    return key, values


def _label(value: Any) -> str:
    """A value as a short, file-name-safe piece of a job name."""
    text = re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(value)).strip("_")
    return text[:40] or "x"


def sweep_configs(
    data: Mapping[str, Any], sweep: Mapping[str, Sequence[Any]], source: str = "<sweep>"
) -> list[config_mod.JobConfig]:
    """One validated config per point of the sweep (the product over its keys, in order).

    Each point gets its own ``job.name`` (``<name>-<index>-<key><value>...``), so run
    directories and run logs do not collide.

    Example:
        ``{"train.lr": [0.001, 0.003]}`` on job ``default`` gives jobs ``default-0-lr0.001``
        and ``default-1-lr0.003``.
    """
    if not sweep:
        raise config_mod.ConfigError("the sweep is empty; HINT: pass --sweep section.key=v1,v2")
    keys = list(sweep)
    for key in keys:
        if len(key.split(".")) < 2 or not sweep[key]:
            raise config_mod.ConfigError(
                f"sweep key {key!r} must be section.key with at least one value; "
                "HINT: e.g. {'train.lr': [1e-3, 3e-3]}"
            )
        if key == "job.name":
            raise config_mod.ConfigError(
                "job.name cannot be swept: each point's name is derived from it; "
                "HINT: sweep another key"
            )
    base = str((data.get("job") or {}).get("name", config_mod.JobSection().name))
    configs = []
    for index, point in enumerate(itertools.product(*(sweep[k] for k in keys))):
        point_data = copy.deepcopy(dict(data))
        for key, value in zip(keys, point, strict=True):
            config_mod.set_dotted(point_data, key, copy.deepcopy(value), "sweep key")
        label = "-".join(f"{k.split('.')[-1]}{_label(v)}" for k, v in zip(keys, point, strict=True))
        config_mod.set_dotted(point_data, "job.name", f"{base}-{index}-{label}", "sweep key")
        point_source = (
            f"{source} [sweep {', '.join(f'{k}={v!r}' for k, v in zip(keys, point, strict=True))}]"
        )
        configs.append(config_mod.from_dict(point_data, source=point_source))
    return configs


def resolve_for_cluster(cfg: config_mod.JobConfig) -> config_mod.JobConfig:
    """Fix what the submit host knows and the job must not guess: absolute paths, the venv.

    Jobs may start in another directory (or on another node's view of a shared file system), so
    ``job.out_dir`` and ``data``'s paths become absolute, and ``slurm.venv: null`` becomes the
    virtual environment running now (if Python runs in one and no conda env is named).
    """
    job = dataclasses.replace(cfg.job, out_dir=str(Path(cfg.job.out_dir).resolve()))
    data = cfg.data
    if data.path is not None:
        data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
    if data.cache_dir is not None:
        data = dataclasses.replace(data, cache_dir=str(Path(data.cache_dir).resolve()))
    if data.tokenizer is not None and data.tokenizer.path is not None:
        tokenizer = dataclasses.replace(
            data.tokenizer, path=str(Path(data.tokenizer.path).resolve())
        )
        data = dataclasses.replace(data, tokenizer=tokenizer)
    slurm = cfg.slurm
    if slurm.venv is None and slurm.conda_env is None and sys.prefix != sys.base_prefix:
        slurm = dataclasses.replace(slurm, venv=sys.prefix)
    elif slurm.venv is not None:
        slurm = dataclasses.replace(slurm, venv=str(Path(slurm.venv).resolve()))
    return dataclasses.replace(cfg, job=job, data=data, slurm=slurm)


def _python(slurm: config_mod.SlurmSection) -> str:
    """After activation ``python`` is the environment's; without one, the one running now."""
    return "python" if (slurm.venv or slurm.conda_env) else sys.executable


def submitit_python(slurm: config_mod.SlurmSection) -> str:
    """The command submitit's batch script starts Python with: ``exec python``.

    ``exec`` makes the job's Python (and so the manager) the batch shell itself, as in the sbatch
    template: ``--signal=B:USR2@N`` then reaches the manager, which forwards it to the MPI step.
    Without it, bash gets the signal while it waits for Python, and dies of it (seen on the test
    cluster: the job ended FAILED at the warning).
    """
    return f"exec {shlex.quote(_python(slurm))}"


def sbatch_parameters_for(cfg: config_mod.JobConfig, config_path: Path) -> dict[str, Any]:
    """``render_sbatch`` keyword arguments for a (resolved) job; logs go to its run directory.
    GPUs follow ``runtime.device`` (:func:`~dynmo_hpc.slurm.sbatch.gpu_request`), the exported
    MPI variables the implementation the job's mpi4py loads (:func:`job_mpi_implementation`)."""
    options = cfg.slurm.sbatch_options(cfg.pipeline.world_size)
    return {
        "job_name": cfg.job.name,
        "config_path": str(config_path),
        "output_dir": str(cfg.run_dir),
        "python": _python(cfg.slurm),
        **options,
        **gpu_request(cfg.runtime.device, options["gpus_per_node"]),
        "mpi_implementation": job_mpi_implementation(cfg.slurm),
    }


def job_mpi_implementation(slurm: config_mod.SlurmSection) -> str:
    """The MPI implementation the job's ranks will load: asked of ``slurm.venv``'s Python when
    that venv is on this host, else of this interpreter (the environment the job runs in when
    no venv is named)."""
    if slurm.venv:
        python = Path(slurm.venv) / "bin" / "python"
        if python.exists():
            return detect(str(python))
    return detect()


def executor_parameters(cfg: config_mod.JobConfig) -> dict[str, Any]:
    """``submitit.SlurmExecutor.update_parameters`` arguments: the same allocation as the template.

    ``use_srun=False`` runs the manager once in the batch script; ``--signal=B:USR2@N`` sends the
    time-limit warning to the batch shell (as in the template), which :func:`submitit_python`
    makes the manager itself; the manager forwards the signal to the MPI step.
    """
    s = cfg.slurm
    setup: list[str] = []
    if s.modules:
        setup += ["module purge", *(f"module load {shlex.quote(m)}" for m in s.modules)]
    if s.venv:
        setup.append(f"source {shlex.quote(s.venv + '/bin/activate')}")
    elif s.conda_env:
        setup += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(s.conda_env)}"]
    additional: dict[str, Any] = {"signal": f"B:USR2@{s.signal_delay_s}"}
    for flag in s.extra_sbatch:
        name, sep, value = flag.partition("=")
        if not name.startswith("--") or " " in flag:
            raise config_mod.ConfigError(
                f"slurm.extra_sbatch entry {flag!r}: submitit takes long flags only; "
                "HINT: write it as --name or --name=value, e.g. --constraint=a100"
            )
        additional[name[2:]] = value if sep else True
    o = s.sbatch_options(cfg.pipeline.world_size)
    params: dict[str, Any] = {
        "job_name": cfg.job.name,
        "nodes": o["nodes"],
        "ntasks_per_node": o["tasks_per_node"],
        "cpus_per_task": o["cpus_per_task"],
        "time": o["time_min"],
        "signal_delay_s": o["signal_delay_s"],
        "use_srun": False,
        "setup": setup,
        "additional_parameters": additional,
    }
    gpus = gpu_request(cfg.runtime.device, o["gpus_per_node"])
    if gpus["gpus_per_node"]:
        params["gpus_per_node"] = gpus["gpus_per_node"]
    if gpus["gpus_per_task"]:
        params["gpus_per_task"] = gpus["gpus_per_task"]
    if gpus["gpu_bind"]:
        additional["gpu-bind"] = gpus["gpu_bind"]
    if gpus["nccl_defaults"]:
        setup += [f'export {name}="${{{name}:-{value}}}"' for name, value in NCCL_DEFAULTS]
    for name in ("partition", "account", "qos"):
        if o[name] is not None:
            params[name] = o[name]
    if o["mem_gb"] is not None:
        params["mem"] = f"{config_mod.mem_mb(o['mem_gb'])}M"
    return params


# --------------------------------------------------------------------------------------------
# submitit
# --------------------------------------------------------------------------------------------


def make_executor(
    cfg: config_mod.JobConfig, folder: str | Path, *, job_name: str | None = None
) -> submitit.SlurmExecutor:
    """A submitit executor for the job's allocation (:func:`executor_parameters`)."""
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, python=submitit_python(cfg.slurm))
    executor.update_parameters(**{**executor_parameters(cfg), "job_name": job_name or cfg.job.name})
    return executor


def submit(
    config_or_path: config_mod.JobConfig | str | Path,
    *,
    overrides: Sequence[str] = (),
    sweep: Mapping[str, Sequence[Any]] | None = None,
    folder: str | Path | None = None,
    overwrite: bool = False,
    resume: bool | str | Path = False,
    allow_change: Sequence[str] = (),
    **slurm_options: Any,
) -> submitit.Job[Any] | list[submitit.Job[Any]]:
    """Submit the job manager with submitit; returns the job, or one job per sweep point.

    Args:
        config_or_path: a job YAML path or a :class:`~dynmo_hpc.config.JobConfig`.
        overrides: ``section.key=value`` strings, as ``--set``.
        sweep: ``{"section.key": [v1, v2, ...]}``: one job-array task per point (the product
            over the keys), each with its own ``job.name``.
        folder: submitit's folder (pickles and the ``<id>_0_log.out/err`` logs); default
            ``<run_dir>/submitit``, or ``<out_dir>/<name>-sweep/submitit`` for a sweep.
        overwrite: replace earlier runs in the jobs' run directories; without it a run
            directory that holds a run (``run.h5``, checkpoints, ...) is refused.
        resume: continue the job's run: True from its newest intact checkpoint, a path (run
            directory or ``checkpoint/step_<n>``) from that one. Checked here under the resume
            rules (docs/checkpoints.md); a requeued job continues from its newest checkpoint.
            Not with ``sweep`` or ``overwrite``.
        allow_change: with ``resume``: keys that alter the training math which may differ
            from the checkpoint's (``--allow-change``), e.g. ``["train.lr"]``.
        **slurm_options: keys of the ``slurm:`` section (``nodes=4``, ``partition="gpu"``...).

    Raises:
        ConfigError: an invalid config or SLURM option, or a request the cluster cannot run;
            nothing is submitted.
        SubmitError: the cluster could not be asked, or sbatch refused the job.
        LaunchError: a run directory already holds a run and ``overwrite`` is False (and no
            ``resume``), or a running job holds it.
        CheckpointError: ``resume`` finds no intact checkpoint, or one the rules refuse.
    """
    import submitit

    _check_resume_options(resume, allow_change, overwrite=overwrite, sweep=sweep)
    data, source = load_job(config_or_path, overrides, slurm_options)
    configs = _checked_configs(data, source, sweep)

    base_name = str((data.get("job") or {}).get("name", config_mod.JobSection().name))
    if folder is None:
        out_dir = Path(configs[0].job.out_dir)
        folder = (out_dir / f"{base_name}-sweep" if sweep else configs[0].run_dir) / "submitit"
    resume_path = _resume_checkpoint(configs[0], resume, allow_change)
    if resume_path is None:
        for cfg in configs:
            claim_run_dir(cfg.run_dir, overwrite=overwrite)
    executor = make_executor(configs[0], folder, job_name=base_name)
    paths = [str(prepare_run_dir(c)) for c in configs]
    launcher, loopback_only = configs[0].slurm.launcher, configs[0].slurm.loopback_only
    try:
        if not sweep:
            call = (paths[0], launcher, loopback_only, None, resume_path)
            jobs = [executor.submit(ManagerJob(), *call)]
        else:
            n = len(paths)
            jobs = executor.map_array(ManagerJob(), paths, [launcher] * n, [loopback_only] * n)
    except (
        OSError,
        submitit.core.utils.UncompletedJobError,
        submitit.core.utils.FailedSubmissionError,
    ) as exc:
        raise SubmitError(
            f"sbatch refused the job: {str(exc).strip()}; HINT: fix what the scheduler names; "
            f"the submitted script is in {folder}"
        ) from None
    # With use_srun=False one process runs, but submitit counts nodes x tasks_per_node tasks and
    # would wait for results that only task 0 writes (job.result() would refuse, job.done()
    # would wait for sacct); the job is one task.
    single: list[submitit.Job[Any]] = [
        submitit.SlurmJob(folder=executor.folder, job_id=j.job_id, tasks=(0,)) for j in jobs
    ]
    return single if sweep else single[0]


def _check_resume_options(
    resume: bool | str | Path,
    allow_change: Sequence[str],
    *,
    overwrite: bool,
    sweep: Mapping[str, Sequence[Any]] | None,
) -> None:
    """``resume`` goes with neither ``overwrite`` nor ``sweep``; ``allow_change`` needs it."""
    if resume is False:
        if allow_change:
            raise config_mod.ConfigError(
                f"allow_change={list(allow_change)} needs resume (a new run has nothing to "
                "change from); HINT: pass resume=True, or drop allow_change"
            )
        return
    if overwrite:
        raise config_mod.ConfigError(
            "resume and overwrite exclude each other; HINT: resume continues the run, "
            "overwrite starts it afresh: pass one"
        )
    if sweep:
        raise config_mod.ConfigError(
            "resume does not take a sweep (each sweep point is its own run); HINT: resume "
            "each point's job (its job.name) on its own"
        )


def _resume_checkpoint(
    cfg: config_mod.JobConfig, resume: bool | str | Path, allow_change: Sequence[str]
) -> str | None:
    """The absolute checkpoint path the job's first run continues from (None: a new run),
    checked under the resume rules before anything is queued."""
    if resume is False:
        return None
    from dynmo_hpc.checkpoint import resume as resume_mod  # torch and MPI: only when resuming

    refuse_if_locked(cfg.run_dir)
    chosen = resume_mod.choose_checkpoint(cfg, "" if resume is True else str(resume), allow_change)
    for candidate in chosen.skipped:
        log.warning("skipping checkpoint %s: %s", candidate.path, candidate.problem)
    for change in chosen.verdict.accepted:
        log.warning("accepted change (allow_change): %s", change.describe())
    log.info("the job continues from %s (after step %d)", chosen.path, chosen.step)
    return str(chosen.path.resolve())


def _checked_configs(
    data: dict[str, Any], source: str, sweep: Mapping[str, Sequence[Any]] | None
) -> list[config_mod.JobConfig]:
    """The job (or each sweep point) resolved for the cluster and checked before anything is
    submitted: preflight, one allocation size for all sweep points, and it fits the cluster."""
    if sweep:
        configs = sweep_configs(data, sweep, source)
    else:
        configs = [config_mod.from_dict(data, source=source)]
    configs = [resolve_for_cluster(c) for c in configs]
    for cfg in configs:
        preflight.check_job(cfg, for_slurm=True)
    params = [executor_parameters(c) for c in configs]
    for cfg, p in zip(configs[1:], params[1:], strict=True):
        differs = {k for k in p if k != "job_name" and p[k] != params[0].get(k)}
        if differs:
            raise config_mod.ConfigError(
                f"sweep point {cfg.job.name!r} changes the allocation ({', '.join(sorted(differs))}"
                "); the tasks of a job array share one allocation size. HINT: submit separate "
                "jobs for different node counts or resources"
            )
    check_fits_cluster(configs[0], query_partitions())
    return configs


def wait_for_job(
    job: submitit.Job[Any], *, poll_s: float = 1.0, timeout_s: float | None = None
) -> str:
    """Block until the job has ended; returns its final scheduler state (``COMPLETED``, ...).

    submitit reports a job done as soon as its result file exists, a moment before SLURM records
    the end, so the state is then polled until sacct has a terminal one (for up to a minute).

    Raises:
        SubmitError: the job is still queued or running after ``timeout_s`` (it is left alone).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not job.done(force_check=True):
        if deadline is not None and time.monotonic() > deadline:
            raise SubmitError(
                f"job {job.job_id} has not ended after {timeout_s:.0f} s (state {job.state}); "
                f"HINT: squeue -j {job.job_id}; cancel it with job.cancel() or scancel"
            )
        time.sleep(poll_s)
    settle = time.monotonic() + 60.0
    while True:
        state = job.watcher.get_state(job.job_id, mode="force")
        if (state.split() or ["?"])[0] in TERMINAL_STATES or time.monotonic() > settle:
            return state
        time.sleep(poll_s)
