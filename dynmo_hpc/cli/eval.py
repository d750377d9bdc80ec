"""``dynmo-hpc eval MODEL --data TOKENS --seq-len L --windows N``: print ``loss <float>``.

MODEL is a run directory, checkpoint directory or ``step_<n>`` checkpoint of ours, or a Hugging
Face model directory. TOKENS is a flat little-endian ``uint16`` file; window ``i`` is tokens
``i*(L+1) .. i*(L+1)+L`` (inputs its first L tokens, targets its last L). The loss is the mean
next-token cross-entropy over the N windows, fp32, on one process
(:mod:`dynmo_hpc.model.evaluate`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dynmo_hpc.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "eval",
        help="score a checkpoint or Hugging Face model on a token file",
        description="Print 'loss <float>': the mean next-token cross-entropy (fp32, one "
        "process) of MODEL over the first N windows of L+1 tokens of TOKENS.",
    )
    parser.add_argument(
        "model", type=Path, metavar="MODEL", help="run/checkpoint directory or HF model directory"
    )
    parser.add_argument(
        "--data", type=Path, required=True, metavar="TOKENS", help="flat uint16 .bin token file"
    )
    parser.add_argument("--seq-len", type=int, required=True, metavar="L", help="inputs per window")
    parser.add_argument("--windows", type=int, required=True, metavar="N", help="windows scored")
    parser.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="windows per forward (default 8)"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the ``eval`` subcommand; 0 on success."""
    # torch and the model load here, not at import: every other subcommand starts seconds sooner.
    import torch

    from dynmo_hpc.checkpoint.model_files import load_model
    from dynmo_hpc.data.tokens import check_vocab, open_tokens
    from dynmo_hpc.model.evaluate import mean_loss, windows

    torch.manual_seed(0)
    tokens = open_tokens(args.data, what="--data")
    batch = windows(tokens, args.seq_len, args.windows)
    loaded = load_model(args.model, seq_len=args.seq_len)
    model = loaded.cfg.model
    check_vocab(tokens[: len(batch) * (args.seq_len + 1)], model.vocab_size, source=str(args.data))
    if model.arch == "gpt2" and args.seq_len > model.num_positions:
        raise ConfigError(
            f"--seq-len {args.seq_len} > the model's {model.num_positions} positions; "
            f"HINT: use --seq-len {model.num_positions} or less"
        )
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    print(f"loss {mean_loss(loaded.layers, batch, args.batch_size):.6f}")
    return 0
