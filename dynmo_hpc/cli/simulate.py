"""``dynmo-hpc simulate``: how fast would each balancing policy have run this cost history?

Why a subcommand: comparing Megatron's uniform split, DeepSpeed's parameter split and the
dynamic balancers on a run's measured layer costs, or on a made-up cost vector, at a stage count
no machine here has, should take seconds and no cluster. This module parses, builds the cost
reports (from a run log or from ``--costs``), calls :func:`dynmo_hpc.sim.replay.replay` once
per policy and prints the result; the model lives in :mod:`dynmo_hpc.sim`.

Example::

    $ dynmo-hpc simulate --costs 4,1,1,1,1,1,1,1 --stages 2 --microbatches 4 --json
    {"uniform": {"step_time_s": ..., "tokens_per_s": ...}, "parameters": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from dynmo_hpc.balance.common import check_values
from dynmo_hpc.cli.errors import error_line
from dynmo_hpc.cli.plan import _floats
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.pipeline.schedule import SCHEDULES
from dynmo_hpc.sim.replay import POLICIES, CostReport, ReplaySetup, replay
from dynmo_hpc.sim.step import transfer_time_s

log = logging.getLogger(__name__)

HINT = "see dynmo-hpc simulate --help"
PROGRESS_EVERY_S = 5.0
"""A replay longer than this logs how far it got, this often."""
DEFAULT_BANDWIDTH_GBPS = 100.0
COSTS_STEPS_PER_INTERVAL = 10
"""``--costs`` without ``--steps``: replay this many intervals (constant costs, so only the
first decision matters; more would only take longer)."""


def _policies(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none)'}; choose from {','.join(POLICIES)}"
        )
    return names


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``simulate`` on ``subparsers``; the parsed args carry ``func=run``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay layer costs on a simulated pipeline under each balancing policy",
        description=(
            "Simulate every pipeline step (forward/backward of each microbatch on each stage) "
            "of a run's load reports, or of a constant cost vector, under each policy."
        ),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="run_log", type=Path, help="a run log (run.h5 or its dir)")
    source.add_argument(
        "--costs", type=_floats, help="seconds per layer per step (forward + backward), e.g. 1,2,3"
    )
    p.add_argument("--stages", type=int, help="pipeline stages P (default: the run's)")
    p.add_argument("--microbatches", type=int, help="microbatches per step M (default: the run's)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), help="default: the run's, or 1f1b")
    p.add_argument("--interval", type=int, help="steps per load report (default: the run's, or 10)")
    p.add_argument("--steps", type=int, help="steps to replay (default: all the run's reports)")
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICIES),
        help=f"comma-separated, default {','.join(POLICIES)}",
    )
    p.add_argument("--latency-s", type=float, default=0.0, help="per message, default 0")
    bandwidth = p.add_mutually_exclusive_group()
    bandwidth.add_argument(
        "--bandwidth-gbps",
        type=float,
        help=f"point-to-point Gbit/s (default {DEFAULT_BANDWIDTH_GBPS:g})",
    )
    bandwidth.add_argument("--bandwidth-bytes-per-s", type=float, help="the same in bytes/s")
    p.add_argument(
        "--activation-bytes",
        type=float,
        help="bytes per microbatch between stages (default: the run's batch x seq x d_model x 4, "
        "or 0)",
    )
    p.add_argument("--margin", type=float, help="decision margin (default: the run's, or 0.1)")
    p.add_argument(
        "--backward-ratio",
        type=float,
        default=2.0,
        help="with --costs: backward / forward time (default 2)",
    )
    p.add_argument(
        "--params", type=_floats, help="with --costs: parameters per layer (default: all equal)"
    )
    p.add_argument(
        "--layer-bytes", type=float, default=0.0, help="with --costs: bytes a layer migrates with"
    )
    p.add_argument(
        "--tokens-per-microbatch",
        type=int,
        help="default: the run's micro_batch_size x seq_len, or 1",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _pick(given: Any, default: Any) -> Any:
    return default if given is None else given


def _inputs(args: argparse.Namespace) -> tuple[list[CostReport], ReplaySetup, int]:
    """Reports, setup and tokens per microbatch; raises ValueError or DynmoError."""
    if args.bandwidth_bytes_per_s is not None:
        bandwidth = float(args.bandwidth_bytes_per_s)
    else:
        bandwidth = _pick(args.bandwidth_gbps, DEFAULT_BANDWIDTH_GBPS) * 1e9 / 8
    if args.run_log is not None:
        from dynmo_hpc.runlog import load
        from dynmo_hpc.sim.runlog_traces import traces_from_runlog

        path = args.run_log / "run.h5" if args.run_log.is_dir() else args.run_log
        traces = traces_from_runlog(load(path))
        reports = traces.reports
        interval = _pick(args.interval, traces.interval)
        defaults = {
            "stages": traces.num_stages,
            "microbatches": traces.num_microbatches,
            "schedule": traces.schedule,
            "margin": traces.margin,
            "activation_bytes": traces.activation_bytes,
            "tokens_per_microbatch": traces.tokens_per_microbatch,
            "steps": interval * len(reports),
        }
        smoothing = traces.smoothing
    else:
        reports = [_constant_report(args)]
        interval = _pick(args.interval, 10)
        missing = [f"--{n}" for n in ("stages", "microbatches") if getattr(args, n) is None]
        if missing:
            raise ValueError(
                f"--costs needs {' and '.join(missing)}; HINT: e.g. --stages 2 --microbatches 8"
            )
        defaults = {
            "schedule": "1f1b",
            "margin": 0.1,
            "activation_bytes": 0.0,
            "tokens_per_microbatch": 1,
            "steps": COSTS_STEPS_PER_INTERVAL * interval,
        }
        smoothing = 0.5
    value = {key: _pick(getattr(args, key), default) for key, default in defaults.items()}
    stages = _pick(args.stages, value.get("stages"))
    microbatches = _pick(args.microbatches, value.get("microbatches"))
    if value["tokens_per_microbatch"] < 1:
        raise ValueError(f"--tokens-per-microbatch={value['tokens_per_microbatch']} must be >= 1")
    comm_s = transfer_time_s(args.latency_s, bandwidth, float(value["activation_bytes"]))
    setup = ReplaySetup(
        num_stages=stages,
        num_microbatches=microbatches,
        schedule=value["schedule"],
        interval=interval,
        num_steps=value["steps"],
        comm_s=comm_s if stages > 1 else 0.0,
        bandwidth_bytes_per_s=bandwidth,
        margin=value["margin"],
        smoothing=smoothing,
    )
    setup.check()
    return reports, setup, int(value["tokens_per_microbatch"])


def _constant_report(args: argparse.Namespace) -> CostReport:
    """``--costs`` as one load report, split into forward and backward by ``--backward-ratio``."""
    costs = check_values(args.costs, "--costs")
    ratio = args.backward_ratio
    if not (math.isfinite(ratio) and ratio >= 0):
        raise ValueError(f"--backward-ratio={ratio!r} must be finite and >= 0")
    # Without --params every layer is the same size (a stack of identical blocks).
    params = (
        check_values(args.params, "--params") if args.params is not None else [1.0] * len(costs)
    )
    if len(params) != len(costs):
        raise ValueError(f"--params has {len(params)} entries but --costs has {len(costs)}")
    if not (math.isfinite(args.layer_bytes) and args.layer_bytes >= 0):
        raise ValueError(f"--layer-bytes={args.layer_bytes!r} must be finite and >= 0")
    report = CostReport(
        forward_s=[c / (1.0 + ratio) for c in costs],
        backward_s=[c * ratio / (1.0 + ratio) for c in costs],
        num_params=[round(p) for p in params],
        layer_bytes=[round(args.layer_bytes)] * len(costs),
    )
    report.check()
    return report


def _progress(policy: str) -> Any:
    """A callback that logs at most every :data:`PROGRESS_EVERY_S` seconds."""
    started = last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            log.info("simulate %s: step %d/%d (%.0f s)", policy, done, total, now - started)

    return report


def run(args: argparse.Namespace) -> int:
    """Print the per-policy results; a bad input is one ``error:`` line and exit 2."""
    try:
        reports, setup, tokens_per_microbatch = _inputs(args)
        results = {p: replay(reports, setup, p, _progress(p)) for p in args.policies}
    except (DynmoError, FileNotFoundError, ValueError) as exc:
        print(error_line(exc, HINT), file=sys.stderr)
        return 2
    tokens_per_step = tokens_per_microbatch * setup.num_microbatches
    summary = {
        p: {
            "step_time_s": r.median_step_time_s,
            "tokens_per_s": r.tokens_per_s(tokens_per_step),
        }
        for p, r in results.items()
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"{setup.num_stages} stages, {setup.num_microbatches} microbatches, {setup.schedule}, "
        f"{setup.num_steps} steps, load report every {setup.interval}"
    )
    print(f"{'policy':<12}{'step_time_s':>14}{'tokens_per_s':>16}{'migrations':>12}")
    for p, r in results.items():
        print(
            f"{p:<12}{summary[p]['step_time_s']:>14.6g}{summary[p]['tokens_per_s']:>16.6g}"
            f"{r.migrations:>12d}"
        )
    return 0
