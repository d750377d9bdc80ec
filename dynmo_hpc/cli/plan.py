"""``dynmo-hpc plan``: what would the balancer do with these costs? Offline, in milliseconds.

Why a subcommand: choosing a stage count, checking a memory capacity, or comparing Megatron's
uniform split with the optimum should not need a cluster. This module only parses, calls
:func:`dynmo_hpc.balance.partition` and prints one JSON object; all decisions live in the pure
package.

Example::

    $ dynmo-hpc plan --costs 0,1,2,3,3,3 --stages 4 --algorithm optimal
    {"algorithm": "optimal", "num_layers": 6, "num_stages": 4, "parts": [0, 3, 4, 5, 6],
     "stage_loads": [3.0, 3.0, 3.0, 3.0], "bottleneck": 3.0, "optimal_bottleneck": 3.0}
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from dynmo_hpc.balance import (
    ALGORITHMS,
    algorithm_options,
    optimal_bottleneck,
    partition,
    plan_moves,
    stage_loads,
)
from dynmo_hpc.cli.errors import error_line


def _floats(text: str) -> list[float]:
    """``"1,2.5, 3"`` -> ``[1.0, 2.5, 3.0]``; argparse turns the error into a usage message."""
    try:
        return [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 1,2.5,3; got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers like 0,3,6; got {text!r}"
        ) from None


OPTION_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("--capacity", float, "bytes per stage (needs --memory)"),
    ("--memory", _floats, "memory_bytes per layer, e.g. 4e9,4e9,8e9"),
    ("--params", _floats, "parameter counts per layer"),
    ("--current", _ints, "partition in use, e.g. 0,3,6 (kept if nothing is better)"),
    ("--max-rounds", int, "cap on rounds (default: none)"),
)
"""The algorithm options the command line can give: flag, parser, help. Each is passed only
when given, under its keyword name (``--max-rounds`` -> ``max_rounds``)."""


def _takers(option: str) -> str:
    """The algorithms whose function takes keyword ``option``, for the help text."""
    names = [name for name in ALGORITHMS if option in algorithm_options(name)]
    return ", ".join(names) or "none"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``plan`` on ``subparsers``; the parsed args carry ``func=run``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="partition layer costs over pipeline stages and print the plan as JSON",
        description="Partition per-layer costs over pipeline stages; prints JSON to stdout.",
    )
    p.add_argument(
        "--costs", type=_floats, required=True, help="seconds per layer per step, e.g. 1,2,3"
    )
    p.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    p.add_argument(
        "--algorithm",
        choices=list(ALGORITHMS),
        default="optimal",
        help="; ".join(f"{name}: {entry.label}" for name, entry in ALGORITHMS.items())
        + " (default: optimal)",
    )
    for flag, kind, text in OPTION_FLAGS:
        option = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, help=f"{text} (taken by: {_takers(option)})")
    p.set_defaults(func=run)
    return p


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Only the options the user gave, so ``partition`` can reject those an algorithm lacks."""
    options: dict[str, Any] = {}
    for flag, _, _ in OPTION_FLAGS:
        key = flag[2:].replace("-", "_")
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    return options


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON-ready plan for parsed ``args``; raises ValueError on bad input."""
    options = _options(args)
    parts = partition(args.costs, args.stages, args.algorithm, **options)
    memory = options.get("memory") if "capacity" in options else None
    result: dict[str, Any] = {
        "algorithm": args.algorithm,
        "num_layers": len(args.costs),
        "num_stages": args.stages,
        "parts": parts,
        "stage_loads": stage_loads(args.costs, parts),
    }
    result["bottleneck"] = max(result["stage_loads"])
    result["optimal_bottleneck"] = optimal_bottleneck(
        args.costs, args.stages, memory=memory, capacity=options.get("capacity")
    )
    if memory is not None:
        result["stage_memory"] = stage_loads(memory, parts)
    if "current" in options:
        result["num_moves"] = len(plan_moves(options["current"], parts))
    return result


def run(args: argparse.Namespace) -> int:
    """Print the plan as one JSON line; on bad input print ``error: ...`` to stderr, return 2."""
    try:
        result = plan(args)
    except ValueError as exc:
        print(
            error_line(exc, "fix the option it names; see dynmo-hpc plan --help"), file=sys.stderr
        )
        return 2
    print(json.dumps(result))
    return 0
