"""``dynmo-hpc report RUN.h5``: print a run log's summary and write it with PNG figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dynmo_hpc.errors import DynmoError
from dynmo_hpc.runlog.report import DEFAULT_WINDOW_STEPS, write_report


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="summarise a run log and plot it",
        description="Print a text summary of RUN.h5 and write it with PNG figures to --out.",
    )
    parser.add_argument(
        "run_log", type=Path, metavar="RUN.h5", help="run log, or its run directory"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: <run dir>/report)",
    )
    parser.add_argument(
        "--window-steps",
        type=int,
        default=DEFAULT_WINDOW_STEPS,
        metavar="N",
        help=f"steps before/after an event to measure its effect (default {DEFAULT_WINDOW_STEPS})",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the ``report`` subcommand: print the summary and the written paths; 0 on success."""
    path = args.run_log / "run.h5" if args.run_log.is_dir() else args.run_log
    try:
        result = write_report(path, args.out, window_steps=args.window_steps)
    except DynmoError:
        raise  # the CLI prints it as one ``error:`` line
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the output directory cannot be written
        print(f"error: {exc}; HINT: choose a writable --out directory", file=sys.stderr)
        return 2
    print(result.summary, end="")
    print(f"summary: {result.summary_path}")
    for png in result.png_paths.values():
        print(f"figure:  {png}")
    return 0
