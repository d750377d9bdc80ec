"""``dynmo-hpc bench``: each scheme under the static splits and DynMo's balancers.

Why a subcommand: "is DynMo faster than what I run now?" deserves one command that answers it on
the user's own machine, with the spread that says how far to trust the answer. For the plain model
and each scheme job it compares the registry's static baselines (the two Megatron-LM splits,
``uniform`` and ``megatron``, and DeepSpeed's ``parameters``) with DynMo's balancers (optimal,
diffusion); two baselines with the same split for a job run once and are reported under both
names. ``--ab`` (the default) runs one job per static split and
balancer whose partition alternates between the two every few steps, so both arms share the same
minutes of the machine (:mod:`dynmo_hpc.cli.bench_ab`); ``--whole`` trains the same job once per
algorithm and repeat, interleaved (:func:`~dynmo_hpc.bench.algorithms.run_order`). Either way it
checks that all runs trained the same model (equal losses), reports the ramp and the steady state
apart with the pipeline-aware ceiling and DynMo's capture of it, and writes ``results.md``,
``results.h5`` and ``results.png`` to ``--out``.

Example::

    $ dynmo-hpc bench --ab --schemes plain,pruning --repeats 1 --out runs/bench_ab
    $ dynmo-hpc bench --whole --schemes plain,moe --steps 20 --repeats 5 --out runs/bench
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.balance.registry import bench_algorithms
from dynmo_hpc.bench.ab import NOISE_FACTOR, mark_steps, phase_ceiling, run_ceilings
from dynmo_hpc.bench.algorithms import (
    PlannedRun,
    algorithm_overrides,
    run_order,
    shared_splits,
)
from dynmo_hpc.bench.measure import RunFigures, run_figures
from dynmo_hpc.bench.output import write_chart, write_results_h5
from dynmo_hpc.bench.summary import (
    AlgorithmRow,
    BenchError,
    check_same_losses,
    max_loss_difference,
    render_markdown,
    summarize,
)
from dynmo_hpc.cli.args import add_overrides_argument
from dynmo_hpc.cli.bench_ab import (
    ab_order,
    measured_times,
    profile_costs,
    run_ab,
    scheme_splits,
    train_run,
)
from dynmo_hpc.config import SCHEME_SECTIONS, JobConfig
from dynmo_hpc.config import load as load_config
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.pipeline.schedule import SCHEDULES

log = logging.getLogger(__name__)


def scheme_jobs() -> dict[str, str]:
    """Bench name -> job file in ``--jobs-dir`` (``jobs/natural`` or ``jobs/stress``): ``plain``
    (the set's model with no scheme, the control) and ``<name>.yaml`` for every registered
    scheme, in registration order."""
    return {"plain": "plain.yaml", **{name: f"{name}.yaml" for name in SCHEME_SECTIONS}}


BENCH_SETS = [
    "checkpoint.at_end=false",
    "checkpoint.every_steps=0",
    "checkpoint.every_minutes=0",
    "train.log_interval=100000",
    "elastic.enabled=false",
]
"""What every bench run sets: no checkpoints, no packing, quiet logs (the bench measures
training and balancing, not I/O)."""


DEFAULT_REPEATS = {"ab": 1, "whole": 5}
"""``--repeats`` unless given: one A/B run per pair (both arms share its minutes), five whole
runs per algorithm (whole runs compare different minutes of the machine, so they need
repeats to show a spread)."""


def _names(choices: list[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [item.strip() for item in text.replace(",", " ").split() if item.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name {', '.join(unknown) or '(none)'}; choose from {','.join(choices)}"
            )
        return names

    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "bench",
        help="DynMo against the static splits: tokens/s per scheme and algorithm",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--schemes",
        type=_names(list(scheme_jobs())),
        default=list(scheme_jobs()),
        help=f"comma-separated, from {','.join(scheme_jobs())} (default: all)",
    )
    p.add_argument(
        "--algorithms",
        "--policies",  # the old name, still accepted
        dest="algorithms",
        type=_names(list(ALGORITHMS)),
        default=list(bench_algorithms()),
        help=f"comma-separated, from {','.join(ALGORITHMS)} (default: "
        f"{','.join(bench_algorithms())}; --ab runs every balancer against every static split)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="train.steps for every run (default: the job's)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs per scheme and algorithm (default: {DEFAULT_REPEATS['ab']} with --ab, "
        f"{DEFAULT_REPEATS['whole']} with --whole)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="results directory")
    p.add_argument(
        "--jobs-dir",
        type=Path,
        default=Path("jobs/natural"),
        help="the job set: jobs/natural (default: each scheme where its literature puts it) or "
        "jobs/stress (built to show imbalance)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=1e-6,
        help="largest relative loss difference between algorithms that counts as equal",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--ab",
        dest="mode",
        action="store_const",
        const="ab",
        help="A/B within one run (the default): each job alternates the static split and the "
        "balancer's plan every --ab-period steps",
    )
    mode.add_argument(
        "--whole",
        dest="mode",
        action="store_const",
        const="whole",
        help="interleaved whole runs, one per algorithm and repeat (use --repeats 5 or more)",
    )
    p.set_defaults(mode="ab")
    p.add_argument(
        "--ab-period",
        type=int,
        default=None,
        help="steps per A/B block, a multiple of the job's balance.interval (default: twice it)",
    )
    p.add_argument(
        "--ab-schedule",
        choices=sorted(SCHEDULES),
        default=None,
        help="--ab: also alternate the job's pipeline.schedule with this one in pairs of blocks "
        "(balance.ab_schedule), to measure which is faster on each arm "
        "(benchmarks/ab_schedule.py prints it)",
    )
    p.add_argument(
        "--noise-factor",
        type=float,
        default=NOISE_FACTOR,
        help="--ab: set aside steps whose wall/CPU ratio exceeds this many times the run's "
        f"median (default {NOISE_FACTOR})",
    )
    add_overrides_argument(p, "model.num_blocks=16")
    p.set_defaults(func=run)
    return p


def layer_params(cfg: JobConfig) -> list[int]:
    """Parameter counts of the layers as the job builds them (experts, pruned widths and all)."""
    from dynmo_hpc.model.schemes import build_layer

    return [
        sum(p.numel() for p in build_layer(cfg, index).parameters())
        for index in range(cfg.model.num_layers)
    ]


def _config(args: argparse.Namespace, scheme: str, extra: list[str]) -> JobConfig:
    job = args.jobs_dir / scheme_jobs()[scheme]
    if not job.is_file():
        raise BenchError(
            f"{job}: no such job file; HINT: run from the repository root, or pass --jobs-dir "
            "DIR holding plain.yaml and the scheme jobs (jobs/natural or jobs/stress)"
        )
    sets = [*BENCH_SETS, f"job.out_dir={args.out / 'runs'}"]
    if args.steps is not None:
        # A shorter run than the job's ramp has no steady state of its own: fall back to the
        # default (the second half of the run) rather than refuse the job.
        declared = load_config(job, [*sets, *args.overrides, *extra]).train.steady_state_step
        sets.append(f"train.steps={args.steps}")
        if declared is not None and declared >= args.steps:
            log.warning(
                "%s: --steps %d ends before the job's steady state (step %d); the steady "
                "state is the second half of this shorter run",
                scheme,
                args.steps,
                declared,
            )
            sets.append("train.steady_state_step=null")
    return load_config(job, [*sets, *args.overrides, *extra])


def _train(planned: PlannedRun, cfg: JobConfig, splits: dict[str, list[int]]) -> RunFigures:
    """Train one run; its figures, with the steady-state ceiling over each of ``splits``
    (static baseline -> its split)."""
    runlog, wall_s = train_run(planned.name, cfg)
    return run_figures(
        steps=runlog.steps,
        layer_costs=runlog.layer_costs,
        events=runlog.events,
        tokens_per_step=cfg.tokens_per_step,
        num_stages=cfg.pipeline.num_stages,
        num_microbatches=cfg.train.num_microbatches,
        wall_s=wall_s,
        steady_from_step=cfg.train.steady_from_step(),
        steady_ceilings=_steady_ceilings(runlog, cfg, splits),
    )


def _steady_ceilings(runlog: Any, cfg: JobConfig, splits: dict[str, list[int]]) -> dict[str, float]:
    """Per static baseline: the ceiling over its split on the steady state's load reports, with
    the overheads the run measured."""
    migrations = runlog.events[runlog.events["kind"] == "migrate"]["step"].tolist()
    times = measured_times(runlog, mark_steps(runlog.steps, migrations))
    out = {}
    for name, parts in splits.items():
        ceilings = run_ceilings(
            runlog.layer_costs, parts, cfg.train.num_microbatches, cfg.pipeline.schedule, times
        )
        value = phase_ceiling(ceilings, cfg.train.steady_from_step(), cfg.train.steps)
        if value is not None:
            out[name] = value
    return out


def _setting(
    configs: dict[str, JobConfig],
    args: argparse.Namespace,
    runs_of: dict[str, dict[str, str]],
) -> str:
    lines = [
        f"Jobs: `{args.jobs_dir}`; {args.repeats} repeats; per scheme (job file, blocks, "
        "stages, microbatches, steps):",
        "",
    ]
    for scheme, cfg in configs.items():
        shared = [f"{n} = {src}" for n, src in runs_of.get(scheme, {}).items() if n != src]
        lines.append(
            f"- {scheme}: {scheme_jobs()[scheme]}, {cfg.model.num_blocks} blocks, "
            f"{cfg.pipeline.num_stages} stages, {cfg.train.num_microbatches} microbatches, "
            f"{cfg.train.steps} steps, balance interval {cfg.balance.interval}"
            + (
                f"; {', '.join(shared)} (the same split: run once, reported under both names)"
                if shared
                else ""
            )
        )
    return "\n".join(lines)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this bench (for the results' header)."""
    words = ["dynmo-hpc", "bench", f"--{args.mode}", "--schemes", ",".join(args.schemes)]
    words += ["--algorithms", ",".join(args.algorithms), "--repeats", str(args.repeats)]
    if args.steps is not None:
        words += ["--steps", str(args.steps)]
    if args.mode == "ab" and args.ab_period is not None:
        words += ["--ab-period", str(args.ab_period)]
    if args.mode == "ab" and args.ab_schedule is not None:
        words += ["--ab-schedule", args.ab_schedule]
    if args.mode == "ab" and args.noise_factor != NOISE_FACTOR:
        words += ["--noise-factor", str(args.noise_factor)]
    words += ["--out", str(args.out), "--jobs-dir", str(args.jobs_dir)]
    for item in args.overrides:
        words += ["--set", item]
    return shlex.join(words)


def _write_results(
    args: argparse.Namespace,
    base: dict[str, JobConfig],
    done: list[tuple[PlannedRun, RunFigures]],
    runs_of: dict[str, dict[str, str]],
    num_runs: int,
) -> tuple[str, DynmoError | None]:
    """Summarize the runs done so far and (re)write the three files; returns the table text and
    the first loss mismatch, if any (compared over the algorithms each repeat has finished).
    ``runs_of``: per scheme, static baseline -> the one whose runs it reports (a shared split);
    ``num_runs``: the runs the bench makes in all."""
    rows: dict[str, dict[str, AlgorithmRow]] = {}
    for scheme in args.schemes:
        for algorithm in args.algorithms:
            source = runs_of.get(scheme, {}).get(algorithm, algorithm)
            runs = [f for p, f in done if p.scheme == scheme and p.algorithm == source]
            if runs:
                rows.setdefault(scheme, {})[algorithm] = summarize(scheme, algorithm, runs)
    differences: dict[str, float] = {}
    mismatch: DynmoError | None = None
    for scheme in rows:
        for repeat in range(args.repeats):
            losses = {
                p.algorithm: f.losses for p, f in done if p.scheme == scheme and p.repeat == repeat
            }
            worst = max_loss_difference(losses)
            try:
                check_same_losses(scheme, repeat, losses, args.loss_rtol)
            except DynmoError as exc:
                mismatch = mismatch or exc
            differences[scheme] = max(differences.get(scheme, 0.0), worst)
    repeats_done = min((row.repeats for r in rows.values() for row in r.values()), default=0)
    command = _command(args)
    setting = _setting(base, args, runs_of)
    if len(done) < num_runs:
        setting += f"\n\nPartial: {len(done)} runs done; at least {repeats_done} repeat(s) each."
    text = render_markdown(rows, differences, command=command, setting=setting)
    atomic_write_text(args.out / "results.md", text)
    write_results_h5(
        args.out / "results.h5",
        done,
        rows,
        {"command": command, "repeats": args.repeats, "loss_rtol": args.loss_rtol},
    )
    write_chart(args.out / "results.png", rows)
    return text, mismatch


def run(args: argparse.Namespace) -> int:
    if args.repeats is None:
        args.repeats = DEFAULT_REPEATS[args.mode]
    if args.repeats < 1:
        raise BenchError(f"--repeats={args.repeats} must be >= 1")
    if args.steps is not None and args.steps < 1:
        raise BenchError(f"--steps={args.steps} must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.noise_factor < 1.0:
        raise BenchError(f"--noise-factor={args.noise_factor} must be >= 1")
    base = {scheme: _config(args, scheme, []) for scheme in args.schemes}
    params = {scheme: layer_params(cfg) for scheme, cfg in base.items()}
    if args.mode == "ab":
        try:
            ab_order(args.schemes, args.algorithms, args.repeats)
        except ValueError as exc:
            raise BenchError(f"{exc}; HINT: include uniform and optimal, or use --whole") from None
        return run_ab(
            args, base, params, _command(args), lambda scheme, sets: _config(args, scheme, sets)
        )
    costs = profile_costs(args.algorithms, base, lambda scheme, sets: _config(args, scheme, sets))
    runs_of = {
        scheme: shared_splits(
            scheme_splits(
                args.algorithms, cfg.pipeline.num_stages, params[scheme], costs.get(scheme)
            )
        )
        for scheme, cfg in base.items()
    }
    # A static baseline with the same split as an earlier one reports that one's runs.
    order = [
        p
        for p in run_order(args.schemes, args.algorithms, args.repeats)
        if runs_of[p.scheme].get(p.algorithm, p.algorithm) == p.algorithm
    ]
    log.info(
        "bench: %d runs (%d schemes, %d algorithms, %d repeats; a split shared by two static "
        "baselines runs once) into %s",
        len(order),
        len(args.schemes),
        len(args.algorithms),
        args.repeats,
        args.out,
    )
    done: list[tuple[PlannedRun, RunFigures]] = []
    text, mismatch = "", None
    t_start = time.perf_counter()
    for k, planned in enumerate(order):
        cfg0 = base[planned.scheme]
        sets = algorithm_overrides(
            planned.algorithm,
            cfg0.pipeline.num_stages,
            params[planned.scheme],
            costs.get(planned.scheme),
        )
        cfg = _config(args, planned.scheme, [*sets, f"job.name={planned.name}"])
        splits = scheme_splits(
            args.algorithms,
            cfg0.pipeline.num_stages,
            params[planned.scheme],
            costs.get(planned.scheme),
        )
        figures = _train(planned, cfg, splits)
        done.append((planned, figures))
        elapsed_s = time.perf_counter() - t_start
        eta_s = elapsed_s / (k + 1) * (len(order) - k - 1)
        log.info(
            "[%d/%d] %s: %.0f tokens/s (efficiency %.2f), %d moves, %.1f s; %.0f s left",
            k + 1,
            len(order),
            planned.name,
            figures.tokens_per_s,
            figures.efficiency,
            figures.num_moves,
            figures.wall_s,
            eta_s,
        )
        # After every run, so an interrupted bench leaves the results of the runs it finished.
        text, mismatch = _write_results(args, base, done, runs_of, len(order))

    sys.stdout.write(text)
    print(f"wrote {args.out / 'results.md'}, results.h5, results.png")
    if mismatch is not None:
        raise mismatch
    return 0
