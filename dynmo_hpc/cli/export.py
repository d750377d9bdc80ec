"""``dynmo-hpc export CHECKPOINT --out DIR``: a Hugging Face directory transformers loads.

Writes ``config.json`` and ``model.safetensors`` (:mod:`dynmo_hpc.checkpoint.hf_export` says what
each scheme exports), and the tokenizer files when the run's data was tokenized (a prepared
directory, or a ``data.tokenizer`` cache); ``--dense-backbone`` exports models whose routing,
early exits or sparse attention Hugging Face cannot express as their dense backbone, and prints
what changes.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from dynmo_hpc.config import JobConfig
from dynmo_hpc.data.source import tokenizer_file
from dynmo_hpc.errors import DynmoError

log = logging.getLogger(__name__)


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
    # torch and the model load here, not at import: every other subcommand starts seconds sooner.
    from dynmo_hpc.checkpoint.hf_export import export_model
    from dynmo_hpc.checkpoint.model_files import load_model

    loaded = load_model(args.checkpoint)
    tokenizer = _run_tokenizer(loaded.cfg)
    notes = export_model(loaded, args.out, dense_backbone=args.dense_backbone, tokenizer=tokenizer)
    print(f"exported {loaded.source} -> {args.out}")
    if tokenizer is not None:
        print(f"  tokenizer: {tokenizer}")
    for note in notes:
        print(f"  {note}")
    return 0


def _run_tokenizer(cfg: JobConfig) -> Path | None:
    """The run's ``tokenizer.json``, or None (byte-level data, a ``.bin`` file, an imported
    Hugging Face directory). One warning line when the run's data had one that is gone."""
    try:
        path = tokenizer_file(cfg.data, cfg.job.out_dir)
    except DynmoError as exc:
        log.warning("the run's tokenizer cannot be found (%s): exported without it", exc)
        return None
    if path is not None and not path.is_file():
        log.warning("the run's tokenizer %s is not there: exported without it", path)
        return None
    return path
