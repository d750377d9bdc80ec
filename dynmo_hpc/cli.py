"""``dynmo-hpc``: run jobs locally, plan partitions, report on run logs, submit to SLURM.

The CLI is the only place that prints; everything it calls logs or returns values. Every user
error (bad YAML, missing file, missing mpiexec) becomes one ``error:`` line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from . import __version__
from . import config as config_mod
from .checkpoint import atomic_write_text
from .launcher import LaunchError, LaunchSpec, LocalMpiLauncher, worker_argv
from .logging_utils import setup_logging

log = logging.getLogger(__name__)


def add_overrides_argument(p: argparse.ArgumentParser, example: str = "train.steps=20") -> None:
    """The repeatable ``--set SECTION.KEY=VALUE`` option every job command takes."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=f"override a config value (repeatable), e.g. --set {example}",
    )


def _add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="train a job on local MPI ranks (no SLURM needed)")
    p.add_argument("job", help="job YAML, e.g. jobs/default.yaml")
    add_overrides_argument(p)
    p.add_argument("--report", action="store_true", help="write the run report when done")
    p.set_defaults(func=cmd_run)


def prepare_run_dir(cfg: config_mod.JobConfig) -> Path:
    """Create ``runs/<job>/`` and write the resolved config the ranks will load."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    atomic_write_text(config_path, cfg.to_yaml())
    return config_path


def launch_local(cfg: config_mod.JobConfig, timeout_s: float | None = None) -> tuple[int, Path]:
    """Run ``cfg`` on ``pipeline.num_stages`` local ranks; returns (exit code, run directory).

    A stale ``result.json`` from an earlier run of the same job is removed first, so a result
    file in the run directory always belongs to this run.
    """
    launcher = LocalMpiLauncher(cfg.runtime.mpi_launcher)
    config_path = prepare_run_dir(cfg)
    (config_path.parent / "result.json").unlink(missing_ok=True)
    spec = LaunchSpec(num_ranks=cfg.pipeline.num_stages, rank_argv=worker_argv(config_path))
    rc = launcher.run(spec, timeout_s=cfg.runtime.timeout_s if timeout_s is None else timeout_s)
    return rc, config_path.parent


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.job, args.overrides)
    print(
        f"dynmo-hpc {__version__}: job '{cfg.job.name}' on {cfg.pipeline.num_stages} local ranks "
        f"-> {cfg.run_dir}",
        flush=True,
    )
    t0 = time.perf_counter()
    rc, run_dir = launch_local(cfg)
    result_path = run_dir / "result.json"
    elapsed_s = time.perf_counter() - t0
    if rc != 0 or not result_path.is_file():
        print(
            f"error: training failed (exit code {rc}) after {elapsed_s:.1f} s; the failing "
            f"rank's traceback is above; run directory: {run_dir}",
            file=sys.stderr,
        )
        return rc or 1
    result = json.loads(result_path.read_text())
    print(
        f"done in {elapsed_s:.1f} s: {len(result['losses'])} steps, loss "
        f"{result['losses'][0]:.4f} -> {result['final_loss']:.4f}, "
        f"median {result['median_tokens_per_s']:.0f} tokens/s, final partition {result['parts']}"
    )
    print(f"run log: {run_dir / 'run.h5'}")
    if cfg.train.checkpoint:
        print(f"checkpoint: {run_dir / 'checkpoint'}")
    if args.report:
        from .report import write_report

        report = write_report(run_dir / "run.h5", run_dir / "report")
        print(f"report: {report.out_dir} ({len(report.png_paths)} figures)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynmo-hpc",
        description="Balanced, elastic pipeline-parallel training of dynamic LLMs (DynMo).",
    )
    parser.add_argument("--version", action="version", version=f"dynmo-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    from . import plan_cli, report
    from .slurm import cli as slurm_cli

    plan_cli.add_parser(sub)
    report.add_parser(sub)
    slurm_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging(0)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (config_mod.ConfigError, LaunchError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
