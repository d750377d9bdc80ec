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
