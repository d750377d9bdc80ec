"""``dynmo-hpc run JOB.yaml``: train on local MPI ranks, then optionally write the report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli.args import add_overrides_argument
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.version import __version__


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``run`` subcommand."""
    p = sub.add_parser("run", help="train a job on local MPI ranks (no SLURM needed)")
    p.add_argument("job", help="job YAML, e.g. jobs/default.yaml")
    add_overrides_argument(p)
    p.add_argument("--report", action="store_true", help="write the run report when done")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="continue the job's run from its newest intact checkpoint, or from PATH (a run "
        "directory or a checkpoint/step_<n> directory); pipeline.num_stages may differ",
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run of this job (its run log, checkpoints and result)",
    )
    p.set_defaults(func=cmd_run)


def resolve_resume(cfg: config_mod.JobConfig, path_text: str) -> Path:
    """The verified checkpoint directory ``--resume [PATH]`` names, checked against the job."""
    from dynmo_hpc.pipeline import checkpoint, resume

    chosen, skipped = checkpoint.resolve(Path(path_text) if path_text else cfg.run_dir)
    for candidate in skipped:
        print(
            f"warning: skipping checkpoint {candidate.path}: {candidate.problem}", file=sys.stderr
        )
    state = checkpoint.read_run_state(chosen.path)
    resume.check_compatible(cfg, state, chosen.path)
    print(
        f"resuming from {chosen.path} (after step {chosen.step} of {cfg.train.steps}, "
        f"{len(state['parts']) - 1} stages -> {cfg.pipeline.num_stages})",
        flush=True,
    )
    return chosen.path


def _newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint of ``run_dir``, or None."""
    from dynmo_hpc.errors import CheckpointError
    from dynmo_hpc.pipeline import checkpoint

    try:
        return checkpoint.resolve(run_dir)[0].path
    except CheckpointError:
        return None


def cmd_run(args: argparse.Namespace) -> int:
    """Train the job on ``pipeline.num_stages`` local ranks; print the outcome."""
    cfg = config_mod.load(args.job, args.overrides)
    print(
        f"dynmo-hpc {__version__}: job '{cfg.job.name}' on {cfg.pipeline.num_stages} local ranks "
        f"-> {cfg.run_dir}",
        flush=True,
    )
    resume_from = resolve_resume(cfg, args.resume) if args.resume is not None else None
    t0 = time.perf_counter()
    rc, run_dir = launch_local(cfg, resume_from=resume_from, overwrite=args.overwrite)
    result_path = run_dir / "result.json"
    elapsed_s = time.perf_counter() - t0
    if rc != 0 or not result_path.is_file():
        print(
            f"error: training failed (exit code {rc}) after {elapsed_s:.1f} s; the failing "
            f"rank's traceback is above; run directory: {run_dir}",
            file=sys.stderr,
        )
        newest = _newest_checkpoint(run_dir)
        if newest is not None:
            print(
                f"HINT: {newest} is intact; continue from it with the same command and --resume",
                file=sys.stderr,
            )
        return rc or 1
    result = json.loads(result_path.read_text())
    completed, wanted = result.get("completed_steps"), result.get("num_steps")
    if completed is not None and wanted is not None and completed < wanted:
        print(
            f"stopped by a signal after step {completed} of {wanted}, with a checkpoint; "
            "continue with the same command and --resume"
        )
    print(
        f"done in {elapsed_s:.1f} s: {len(result['losses'])} steps, loss "
        f"{result['losses'][0]:.4f} -> {result['final_loss']:.4f}, "
        f"median {result['median_tokens_per_s']:.0f} tokens/s, final partition {result['parts']}"
    )
    print(f"run log: {run_dir / 'run.h5'}")
    latest = run_dir / "checkpoint" / "latest"
    if latest.is_file():
        print(f"checkpoint: {run_dir / 'checkpoint' / latest.read_text().strip()}")
    if args.report:
        from dynmo_hpc.runlog.report import write_report

        report = write_report(run_dir / "run.h5", run_dir / "report")
        print(f"report: {report.out_dir} ({len(report.png_paths)} figures)")
    return 0
