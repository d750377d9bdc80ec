"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse


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


OVERWRITE_HELP = (
    "start this job's run afresh: first names, then removes, the earlier run's run log "
    "(run.h5), result.json, report/ and every checkpoint under checkpoint/ (kept checkpoints "
    "of the old run could otherwise be resumed into the new one); config.yaml, SLURM logs and "
    "submitit/ stay"
)


def add_resume_arguments(p: argparse.ArgumentParser, resume_help: str) -> None:
    """``--resume [PATH]`` / ``--overwrite`` (exclusive) and the repeatable ``--allow-change``."""
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", nargs="?", const="", default=None, metavar="PATH", help=resume_help
    )
    mode.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument(
        "--allow-change",
        dest="allow_change",
        action="append",
        default=[],
        metavar="SECTION.KEY",
        help="with --resume: accept a change of a key that alters the training math since the "
        "checkpoint (train.lr, train.weight_decay, train.beta1, ... or lowering train.steps); "
        "repeatable; the new value applies and the run log records it (docs/checkpoints.md, "
        '"Resume rules")',
    )
