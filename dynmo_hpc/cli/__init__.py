"""``dynmo-hpc``: run jobs locally, plan partitions, report on and simulate runs, submit to SLURM.

One module per subcommand (:mod:`~dynmo_hpc.cli.run`, :mod:`~dynmo_hpc.cli.plan`,
:mod:`~dynmo_hpc.cli.report`, :mod:`~dynmo_hpc.cli.simulate`, :mod:`~dynmo_hpc.cli.bench`,
:mod:`~dynmo_hpc.cli.prepare_data`, :mod:`~dynmo_hpc.cli.slurm` for ``sbatch`` and
``submit``, :mod:`~dynmo_hpc.cli.eval` and :mod:`~dynmo_hpc.cli.export` for models). The CLI is
the only place that parses argv or prints; everything it calls logs or returns values, and
nothing outside this package imports it. Every user error (a
:class:`~dynmo_hpc.errors.DynmoError`, a missing file) becomes one ``error:`` line and exit
code 2.
"""

from __future__ import annotations

import argparse
import sys

from dynmo_hpc.cli import bench, export, plan, prepare_data, report, run, simulate, slurm
from dynmo_hpc.cli import eval as eval_cmd
from dynmo_hpc.cli.errors import OneLineParser, error_line
from dynmo_hpc.errors import DynmoError, Interrupted
from dynmo_hpc.logging_utils import setup_logging
from dynmo_hpc.version import __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``dynmo-hpc`` argument parser with every subcommand."""
    parser = OneLineParser(
        prog="dynmo-hpc",
        description="Balanced pipeline-parallel training of dynamic LLMs (DynMo).",
    )
    parser.add_argument("--version", action="version", version=f"dynmo-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    plan.add_parser(sub)
    report.add_parser(sub)
    simulate.add_parser(sub)
    bench.add_parser(sub)
    eval_cmd.add_parser(sub)
    export.add_parser(sub)
    prepare_data.add_parser(sub)
    slurm.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dynmo-hpc`` console script."""
    setup_logging(0)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Interrupted as exc:
        print(str(exc), file=sys.stderr)
        return 128 + exc.signum
    except (DynmoError, FileNotFoundError, ValueError) as exc:
        hint = f"see dynmo-hpc {args.command} --help"
        print(error_line(exc, hint), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
