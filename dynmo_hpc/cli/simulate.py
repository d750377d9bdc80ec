"""``dynmo-hpc simulate``: how fast would each balancing algorithm have run this cost history?

Why a subcommand: comparing Megatron's uniform split, DeepSpeed's parameter split and the
dynamic balancers on a run's measured layer costs, or on a made-up cost vector, at a stage count
no machine here has, should take seconds and no cluster. This module parses, builds the cost
reports (from a run log or from ``--costs``), calls :func:`dynmo_hpc.sim.replay.replay` once
per algorithm (:func:`~dynmo_hpc.sim.replay.replay_algorithms`: the registry's, and ``packing``)
and prints the result; the model lives in :mod:`dynmo_hpc.sim`.

Example::

    $ dynmo-hpc simulate --costs 4,1,1,1,1,1,1,1 --stages 2 --microbatches 4 --json
    {"uniform": {"step_time_s": ..., "tokens_per_s": ...}, "parameters": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance.common import check_values
from dynmo_hpc.cli.errors import error_line
from dynmo_hpc.cli.plan import _floats
from dynmo_hpc.cli.simulate_scale import add_scale_arguments, run_scale, stage_list
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.pipeline.schedule import SCHEDULES
from dynmo_hpc.pipeline.waiting import WAIT_YIELD_S
from dynmo_hpc.sim.heldout import HeldOutRow, predict_pair
from dynmo_hpc.sim.machine import MachineModel, load_machine, shipped_machine_path
from dynmo_hpc.sim.replay import (
    CostReport,
    PackingSetup,
    ReplaySetup,
    replay,
    replay_algorithms,
)
from dynmo_hpc.sim.step import transfer_time_s

log = logging.getLogger(__name__)

HINT = "see dynmo-hpc simulate --help"
PROGRESS_EVERY_S = 5.0
"""A replay longer than this logs how far it got, this often."""
DEFAULT_BANDWIDTH_GBPS = 100.0
RUN = "run"
"""``--wall-per-cpu run``: each step's ratio, measured from the replayed run log."""
RUN_INTERVAL = "run-interval"
"""``--wall-per-cpu run-interval``: one ratio per report interval, the median of its steps'."""
COSTS_STEPS_PER_INTERVAL = 10
"""``--costs`` without ``--steps``: replay this many intervals (constant costs, so only the
first decision matters; more would only take longer)."""


def _algorithms(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    choices = replay_algorithms()
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {', '.join(unknown) or '(none)'}; choose from {','.join(choices)}"
        )
    return names


def _wall_per_cpu(text: str) -> float | str:
    if text in (RUN, RUN_INTERVAL):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number nor {RUN!r} nor {RUN_INTERVAL!r}"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite and > 0")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``simulate`` on ``subparsers``; the parsed args carry ``func=run``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay layer costs on a simulated pipeline under each balancing algorithm",
        description=(
            "Simulate every pipeline step (forward/backward of each microbatch on each stage) "
            "of a run's load reports, or of a constant cost vector, under each algorithm."
        ),
    )
    _add_source_and_pipeline(p)
    _add_link_and_costs(p)
    _add_machine(p)
    _add_predict(p)
    add_scale_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _add_source_and_pipeline(p: argparse.ArgumentParser) -> None:
    """The cost source, the pipeline's shape and the algorithms to replay."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="run_log", type=Path, help="a run log (run.h5 or its dir)")
    source.add_argument(
        "--costs", type=_floats, help="seconds per layer per step (forward + backward), e.g. 1,2,3"
    )
    p.add_argument(
        "--stages",
        type=stage_list,
        help="pipeline stages P (default: the run's); with --model a list, e.g. 8,16,32,64",
    )
    p.add_argument("--microbatches", type=int, help="microbatches per step M (default: the run's)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), help="default: the run's, or 1f1b")
    p.add_argument("--interval", type=int, help="steps per load report (default: the run's, or 10)")
    p.add_argument("--steps", type=int, help="steps to replay (default: all the run's reports)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--algorithms",
        type=_algorithms,
        help=f"comma-separated, default {','.join(replay_algorithms())}",
    )
    which.add_argument(
        "--policies",
        type=_algorithms,
        dest="deprecated_policies",
        metavar="ALGORITHMS",
        help="deprecated name of --algorithms",
    )


def _add_link_and_costs(p: argparse.ArgumentParser) -> None:
    """The link between stages, the decision margin, and what ``--costs`` cannot say."""
    p.add_argument(
        "--latency-s", type=float, help="per message (default: the machine file's, or 0)"
    )
    bandwidth = p.add_mutually_exclusive_group()
    bandwidth.add_argument(
        "--bandwidth-gbps",
        type=float,
        help=f"point-to-point Gbit/s (default: the machine file's, or {DEFAULT_BANDWIDTH_GBPS:g})",
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


def _add_machine(p: argparse.ArgumentParser) -> None:
    """The calibrated machine: overheads, wall per CPU second, restarts, shared cores."""
    p.add_argument(
        "--machine",
        type=_machine_arg,
        help="machine calibration JSON (benchmarks/heldout_sim.py --write-machine): CPU "
        "overheads per action, step, parameter and report, latency, bandwidth, cores, other "
        "processes' load (docs/simulate.md#calibration); 'none': the compute-only model "
        "(default with --from: the calibration shipped for this machine, if any; with --costs: "
        "none)",
    )
    p.add_argument(
        "--wall-per-cpu",
        type=_wall_per_cpu,
        help="wall seconds per CPU second of rank work; 'run': each step's, measured from the "
        "replayed run log's own stage times; 'run-interval': one per report, the median of its "
        "steps'. 'run' and 'run-interval' are NOT held-out predictions: they take the layers' "
        "wall time from the very run they replay (default: the machine calibration's fitted "
        "load, else its wall_s_per_cpu_s, else 1)",
    )
    p.add_argument(
        "--restart-overhead-s",
        type=float,
        help="seconds one resize onto fewer stages stops training, for packing "
        "(default: the run's elastic.restart_overhead_s, else its measured resizes' median, "
        "else 10)",
    )
    p.add_argument(
        "--cores",
        type=float,
        help="cores the ranks share; fewer than the stages: the busy stages share them, and a "
        "measured --wall-per-cpu keeps only what the sharing does not explain (default: the "
        "machine file's, or a core per stage)",
    )


def _pick(given: Any, default: Any) -> Any:
    return default if given is None else given


@dataclass(frozen=True)
class _Source:
    """What the cost source (a run log or ``--costs``) gives: the reports, the report
    interval, defaults for the options not given, the smoothing and the packing settings."""

    reports: list[CostReport]
    interval: int
    defaults: dict[str, Any]
    smoothing: float
    packing: PackingSetup


def _from_run_log(
    args: argparse.Namespace,
    wall_per_cpu: float | str | None,
    cores: float | None,
    oversubscribed_cpu: float | None,
) -> _Source:
    """``--from RUN``: its load reports and its own settings as the defaults. With a fitted
    machine (``oversubscribed_cpu``), reports measured on more stages than ``cores`` are
    taken back to costs with a core per rank
    (:func:`dynmo_hpc.sim.oversubscribed_cpu.alone_costs`)."""
    from dynmo_hpc.runlog import load
    from dynmo_hpc.sim.oversubscribed_cpu import alone_costs
    from dynmo_hpc.sim.runlog_traces import traces_from_runlog

    path = args.run_log / "run.h5" if args.run_log.is_dir() else args.run_log
    traces = traces_from_runlog(load(path))
    alone = alone_costs(traces, cores, oversubscribed_cpu)
    reports = _with_wall_per_cpu(alone, wall_per_cpu, traces.step_wall_s_per_cpu_s)
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
    return _Source(reports, interval, defaults, traces.smoothing, traces.packing)


def _from_costs(args: argparse.Namespace, wall_per_cpu: float | str | None) -> _Source:
    """``--costs``: one constant report; ``--stages`` and ``--microbatches`` are required."""
    if wall_per_cpu in (RUN, RUN_INTERVAL):
        raise ValueError(
            f"--wall-per-cpu {wall_per_cpu} needs --from; HINT: give a number with --costs"
        )
    reports = _with_wall_per_cpu([_constant_report(args)], wall_per_cpu, [])
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
    return _Source(reports, interval, defaults, 0.5, PackingSetup())


def _link(args: argparse.Namespace, machine: MachineModel) -> tuple[float, float]:
    """Bandwidth (bytes/s) and latency (s): the options, else the machine file, else defaults."""
    if args.bandwidth_bytes_per_s is not None:
        bandwidth = float(args.bandwidth_bytes_per_s)
    elif args.bandwidth_gbps is not None:
        bandwidth = args.bandwidth_gbps * 1e9 / 8
    else:
        bandwidth = _pick(machine.bandwidth_bytes_per_s, DEFAULT_BANDWIDTH_GBPS * 1e9 / 8)
    return bandwidth, _pick(args.latency_s, _pick(machine.latency_s, 0.0))


def _inputs(args: argparse.Namespace) -> tuple[list[CostReport], ReplaySetup, int]:
    """Reports, setup and tokens per microbatch; raises ValueError or DynmoError."""
    machine = _machine(args)
    bandwidth, latency_s = _link(args, machine)
    external = args.wall_per_cpu is None and machine.external_wall_s_per_cpu_s is not None
    wall_per_cpu = _pick(
        args.wall_per_cpu, _pick(machine.external_wall_s_per_cpu_s, machine.wall_s_per_cpu_s)
    )
    cores = _pick(args.cores, machine.cores)
    # The fitted factor only with the fitted external load: measured ratios contain it.
    shared_cpu = machine.oversubscribed_cpu_s_per_cpu_s if external else None
    if args.run_log is not None:
        source = _from_run_log(args, wall_per_cpu, cores, shared_cpu)
    else:
        source = _from_costs(args, wall_per_cpu)
    packing = source.packing
    if args.restart_overhead_s is not None:
        packing = replace(packing, restart_overhead_s=args.restart_overhead_s)
    value = {key: _pick(getattr(args, key), default) for key, default in source.defaults.items()}
    stages = _pick(_one_stage_count(args.stages), value.get("stages"))
    microbatches = _pick(args.microbatches, value.get("microbatches"))
    if value["tokens_per_microbatch"] < 1:
        raise ValueError(f"--tokens-per-microbatch={value['tokens_per_microbatch']} must be >= 1")
    comm_s = transfer_time_s(latency_s, bandwidth, float(value["activation_bytes"]))
    setup = ReplaySetup(
        num_stages=stages,
        num_microbatches=microbatches,
        schedule=value["schedule"],
        interval=source.interval,
        num_steps=value["steps"],
        comm_s=comm_s if stages > 1 else 0.0,
        bandwidth_bytes_per_s=bandwidth,
        margin=value["margin"],
        smoothing=source.smoothing,
        overheads=machine.overheads,
        cores=cores,
        poll_max_s=_pick(machine.poll_max_s, 0.0),
        poll_yield_s=WAIT_YIELD_S if machine.poll_max_s else 0.0,
        packing=packing,
        ratios_are_external=external,
        oversubscribed_wall_s_per_cpu_s=_pick(machine.oversubscribed_wall_s_per_cpu_s, 1.0),
        oversubscribed_cpu_s_per_cpu_s=_pick(shared_cpu, 1.0),
    )
    setup.check()
    return source.reports, setup, int(value["tokens_per_microbatch"])


def _one_stage_count(stages: list[int] | None) -> int | None:
    """``--stages`` without ``--model``: one count."""
    if stages is not None and len(stages) > 1:
        raise ValueError(
            f"--stages {','.join(map(str, stages))}: a list needs --model; HINT: give one count"
        )
    return None if stages is None else stages[0]


def _with_wall_per_cpu(
    reports: list[CostReport], ratio: float | str | None, measured: list[list[float] | None]
) -> list[CostReport]:
    """``reports`` with the wall-per-CPU ratio: a number for all, the run's own per step
    (``run``) or per interval (``run-interval``), or unchanged (1) when none was asked for."""
    if ratio is None:
        return reports
    if ratio not in (RUN, RUN_INTERVAL):
        return [replace(r, wall_s_per_cpu_s=float(ratio)) for r in reports]
    missing = [i for i, k in enumerate(measured) if k is None]
    if missing:
        raise ValueError(
            f"--wall-per-cpu {ratio}: the run log has no stage times for report(s) {missing}; "
            "HINT: give the ratio as a number"
        )
    out = []
    for report, steps in zip(reports, measured, strict=True):
        assert steps is not None
        median = float(statistics.median(steps))
        per_step = list(steps) if ratio == RUN else []
        out.append(replace(report, wall_s_per_cpu_s=median, step_wall_s_per_cpu_s=per_step))
    return out


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


def _progress(algorithm: str) -> Any:
    """A callback that logs at most every :data:`PROGRESS_EVERY_S` seconds."""
    started = last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            log.info("simulate %s: step %d/%d (%.0f s)", algorithm, done, total, now - started)

    return report


def _chosen_algorithms(args: argparse.Namespace) -> list[str]:
    """``--algorithms``, else the deprecated ``--policies`` (with a warning), else all."""
    if args.algorithms is not None:
        return list(args.algorithms)
    if args.deprecated_policies is not None:
        log.warning("--policies is deprecated; use --algorithms (the same list)")
        return list(args.deprecated_policies)
    return list(replay_algorithms())


def run(args: argparse.Namespace) -> int:
    """Print the per-algorithm results; a bad input is one ``error:`` line and exit 2."""
    if args.predict is not None:
        return run_predict(args)
    if args.model is not None:
        return run_scale(args)
    try:
        reports, setup, tokens_per_microbatch = _inputs(args)
        results = {a: replay(reports, setup, a, _progress(a)) for a in _chosen_algorithms(args)}
    except (DynmoError, FileNotFoundError, ValueError) as exc:
        print(error_line(exc, HINT), file=sys.stderr)
        return 2
    log.info("simulate: calibration %s", args.calibration_used)  # after any error line
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
        f"{setup.num_steps} steps, load report every {setup.interval}; "
        f"calibration: {args.calibration_used}"
    )
    print(
        f"{'algorithm':<12}{'step_time_s':>14}{'tokens_per_s':>16}{'migrations':>12}"
        f"{'stages':>8}{'node_s':>12}"
    )
    for p, r in results.items():
        print(
            f"{p:<12}{summary[p]['step_time_s']:>14.6g}{summary[p]['tokens_per_s']:>16.6g}"
            f"{r.migrations:>12d}{len(r.final_parts) - 1:>8d}{r.node_s:>12.6g}"
        )
    return 0


# --- the machine calibration and held-out prediction (docs/simulate.md#held-out-validation) ---

NONE = "none"
"""``--machine none``: no calibration, the compute-only model."""


def _machine_arg(text: str) -> Path | str:
    return NONE if text == NONE else Path(text)


def _machine(args: argparse.Namespace) -> MachineModel:
    """The machine calibration to use, and which one it was (kept on ``args`` as
    ``calibration_used``, for the log and the text output): ``--machine FILE``; ``--machine
    none``; else, with ``--from``, the one shipped for this machine
    (:func:`shipped_machine_path`); else none (``--costs`` stays the compute-only model).
    """
    path: Path | None = None
    if isinstance(args.machine, Path):
        path, why = args.machine, "--machine"
    elif args.machine is None and args.run_log is not None:
        path = shipped_machine_path(len(os.sched_getaffinity(0)))
        why = "shipped for this machine"
    if path is None:
        args.calibration_used = "none (compute-only model)"
        if args.machine is None and args.run_log is not None:
            args.calibration_used += "; no calibration is shipped for this machine"
        return MachineModel()
    machine = load_machine(path)
    args.calibration_used = f"{path} ({why})"
    return machine


def _add_predict(p: argparse.ArgumentParser) -> None:
    """Held-out prediction: other runs predicted from ``--from``'s layer costs."""
    p.add_argument(
        "--predict",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="predict these runs (run.h5 or their dirs; the same job, other stages, "
        "microbatches, schedule or balance algorithm) from --from's layer costs and the "
        "machine calibration alone, and print predicted against measured step time and speedup",
    )
    p.add_argument("--json-out", type=Path, help="with --predict: also write the table as JSON")


PREDICT_REFUSES = ("wall_per_cpu", "stages", "microbatches", "schedule", "interval", "steps")
"""Options a held-out prediction cannot take: the target's own settings decide, and
``--wall-per-cpu run`` would read the source's wall times."""


def _run_log_path(path: Path) -> Path:
    return path / "run.h5" if path.is_dir() else path


def predict_rows(args: argparse.Namespace) -> list[HeldOutRow]:
    """One :class:`HeldOutRow` per ``--predict`` run; raises ValueError or DynmoError."""
    from dynmo_hpc.runlog import load

    if args.run_log is None:
        raise ValueError("--predict needs --from; HINT: --from SOURCE.h5 --predict TARGET.h5")
    given = [f"--{n.replace('_', '-')}" for n in PREDICT_REFUSES if getattr(args, n) is not None]
    if given:
        raise ValueError(
            f"--predict takes each target's settings from its run log and the machine's load "
            f"from the calibration, so {', '.join(given)} cannot be given with it; HINT: drop "
            f"{', '.join(given)}"
        )
    machine = _machine(args)
    source_path = _run_log_path(args.run_log)
    source = load(source_path)
    rows = []
    for target_path in (_run_log_path(p) for p in args.predict):
        names = (str(source_path), str(target_path))
        rows.append(predict_pair(source, load(target_path), machine, names))
    return rows


def run_predict(args: argparse.Namespace) -> int:
    """``--predict``: the held-out table; a bad input is one ``error:`` line and exit 2."""
    try:
        rows = predict_rows(args)
    except (DynmoError, FileNotFoundError, ValueError, KeyError) as exc:
        print(error_line(exc, HINT), file=sys.stderr)
        return 2
    table = {"calibration": args.calibration_used, "rows": [r.to_json() for r in rows]}
    if args.json_out is not None:
        atomic_write_text(args.json_out, json.dumps(table, indent=1) + "\n")
    if args.json:
        print(json.dumps(table))
        return 0
    print(f"calibration: {args.calibration_used}; source: {args.run_log}")
    print(format_table(rows))
    return 0


def format_table(rows: list[HeldOutRow]) -> str:
    """The held-out rows as a fixed-width text table."""
    lines = [
        f"{'target':<40}{'P':>3}{'M':>4}{'algorithm':>11}{'meas s':>9}{'pred s':>9}{'err':>8}"
        f"{'meas x':>8}{'pred x':>8}{'err':>8}"
    ]
    for r in rows:
        t = r.target_settings
        lines.append(
            f"{Path(r.target).parent.name or r.target:<40}{t.num_stages:>3}"
            f"{t.num_microbatches:>4}{t.algorithm:>11}{r.measured_target_s:>9.4f}"
            f"{r.predicted_target_s:>9.4f}{r.step_error:>+8.1%}{r.measured_speedup:>8.3f}"
            f"{r.predicted_speedup:>8.3f}{r.speedup_error:>+8.1%}"
        )
    return "\n".join(lines)
