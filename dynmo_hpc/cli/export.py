"""``dynmo-hpc export CHECKPOINT --out DIR``: a Hugging Face directory transformers loads.

Writes ``config.json`` and ``model.safetensors`` (:mod:`dynmo_hpc.checkpoint.hf_export` says what
each scheme exports); ``--dense-backbone`` exports models whose routing, early exits or sparse
attention Hugging Face cannot express as their dense backbone, and prints what changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dynmo_hpc.checkpoint.hf_export import export_model
from dynmo_hpc.checkpoint.model_files import load_model


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory",
        description="Write CHECKPOINT (a run directory, its checkpoint directory or a "
        "checkpoint/step_<n>) as config.json + model.safetensors to the new directory --out.",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="new directory")
    parser.add_argument(
        "--dense-backbone",
        action="store_true",
        help="export MoD, early-exit and sparse-attention models without their routers, exit "
        "heads and sparsity (every token runs every block densely: the function changes)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the ``export`` subcommand; 0 on success."""
    loaded = load_model(args.checkpoint)
    notes = export_model(loaded, args.out, dense_backbone=args.dense_backbone)
    print(f"exported {loaded.source} -> {args.out}")
    for note in notes:
        print(f"  {note}")
    return 0
