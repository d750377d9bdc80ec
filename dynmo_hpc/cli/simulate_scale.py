"""``dynmo-hpc simulate --from RUN.h5 --model MODEL.yaml --stages 8,16,32,64 --machine FILE``.

Why a separate path: without ``--model`` the simulator replays the run's own measured seconds
on its own model; with it, the run's scheme trajectory (its ``layer_states``) is mapped onto the
model of MODEL.yaml and priced by the per-layer cost model on the machine file's rates
(:mod:`dynmo_hpc.sim.scale`), at each stage count. This module only parses, reads and prints.

Example::

    $ dynmo-hpc simulate --from runs/pruning/run.h5 --model benchmarks/scale_models/pruning.yaml \\
          --stages 8,16 --machine benchmarks/machine_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.cli.errors import error_line
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.sim.cost_model import layer_shapes
from dynmo_hpc.sim.machine import load_machine
from dynmo_hpc.sim.replay import ReplaySetup
from dynmo_hpc.sim.scale import BASELINES, MAPPINGS, StageResult, scale_reports, simulate_stages
from dynmo_hpc.sim.scale_limits import paper_difference, what_limits
from dynmo_hpc.sim.step import transfer_time_s

HINT = "see dynmo-hpc simulate --help (docs/simulate.md, 'At scale')"
DEFAULT_BANDWIDTH_BYTES_PER_S = 100e9 / 8
BYTES_PER_ACTIVATION = 4


def stage_list(text: str) -> list[int]:
    """``--stages``: one count, or a comma-separated list of them (``8,16,32,64``)."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give stage counts, e.g. 8,16,32")
    return values  # a count < 1 is refused with the pipeline's other settings


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the at-scale path."""
    p.add_argument(
        "--model",
        type=Path,
        help="with --from and --machine: a job YAML whose model (and train.micro_batch_size, "
        "train.num_microbatches) the run's scheme trajectory is mapped onto",
    )
    p.add_argument(
        "--mapping",
        choices=MAPPINGS,
        default="depth",
        help="with --model: block j of the larger model takes the run's block at the same "
        "relative depth (depth), or block j mod N (periodic)",
    )
    p.add_argument(
        "--steady-from",
        type=int,
        help="with --model: first steady-state step (default: the run's train.steady_state_step,"
        " else half the run)",
    )


def _check_args(args: argparse.Namespace) -> None:
    if args.run_log is None:
        raise ValueError("--model needs --from RUN.h5; HINT: the run gives the trajectory")
    if args.machine is None:
        raise ValueError(
            "--model needs --machine FILE with layer_flops_per_s, layer_bytes_per_s and "
            "layer_overhead_s; HINT: e.g. --machine benchmarks/machine_h200.json"
        )


def _run_settings(run: Any) -> dict[str, Any]:
    """The run's balance settings and steady state (defaults as the config's)."""
    balance = run.config.get("balance") or {}
    train = run.config.get("train") or {}
    steady = train.get("steady_state_step")
    return {
        "interval": int(balance.get("interval", 10)),
        "margin": float(balance.get("margin", 0.1)),
        "smoothing": float(balance.get("smoothing", 0.5)),
        "steady": int(train.get("steps", 0)) // 2 if steady is None else int(steady),
    }


def scale_results(args: argparse.Namespace) -> tuple[dict[str, Any], list[StageResult]]:
    """The setup summary and one :class:`StageResult` per ``--stages`` entry."""
    from dynmo_hpc.runlog import load
    from dynmo_hpc.sim.scale_runlog import trajectory_from_runlog

    _check_args(args)
    machine = load_machine(args.machine)
    if machine.layer_rates is None:
        raise ValueError(
            f"machine file {args.machine} has no layer_* rates; HINT: the per-layer cost model "
            "needs layer_flops_per_s, layer_bytes_per_s and layer_overhead_s"
        )
    cfg = config_mod.load(args.model)
    path = args.run_log / "run.h5" if args.run_log.is_dir() else args.run_log
    run = load(path)
    trajectory = trajectory_from_runlog(run)
    settings = _run_settings(run)
    micro = cfg.train.micro_batch_size
    m = args.microbatches or cfg.train.num_microbatches
    moe = cfg.schemes.moe
    reports = scale_reports(
        trajectory,
        layer_shapes(cfg.model, micro),
        machine.layer_rates,
        m,
        mapping=args.mapping,
        expert_d_ff=(moe.d_ff_expert if moe is not None else None),
        padded=moe is not None and moe.dispatch == "padded",
    )
    bandwidth = machine.bandwidth_bytes_per_s or DEFAULT_BANDWIDTH_BYTES_PER_S
    activation = micro * cfg.model.seq_len * cfg.model.d_model * BYTES_PER_ACTIVATION
    comm_s = transfer_time_s(machine.latency_s or 0.0, bandwidth, float(activation))
    interval = args.interval or settings["interval"]
    steady = settings["steady"] if args.steady_from is None else args.steady_from
    algorithms = list(args.algorithms or ALGORITHMS)  # every algorithm; no packing at scale
    results = []
    for stages in args.stages or [cfg.pipeline.num_stages]:
        if stages > cfg.model.num_layers:
            raise ValueError(
                f"--stages {stages} > the model's {cfg.model.num_layers} layers; HINT: use a "
                "model with more blocks or fewer stages"
            )
        setup = ReplaySetup(
            num_stages=stages,
            num_microbatches=m,
            schedule=args.schedule or "1f1b",
            interval=interval,
            num_steps=interval * len(reports),
            comm_s=comm_s if stages > 1 else 0.0,
            bandwidth_bytes_per_s=bandwidth,
            margin=args.margin if args.margin is not None else settings["margin"],
            smoothing=settings["smoothing"],
        )
        results.append(simulate_stages(reports, setup, algorithms, steady))
    summary = {
        "run": str(path),
        "model": str(args.model),
        "machine": str(args.machine),
        "blocks": cfg.model.num_blocks,
        "microbatches": m,
        "reports": len(reports),
        "steady_from_step": steady,
        "mapping": args.mapping,
    }
    return summary, results


def limits_json(result: StageResult, paper: float | None = None) -> dict[str, Any] | None:
    """The stage count's :class:`~dynmo_hpc.sim.scale_limits.RowLimits` as plain JSON, with its
    ceiling, capture, the limit in words and (``paper``: an "up to" figure) the difference."""
    lim = result.limits
    if lim is None:
        return None
    return {
        **dataclasses.asdict(lim),
        "ceiling": lim.ceiling,
        "capture": lim.capture,
        "what_limits": what_limits(lim),
        "paper_difference": paper_difference(lim, paper),
    }


def result_json(result: StageResult) -> dict[str, Any]:
    """One stage count as plain JSON."""
    return {
        "stages": result.num_stages,
        "microbatches": result.num_microbatches,
        "median_step_s": result.median_step_s,
        "limits": limits_json(result),
        "block_spread": result.block_spread,
        "speedup": {
            a: {b: {"median": s.median, "steady_max": s.steady_max} for b, s in per.items()}
            for a, per in result.speedups.items()
        },
    }


def run_scale(args: argparse.Namespace) -> int:
    """Print the at-scale speedups; a bad input is one ``error:`` line and exit 2."""
    try:
        summary, results = scale_results(args)
    except (DynmoError, FileNotFoundError, ValueError) as exc:
        print(error_line(exc, HINT), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**summary, "results": [result_json(r) for r in results]}))
        return 0
    print(
        f"{summary['model']}: {summary['blocks']} blocks, {summary['microbatches']} "
        f"microbatches; trajectory of {summary['run']} ({summary['reports']} reports, "
        f"{summary['mapping']} mapping, steady from step {summary['steady_from_step']})"
    )
    head = "".join(f"  {'/' + b + ' med':>15}{'max':>7}" for b in BASELINES)
    print(f"{'stages':>6} {'algorithm':<11}{'step_s':>11}{head}")
    for r in results:
        for a, per in r.speedups.items():
            cells = "".join(f"  {per[b].median:>15.3f}{per[b].steady_max:>7.3f}" for b in BASELINES)
            print(f"{r.num_stages:>6} {a:<11}{r.median_step_s[a]:>11.4g}{cells}")
        if r.limits is not None:
            lim = r.limits
            print(
                f"{r.num_stages:>6} {lim.best_balancer} over {lim.best_static} (steady state): "
                f"{what_limits(lim)}"
            )
    return 0
