"""``dynmo-hpc bench --ab``: each static split against each balancer inside one run.

For every scheme, repeat, static baseline ``s`` and balancer ``d`` (from ``--algorithms``), one
job runs with ``pipeline.partition`` set to ``s``'s split, ``balance.algorithm=d`` and
``balance.ab_period_steps=k``: the partition alternates between ``s``'s split and ``d``'s plan
every ``k`` steps (:mod:`dynmo_hpc.train.ab_arms`), the static split first in even repeats and
the balancer's plan first in odd ones (``balance.ab_lead``). The runs go in the interleaved
order of the whole-run bench (pairs rotated from one repeat to the next). The comparison, the
ceiling and the capture come from each run's log (:mod:`dynmo_hpc.bench.ab`,
:mod:`dynmo_hpc.bench.ceiling`).

Two static baselines with the same split for a scheme's job (``megatron`` and ``uniform`` when
the blocks divide evenly) would train the same runs twice: the first in ``--algorithms`` order
runs, and its rows are reported under the other's name as well, marked as shared
(:func:`~dynmo_hpc.bench.algorithms.shared_splits`). The headline reports each balancer against
the best static baseline of each scheme and phase
(:func:`~dynmo_hpc.bench.ab_summary.best_baselines`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dynmo_hpc.balance import uniform
from dynmo_hpc.balance.registry import lookup
from dynmo_hpc.bench.ab import RunTimes, mark_steps, parts_at_reports, run_ceilings
from dynmo_hpc.bench.ab_summary import ABRow, ABRunFigures, ab_rows, render_ab_markdown
from dynmo_hpc.bench.algorithms import algorithm_overrides, shared_splits, static_split
from dynmo_hpc.bench.output import write_ab_chart, write_ab_results_h5
from dynmo_hpc.bench.summary import BenchError, check_same_losses, max_loss_difference
from dynmo_hpc.config import JobConfig
from dynmo_hpc.errors import DynmoError, Interrupted
from dynmo_hpc.train.ab_arms import ARM_NAMES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ABPlanned:
    """One A/B run of the bench."""

    repeat: int
    scheme: str
    static: str
    balancer: str

    @property
    def name(self) -> str:
        return f"bench_ab_{self.scheme}_{self.balancer}_vs_{self.static}_r{self.repeat}"

    @property
    def lead(self) -> str:
        """The arm of the run's first block (``balance.ab_lead``): static in even repeats, the
        balancer in odd ones (ABBA over a pair of repeats)."""
        return ARM_NAMES[self.repeat % 2]


def ab_order(
    schemes: list[str],
    algorithms: list[str],
    repeats: int,
    runs_of: Mapping[str, Mapping[str, str]] | None = None,
) -> list[ABPlanned]:
    """Every (static baseline, balancer) pair of ``algorithms`` per scheme and repeat, the pairs
    rotated from one repeat to the next; ValueError when ``algorithms`` lacks either kind.
    ``runs_of``: per scheme, static baseline -> the one whose runs it reports
    (:func:`~dynmo_hpc.bench.algorithms.shared_splits`); a baseline reported from another's runs
    gets none of its own."""
    statics = [a for a in algorithms if not lookup(a).rebalances]
    balancers = [a for a in algorithms if lookup(a).rebalances]
    if not statics or not balancers:
        raise ValueError(
            f"--ab compares a static split with a balancer, but --algorithms "
            f"{','.join(algorithms)} lacks {'a static baseline' if not statics else 'a balancer'}"
        )
    shared = runs_of or {}
    order = []
    for repeat in range(repeats):
        for scheme in schemes:
            own = [s for s in statics if shared.get(scheme, {}).get(s, s) == s]
            pairs = [(s, d) for s in own for d in balancers]
            shift = repeat % len(pairs)
            rotated = [*pairs[shift:], *pairs[:shift]]
            order += [ABPlanned(repeat, scheme, s, d) for s, d in rotated]
    return order


def scheme_splits(
    algorithms: list[str],
    num_stages: int,
    layer_params: list[int],
    costs_s: list[float] | None = None,
) -> dict[str, list[int]]:
    """Per static baseline in ``algorithms`` (their order): its split of the scheme's job
    (``costs_s``: the profiling run's per-layer costs, for ``profiled``)."""
    return {
        name: static_split(name, num_stages, layer_params, costs_s)
        for name in algorithms
        if not lookup(name).rebalances
    }


PROFILE_REPORTS = 2
"""Load reports a profiling run lasts; the costs of its last one place ``profiled`` (the first
report's interval holds the run's warm-up)."""


def profile_costs(
    algorithms: list[str],
    base: dict[str, JobConfig],
    make_config: Callable[[str, list[str]], JobConfig],
) -> dict[str, list[float]]:
    """Per scheme, when a baseline in ``algorithms`` is placed from measured costs: each layer's
    forward + backward seconds per step at the last load report of a short static run of the
    job (what a user who profiles before a long run measures). Empty otherwise."""
    if not any(lookup(name).profiled for name in algorithms):
        return {}
    out: dict[str, list[float]] = {}
    for scheme, cfg0 in base.items():
        name = f"profile_{scheme}"
        sets = [
            "balance.algorithm=static",
            "pipeline.partition=null",
            f"train.steps={PROFILE_REPORTS * cfg0.balance.interval}",
            "train.steady_state_step=null",
            f"job.name={name}",
        ]
        run, wall_s = train_run(name, make_config(scheme, sets))
        costs = run.layer_costs
        last = costs[costs["step"] == costs["step"].max()].sort_values("layer")
        total_s = last["forward_s"].to_numpy() + last["backward_s"].to_numpy()
        out[scheme] = [float(c) for c in total_s]
        log.info("bench: profiled %s in %.1f s: %s", scheme, wall_s, _costs_text(out[scheme]))
    return out


def _costs_text(costs_s: list[float]) -> str:
    return "layer ms/step " + " ".join(f"{1e3 * c:.0f}" for c in costs_s)


def static_parts(cfg: JobConfig) -> list[int]:
    """Arm A's partition: ``pipeline.partition``, else uniform (as the trainer starts)."""
    if cfg.pipeline.partition is not None:
        return list(cfg.pipeline.partition)
    return uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages)


def _period(args: argparse.Namespace, cfg: JobConfig) -> int:
    return int(args.ab_period) if args.ab_period else 2 * cfg.balance.interval


def train_run(name: str, cfg: JobConfig) -> tuple[Any, float]:
    """Train one bench run on local ranks (replacing an earlier run of the same name); its run
    log and wall seconds. A failed run is a :class:`BenchError` naming where its output is; a
    run stopped by a signal (Ctrl-C, SIGTERM: the launcher passes it to the ranks, which stop
    cleanly) is :class:`~dynmo_hpc.errors.Interrupted`, so the bench does not go on to its next
    run."""
    from dynmo_hpc.launch.local import run_local
    from dynmo_hpc.runlog import load as load_runlog

    t0 = time.perf_counter()
    outcome = run_local(cfg, overwrite=True)
    wall_s = time.perf_counter() - t0
    if outcome.interrupted:  # the ranks stopped early and cleanly: stop the bench too
        raise Interrupted(
            outcome.interrupted,
            f"interrupted ({signal.Signals(outcome.interrupted).name}) during {name}: the bench "
            f"stops; that run's checkpoint and log are in {cfg.run_dir}",
        )
    if outcome.exit_code != 0:
        raise BenchError(
            f"{name}: training failed with exit code {outcome.exit_code}; its output and "
            f"run log are in {cfg.run_dir}"
        )
    return load_runlog(cfg.run_dir / "run.h5"), wall_s


def measured_times(run: Any, marked: Any) -> RunTimes:
    """What ``run`` (a run log) measured besides its layers, for the ceiling's overheads; the
    poll back-off is the trainer's own, and so is its yield window: what ``runtime.wait_mode``
    chose for the run's ranks, all on this machine's cores (the bench trains locally, then
    reads the log here)."""
    from dynmo_hpc.pipeline.comm import WAIT_MAX_SLEEP_S
    from dynmo_hpc.pipeline.waiting import pipeline_wait_yield_s

    cores = len(os.sched_getaffinity(0))
    pipeline = run.config.get("pipeline", {})
    ranks = int(pipeline.get("num_stages", 1)) * int(pipeline.get("replicas", 1))
    spin = str(run.config.get("runtime", {}).get("wait_mode", "auto"))
    return RunTimes(
        marked=marked,
        stage_times=run.stage_times,
        parts_at_report=parts_at_reports(run.partitions),
        poll_max_s=WAIT_MAX_SLEEP_S,
        poll_yield_s=pipeline_wait_yield_s(spin, ranks, cores, os.cpu_count() or cores),
    )


def _train(args: argparse.Namespace, planned: ABPlanned, cfg: JobConfig) -> ABRunFigures:
    run, wall_s = train_run(planned.name, cfg)
    migrations = run.events[run.events["kind"] == "migrate"]
    steps = run.steps.sort_values("step")
    marked = mark_steps(steps, migrations["step"].tolist(), args.noise_factor)
    return ABRunFigures(
        marked=marked,
        ceilings=run_ceilings(
            run.layer_costs,
            static_parts(cfg),
            cfg.train.num_microbatches,
            cfg.pipeline.schedule,
            measured_times(run, marked),
        ),
        losses=[float(v) for v in steps["loss"]],
        period_steps=cfg.balance.ab_period_steps,
        steady_from_step=cfg.train.steady_from_step(),
        num_steps=cfg.train.steps,
        tokens_per_step=cfg.tokens_per_step,
        num_migrations=len(migrations),
        wall_s=wall_s,
    )


def _summarize(
    args: argparse.Namespace,
    done: list[tuple[ABPlanned, ABRunFigures]],
    runs_of: Mapping[str, Mapping[str, str]],
) -> tuple[list[ABRow], dict[str, float], DynmoError | None]:
    """Rows per scheme, static baseline and balancer in ``--algorithms`` order (a baseline that
    shares another's split reports that one's runs), the largest loss difference per scheme,
    and the first loss mismatch."""
    rows: list[ABRow] = []
    statics = [a for a in args.algorithms if not lookup(a).rebalances]
    balancers = [a for a in args.algorithms if lookup(a).rebalances]
    for scheme in args.schemes:
        for s in statics:
            source = runs_of.get(scheme, {}).get(s, s)
            for d in balancers:
                runs = [
                    f for p, f in done if (p.scheme, p.static, p.balancer) == (scheme, source, d)
                ]
                if runs:
                    shared = "" if source == s else source
                    rows += ab_rows(scheme, s, d, runs, runs_of=shared)
    differences: dict[str, float] = {}
    mismatch: DynmoError | None = None
    for scheme in dict.fromkeys(p.scheme for p, _ in done):
        for repeat in range(args.repeats):
            losses = {
                f"{p.balancer}_vs_{p.static}": f.losses
                for p, f in done
                if p.scheme == scheme and p.repeat == repeat
            }
            try:
                check_same_losses(scheme, repeat, losses, args.loss_rtol)
            except DynmoError as exc:
                mismatch = mismatch or exc
            differences[scheme] = max(differences.get(scheme, 0.0), max_loss_difference(losses))
    return rows, differences, mismatch


def _write(
    args: argparse.Namespace,
    done: list[tuple[ABPlanned, ABRunFigures]],
    command: str,
    setting: str,
    runs_of: Mapping[str, Mapping[str, str]],
) -> tuple[str, DynmoError | None]:
    rows, differences, mismatch = _summarize(args, done, runs_of)
    text = render_ab_markdown(
        rows, differences, command=command, setting=setting, noise_factor=args.noise_factor
    )
    from dynmo_hpc.atomic_io import atomic_write_text

    atomic_write_text(args.out / "results.md", text)
    attrs: dict[str, Any] = {"command": command, "repeats": args.repeats, "mode": "ab"}
    attrs["noise_factor"] = args.noise_factor
    write_ab_results_h5(args.out / "results.h5", [(p.name, f) for p, f in done], rows, attrs)
    write_ab_chart(args.out / "results.png", rows)
    return text, mismatch


def ab_setting(
    args: argparse.Namespace,
    base: dict[str, JobConfig],
    splits: Mapping[str, Mapping[str, list[int]]],
    runs_of: Mapping[str, Mapping[str, str]],
) -> str:
    """The results' header: per scheme, the job, the A/B period and steady-state step, and each
    static baseline's split (one shared with an earlier baseline said so)."""
    lines = [
        f"Jobs: `{args.jobs_dir}`; {args.repeats} repeats, A/B within one run; per scheme:",
        "",
    ]
    for scheme, cfg in base.items():
        placed = []
        for name, parts in splits.get(scheme, {}).items():
            source = runs_of.get(scheme, {}).get(name, name)
            placed.append(
                f"{name} {parts}"
                if source == name
                else f"{name} = {source} (the same split: run once, reported under both names)"
            )
        lines.append(
            f"- {scheme}: {cfg.model.num_blocks} blocks, {cfg.pipeline.num_stages} stages, "
            f"{cfg.train.num_microbatches} microbatches, {cfg.train.steps} steps, balance "
            f"interval {cfg.balance.interval}, A/B period {_period(args, cfg)} steps, steady "
            f"state from step {cfg.train.steady_from_step()}; static splits: {', '.join(placed)}"
        )
    return "\n".join(lines)


def run_ab(
    args: argparse.Namespace,
    base: dict[str, JobConfig],
    params: dict[str, list[int]],
    command: str,
    make_config: Callable[[str, list[str]], JobConfig],
) -> int:
    """Every A/B run, the results rewritten after each; the table on stdout at the end.
    ``make_config(scheme, overrides)``: the scheme's bench config with ``overrides``."""
    costs = profile_costs(args.algorithms, base, make_config)
    splits = {
        scheme: scheme_splits(
            args.algorithms, cfg.pipeline.num_stages, params[scheme], costs.get(scheme)
        )
        for scheme, cfg in base.items()
    }
    runs_of = {scheme: shared_splits(by_name) for scheme, by_name in splits.items()}
    for scheme, sources in runs_of.items():
        for name, source in sources.items():
            if source != name:
                log.info(
                    "bench --ab: %s: %s places the layers as %s does (%s): its A/B runs are %s's",
                    scheme,
                    name,
                    source,
                    splits[scheme][name],
                    source,
                )
    order = ab_order(args.schemes, args.algorithms, args.repeats, runs_of)
    log.info("bench --ab: %d runs into %s", len(order), args.out)
    setting = ab_setting(args, base, splits, runs_of)
    done: list[tuple[ABPlanned, ABRunFigures]] = []
    text, mismatch = "", None
    for k, planned in enumerate(order):
        cfg0 = base[planned.scheme]
        sets = algorithm_overrides(
            planned.static,
            cfg0.pipeline.num_stages,
            params[planned.scheme],
            costs.get(planned.scheme),
        )
        sets = [s for s in sets if not s.startswith("balance.algorithm=")]
        sets += [
            f"balance.algorithm={planned.balancer}",
            f"balance.ab_period_steps={_period(args, cfg0)}",
            f"balance.ab_lead={planned.lead}",
            f"job.name={planned.name}",
        ]
        if args.ab_schedule is not None:
            sets.append(f"balance.ab_schedule={args.ab_schedule}")
        figures = _train(args, planned, make_config(planned.scheme, sets))
        done.append((planned, figures))
        log.info(
            "[%d/%d] %s: %d migrations, %.1f s",
            k + 1,
            len(order),
            planned.name,
            figures.num_migrations,
            figures.wall_s,
        )
        partial = ""
        if len(done) < len(order):
            partial = (
                f"\n\nPartial: {len(done)} of {len(order)} A/B runs done; the best static "
                "baseline is chosen among the splits run so far."
            )
        text, mismatch = _write(args, done, command, setting + partial, runs_of)
    sys.stdout.write(text)
    print(f"wrote {args.out / 'results.md'}, results.h5, results.png")
    if mismatch is not None:
        raise mismatch
    return 0
