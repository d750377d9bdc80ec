"""``dynmo-hpc run JOB.yaml``: train on local MPI ranks, then optionally write the report."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli.args import add_overrides_argument, add_resume_arguments
from dynmo_hpc.launch.local import run_local
from dynmo_hpc.launch.supervisor import JobOutcome
from dynmo_hpc.version import __version__


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``run`` subcommand."""
    p = sub.add_parser("run", help="train a job on local MPI ranks (no SLURM needed)")
    p.add_argument("job", help="job YAML, e.g. jobs/default.yaml")
    add_overrides_argument(p)
    p.add_argument("--report", action="store_true", help="write the run report when done")
    add_resume_arguments(
        p,
        "continue the job's run from its newest intact checkpoint, or from PATH (a run "
        "directory or a checkpoint/step_<n> directory); pipeline.num_stages may differ; a "
        "change of train.* refuses unless --allow-change names it",
    )
    p.set_defaults(func=cmd_run)


def resolve_resume(
    cfg: config_mod.JobConfig,
    path_text: str,
    allowed: Sequence[str] = (),
    out: TextIO | None = None,
) -> Path:
    """The verified checkpoint directory ``--resume [PATH]`` names, checked against the job
    under the resume rules (``allowed``: the ``--allow-change`` keys); prints what it chose and
    each accepted change to ``out`` (default stdout), warnings to stderr."""
    from dynmo_hpc.checkpoint import resume

    chosen = resume.choose_checkpoint(cfg, path_text, allowed)
    out = sys.stdout if out is None else out
    for candidate in chosen.skipped:
        print(
            f"warning: skipping checkpoint {candidate.path}: {candidate.problem}", file=sys.stderr
        )
    if "config" not in chosen.state:
        print(
            f"warning: {chosen.path} predates saved configs: only model, schemes, data, seed and "
            "train.steps were checked, not train.*",
            file=sys.stderr,
        )
    for change in chosen.verdict.accepted:
        print(f"accepted change (--allow-change): {change.describe()}", file=out, flush=True)
    print(
        f"resuming from {chosen.path} (after step {chosen.step} of {cfg.train.steps}, "
        f"{len(chosen.state['parts']) - 1} stages -> {cfg.pipeline.num_stages})",
        file=out,
        flush=True,
    )
    return chosen.path


def check_allow_change(args: argparse.Namespace) -> None:
    """``--allow-change`` only means something with ``--resume``."""
    if args.allow_change and args.resume is None:
        raise config_mod.ConfigError(
            f"--allow-change {args.allow_change[0]} needs --resume (a new run has nothing to "
            "change from); HINT: add --resume, or drop --allow-change"
        )


def _newest_checkpoint(run_dir: Path) -> Path | None:
    from dynmo_hpc.launch.supervisor import newest_checkpoint

    return newest_checkpoint(run_dir)


def _report_failure(outcome: JobOutcome, run_dir: Path, elapsed_s: float) -> int:
    """The one ``error:`` line (and a HINT) for a job that failed for good."""
    last = outcome.failures[-1] if outcome.failures else None
    what = last.describe() if last else f"the MPI step exited with code {outcome.exit_code}"
    tried = f" after {outcome.restarts} restart(s)" if outcome.restarts else ""
    why = f" ({outcome.gave_up})" if outcome.gave_up else ""
    print(
        f"error: training failed{tried} after {elapsed_s:.1f} s: {what}{why}; "
        f"run directory: {run_dir}",
        file=sys.stderr,
    )
    newest = _newest_checkpoint(run_dir)
    hint = "HINT: "
    if last is not None and last.cause == "launcher":
        hint += "check runtime.mpi_launcher and the launcher's own message above; "
    if newest is not None:
        hint += f"{newest} is intact: continue from it with the same command and --resume"
    else:
        hint += "fix the cause and run again (no complete checkpoint was written)"
    if last is not None and last.cause != "launcher" and outcome.gave_up.startswith("fault."):
        hint += "; raise fault.max_restarts to let the job restart by itself"
    print(hint, file=sys.stderr)
    return outcome.exit_code or 1


def _report_interrupt(signum: int, run_dir: Path) -> int:
    """A stop asked for by Ctrl-C, SIGTERM or SIGHUP: say where it stopped; 128 + signal."""
    name = signal.Signals(signum).name
    result_path = run_dir / "result.json"
    newest = _newest_checkpoint(run_dir)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        print(
            f"interrupted ({name}): every rank stopped after step {result['completed_steps']} "
            f"of {result['num_steps']} and wrote checkpoint {newest}; continue with the same "
            "command and --resume",
            file=sys.stderr,
        )
    else:
        where = f"; newest checkpoint: {newest} (continue with --resume)" if newest else ""
        print(
            f"interrupted ({name}): the ranks were stopped before the next step boundary, "
            f"no new checkpoint{where}",
            file=sys.stderr,
        )
    return 128 + signum


def cmd_run(args: argparse.Namespace) -> int:
    """Train the job on ``pipeline.replicas * pipeline.num_stages`` local ranks; print the
    outcome."""
    cfg = config_mod.load(args.job, args.overrides)
    replicas = cfg.pipeline.replicas
    shape = f" ({replicas} replicas x {cfg.pipeline.num_stages} stages)" if replicas > 1 else ""
    print(
        f"dynmo-hpc {__version__}: job '{cfg.job.name}' on {cfg.pipeline.world_size} local "
        f"ranks{shape} -> {cfg.run_dir}",
        flush=True,
    )
    check_allow_change(args)
    resume_from = (
        resolve_resume(cfg, args.resume, args.allow_change) if args.resume is not None else None
    )
    t0 = time.perf_counter()
    outcome = run_local(cfg, resume_from=resume_from, overwrite=args.overwrite)
    run_dir = cfg.run_dir
    result_path = run_dir / "result.json"
    elapsed_s = time.perf_counter() - t0
    if outcome.interrupted:
        return _report_interrupt(outcome.interrupted, run_dir)
    if outcome.exit_code != 0 or not result_path.is_file():
        return _report_failure(outcome, run_dir, elapsed_s)
    result = json.loads(result_path.read_text())
    completed, wanted = result.get("completed_steps"), result.get("num_steps")
    if completed is not None and wanted is not None and completed < wanted:
        print(
            f"stopped by a signal after step {completed} of {wanted}, with a checkpoint; "
            "continue with the same command and --resume"
        )
    for failure in outcome.failures:
        print(f"recovered: {failure.describe()}; restarted from the newest checkpoint")
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
