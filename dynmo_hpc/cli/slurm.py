"""``dynmo-hpc sbatch`` and ``dynmo-hpc submit``: put a job on a SLURM cluster.

Two paths to the same allocation and the same job manager (docs/slurm.md):

* ``sbatch JOB.yaml`` prints the rendered batch script (a file you can read, keep and submit by
  hand); ``--submit`` submits it with sbatch, ``--wait`` waits and reports the final state.
* ``submit JOB.yaml`` submits through submitit; ``--sweep key=v1,v2`` makes a job array.

Every config or SLURM problem is found before anything is queued and printed as one ``error:``
line (exit 2, by :func:`dynmo_hpc.cli.main`). A job that ends in any state but COMPLETED is
reported with the path of its log, and the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli.args import add_overrides_argument, add_resume_arguments
from dynmo_hpc.cli.run import check_allow_change, resolve_resume
from dynmo_hpc.launch import preflight
from dynmo_hpc.launch.rundir import claim_run_dir, prepare_run_dir, refuse_if_locked
from dynmo_hpc.slurm.sbatch import render_sbatch
from dynmo_hpc.slurm.scheduler import (
    check_fits_cluster,
    query_partitions,
    sbatch_log_paths,
    submit_sbatch,
    wait_for_sbatch_job,
)
from dynmo_hpc.slurm.submit import (
    load_job,
    parse_sweep,
    resolve_for_cluster,
    sbatch_parameters_for,
    submit,
    wait_for_job,
)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job YAML, e.g. jobs/default.yaml (its slurm: section)")
    add_overrides_argument(p, example="slurm.nodes=4 --set slurm.partition=gpu")
    p.add_argument(
        "--wait", action="store_true", help="wait for the job to end; exit 1 unless COMPLETED"
    )
    add_resume_arguments(
        p,
        "continue the job's run from its newest intact checkpoint, or from PATH (a run "
        "directory or a checkpoint/step_<n> directory), checked here before anything is "
        "queued; a requeued job continues from its newest checkpoint; without --resume or "
        "--overwrite, submitting into a run directory that holds a run is refused",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``sbatch`` and ``submit`` on the ``dynmo-hpc`` parser."""
    p = sub.add_parser(
        "sbatch",
        help="print the job's sbatch script, or submit it (--submit)",
        description="Render the packaged sbatch template (dynmo_job.sbatch.j2) for the job and "
        "print it. The "
        "resolved config is written to <out_dir>/<name>/config.yaml, which the script runs.",
    )
    _add_common(p)
    p.add_argument(
        "--submit", action="store_true", help="submit the script with sbatch; print the job id"
    )
    p.set_defaults(func=cmd_sbatch)

    p = sub.add_parser(
        "submit",
        help="submit the job with submitit (a job array with --sweep)",
        description="Submit the job manager with submitit: it runs once in the allocation and "
        "starts the ranks as one MPI step.",
    )
    _add_common(p)
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2,...",
        help="one job-array task per value (repeat for the product of several keys), "
        "e.g. --sweep train.lr=1e-3,3e-3",
    )
    p.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="submitit folder for pickles and logs (default <run_dir>/submitit)",
    )
    p.set_defaults(func=cmd_submit)


def cmd_sbatch(args: argparse.Namespace) -> int:
    if args.wait and not args.submit:
        raise config_mod.ConfigError(
            "--wait needs --submit; HINT: dynmo-hpc sbatch JOB --submit --wait"
        )
    check_allow_change(args)
    data, source = load_job(args.job, args.overrides)
    cfg = resolve_for_cluster(config_mod.from_dict(data, source=source))
    if args.submit:  # printing a script for review (maybe for another host) checks no files
        preflight.check_job(cfg, for_slurm=True)
        check_fits_cluster(cfg, query_partitions())
        if args.resume is None:
            claim_run_dir(cfg.run_dir, overwrite=args.overwrite)
        else:
            refuse_if_locked(cfg.run_dir)
    resume_from = None
    if args.resume is not None:  # stdout is the script when it is only printed
        out = sys.stdout if args.submit else sys.stderr
        resume_from = str(resolve_resume(cfg, args.resume, args.allow_change, out).resolve())
    config_path = cfg.run_dir / "config.yaml"
    script = render_sbatch(**sbatch_parameters_for(cfg, config_path), resume_from=resume_from)
    if not args.submit:
        print(script, end="")
        print(_review_note(cfg, config_path), file=sys.stderr)
        return 0
    prepare_run_dir(cfg)
    script_path = cfg.run_dir / "job.sbatch"
    script_path.write_text(script)
    t0 = time.perf_counter()
    job_id = submit_sbatch(script_path)
    out, err = sbatch_log_paths(cfg, job_id)
    nodes = cfg.slurm.num_nodes(cfg.pipeline.world_size)
    print(f"submitted job {job_id}: '{cfg.job.name}' on {nodes} node(s); log {out}", flush=True)
    if not args.wait:
        return 0
    state = wait_for_sbatch_job(job_id)
    return _report(str(job_id), state, time.perf_counter() - t0, cfg.run_dir, out, err)


def _review_note(cfg: config_mod.JobConfig, config_path: Path) -> str:
    """Print for review writes the run directory's ``config.yaml`` only where there is none.

    An existing one belongs to the run of that name: a queued or requeued job reloads it when
    it starts, so rewriting it here would apply a ``--set`` typed only to look at the script
    (without ``--allow-change``) and lose a packed job's size. ``--submit`` writes it."""
    if not config_path.exists():
        prepare_run_dir(cfg)
        return f"# wrote {config_path}, which this script runs"
    if config_path.read_text() == cfg.to_yaml():
        return f"# {config_path}, which this script runs, is up to date"
    return (
        f"# {config_path} (the run's config, which this script runs) was left as it is and "
        "differs from this job; --submit writes it"
    )


def cmd_submit(args: argparse.Namespace) -> int:
    sweep: dict[str, list[Any]] = {}
    for text in args.sweep:
        key, values = parse_sweep(text)
        if key in sweep:
            raise config_mod.ConfigError(
                f"--sweep {key} is given twice; HINT: list all its values in one --sweep"
            )
        sweep[key] = values
    check_allow_change(args)
    t0 = time.perf_counter()
    submitted = submit(
        args.job,
        overrides=args.overrides,
        sweep=sweep or None,
        folder=args.folder,
        overwrite=args.overwrite,
        resume=False if args.resume is None else (args.resume or True),
        allow_change=args.allow_change,
    )
    jobs = submitted if isinstance(submitted, list) else [submitted]
    run_dirs = [Path(job.submission().args[0]).parent for job in jobs]
    if sweep:
        print(f"submitted array job {jobs[0].job_id.split('_')[0]} with {len(jobs)} tasks:")
    for job, run_dir in zip(jobs, run_dirs, strict=True):
        print(f"submitted job {job.job_id}: {run_dir}; log {job.paths.stdout}", flush=True)
    if not args.wait:
        return 0
    rc = 0
    for job, run_dir in zip(jobs, run_dirs, strict=True):
        state = wait_for_job(job)
        elapsed_s = time.perf_counter() - t0
        rc = max(
            rc, _report(job.job_id, state, elapsed_s, run_dir, job.paths.stdout, job.paths.stderr)
        )
    return rc


def _report(job_id: str, state: str, elapsed_s: float, run_dir: Path, out: Path, err: Path) -> int:
    """One line: COMPLETED with the run log, or ``error:`` with the state and the log paths."""
    if state == "COMPLETED":
        print(f"job {job_id} COMPLETED after {elapsed_s:.1f} s; run log {run_dir / 'run.h5'}")
        return 0
    print(
        f"error: job {job_id} {state} after {elapsed_s:.1f} s; log {out} (stderr {err}); "
        f"run directory {run_dir}",
        file=sys.stderr,
    )
    return 1
