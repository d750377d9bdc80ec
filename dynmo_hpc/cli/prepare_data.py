"""``dynmo-hpc prepare-data TEXT... --out DIR``: tokenize text into shards a job trains on.

Parses, calls :func:`dynmo_hpc.data.prepare.prepare` and prints what it wrote; the work and its
checks live there. A job then trains on the result with ``data.path: DIR``.

Example::

    $ dynmo-hpc prepare-data corpus/*.txt --out data/corpus --train-tokenizer --vocab-size 8192
    prepared data/corpus: 1234567 train + 137174 val tokens, vocabulary 8192 (uint16)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dynmo_hpc.data.prepare import DEFAULT_SHARD_TOKENS, TokenizerChoice, prepare


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``prepare-data`` subcommand to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prepare-data",
        help="tokenize text files into token shards for data.path",
        description=(
            "Tokenize UTF-8 text files with a Hugging Face tokenizer (given, or a byte-level "
            "BPE trained on the text) into memory-mappable token shards, a validation split, "
            "the tokenizer and meta.json, written atomically to --out."
        ),
    )
    parser.add_argument("texts", type=Path, nargs="*", metavar="TEXT", help="UTF-8 text files")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, metavar="FILE", help="an existing tokenizer.json"
    )
    parser.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a byte-level BPE tokenizer on the input (with --vocab-size)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, metavar="N", help="trained vocabulary (>= 256)"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="tail fraction of the text held out for validation (default 0.1)",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"token ids per shard file (default {DEFAULT_SHARD_TOKENS})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out directory"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``prepare-data``: print where the shards went; 0 on success."""
    if args.tokenizer is not None and (args.train_tokenizer or args.vocab_size is not None):
        raise ValueError(
            "--tokenizer and --train-tokenizer/--vocab-size exclude each other; HINT: give one"
        )
    if args.vocab_size is not None and not args.train_tokenizer:
        raise ValueError("--vocab-size needs --train-tokenizer; HINT: add --train-tokenizer")
    if args.train_tokenizer and args.vocab_size is None:
        raise ValueError("--train-tokenizer needs --vocab-size; HINT: e.g. --vocab-size 8192")
    choice = TokenizerChoice(path=args.tokenizer, vocab_size=args.vocab_size)
    result = prepare(
        list(args.texts),
        args.out,
        choice,
        val_fraction=args.val_fraction,
        overwrite=args.overwrite,
        shard_tokens=args.shard_tokens,
    )
    counts = result.meta["num_tokens"]
    print(
        f"prepared {result.out}: {counts['train']} train + {counts['val']} val tokens, "
        f"vocabulary {result.meta['vocab_size']} ({result.meta['dtype']})"
    )
    return 0
