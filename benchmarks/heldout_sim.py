"""Held-out validation of `dynmo-hpc simulate`: predict runs from other runs, on this machine.

What it does, in order:
  1. makes the runs (short real jobs, one at a time; a finished run in --runs-dir is kept, so
     an interrupted invocation resumes where it stopped): a CALIBRATION set and a HELD-OUT set
     that share no run;
  2. fits the machine calibration on the calibration set only
     (:func:`dynmo_hpc.sim.heldout.fit_machine`: the overheads, the other processes' wall-per-CPU
     factor, the layers' CPU factor of more ranks than cores, fitted on the runs of one job
     at both kinds of stage count, and the wall factor, fitted on the calibration runs with
     more stages than cores; link and optimizer from --base-machine) and writes it
     (--write-machine);
  3. for each held-out pair (X, Y), predicts Y's median step time and the speedup Y/X from X's
     load reports alone, under Y's settings (stages, microbatches, algorithm), with that machine
     file: the same computation as `dynmo-hpc simulate --from X --predict Y --machine FILE`;
     Y's measured wall times are read only to be compared against; for each scheme pair
     (T, X, Y) of SCHEME_PAIRS (natural pruning, freezing, early exit: X static, Y optimal),
     both X and Y from a third run T's load reports (DynMo's speedup X/Y from another run's
     trace, neither run's own costs);
  4. prints the table (and the hidden case: `dynmo-hpc simulate --from HIDDEN --machine FILE`),
     writes it as JSON (--json-out) and as a markdown table to paste into docs/simulate.md
     (--markdown-out).

    PYTHONPATH=. .venv/bin/python benchmarks/heldout_sim.py --runs-dir /tmp/heldout_runs \\
        --write-machine dynmo_hpc/sim/machines/cpu_2core.json --json-out /tmp/heldout.json \\
        --markdown-out /tmp/heldout.md

(writing the shipped calibration, so the hidden case runs with simulate's default).
``--repeats N`` makes every run N times (repeat r > 0 named ``NAME_r<r>``, so an earlier single
invocation's runs are repeat 0): the calibration is fitted on all of them, and each pair compares
the medians over its repeats (:func:`dynmo_hpc.sim.heldout.median_row`). The 18
earlier runs took 6-55 s each on the development machine (about 4 minutes with the load average
near 1); the two 40-step elastic runs of the packing pair about a minute each under load.
Analysis alone, with all runs present, a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynmo_hpc import config as config_mod  # noqa: E402
from dynmo_hpc.bench.scripts import write_json_out, write_text_out  # noqa: E402
from dynmo_hpc.calibrate.short_runs import ShortRun, short_run_config  # noqa: E402
from dynmo_hpc.cli import main as cli_main  # noqa: E402
from dynmo_hpc.cli.simulate import format_table  # noqa: E402
from dynmo_hpc.runlog import RunLog, load  # noqa: E402
from dynmo_hpc.sim.heldout import (  # noqa: E402
    HeldOutRow,
    PackingMismatch,
    after_pack_s,
    external_ratio,
    fit_machine,
    measured_step_s,
    median_row,
    predict,
    predict_pair,
    target_settings,
)
from dynmo_hpc.sim.machine import (  # noqa: E402
    MachineModel,
    load_machine,
    save_machine,
    shipped_machine_path,
)
from dynmo_hpc.sim.runlog_traces import traces_from_runlog  # noqa: E402

SMALL_BATCH = ("train.micro_batch_size=2",)
"""The default job's batch of 8 makes a step several times longer than the others' here."""
SHORT = ("train.steady_state_step=null",)
"""The scheme jobs' bench steady state lies past these runs' 20 steps."""
NO_PACKING = ("elastic.enabled=false",)
"""jobs/elastic.yaml as a plain 4-stage run: the source of the packing pair. Both of its runs
have 40 steps: with 20, the 15 left after the first decision do not repay the restart and the
job keeps its 4 stages."""

CALIBRATION: tuple[ShortRun, ...] = (
    ShortRun("cal_default_p2_m4", "default", 2, 4, extra=SMALL_BATCH, steps=12, interval=4),
    ShortRun("cal_default_p4_m8", "default", 4, 8, extra=SMALL_BATCH, steps=12, interval=4),
    ShortRun("cal_mod_p2_m8", "stress/mod", 2, 8, extra=SMALL_BATCH, steps=12, interval=4),
    ShortRun("cal_moe_p3_m4", "stress/moe", 3, 4, extra=SMALL_BATCH, steps=12, interval=4),
    ShortRun("cal_imbalanced_p4_m8", "imbalanced", 4, 8, steps=12, interval=4),
)
"""Fits the machine file; never predicted, never a source of a held-out prediction."""

HELD_OUT: tuple[ShortRun, ...] = (
    ShortRun("imbalanced_p2_m6", "imbalanced", 2, 6),
    ShortRun("imbalanced_p2_m6_optimal", "imbalanced", 2, 6, "optimal"),
    ShortRun("imbalanced_p2_m6_diffusion", "imbalanced", 2, 6, "diffusion"),
    ShortRun("imbalanced_p3_m6", "imbalanced", 3, 6),
    ShortRun("imbalanced_p3_m6_optimal", "imbalanced", 3, 6, "optimal"),
    ShortRun("pruning_p2_m8", "stress/pruning", 2, 8, extra=SHORT),
    ShortRun("pruning_p2_m8_optimal", "stress/pruning", 2, 8, "optimal", extra=SHORT),
    ShortRun("pruning_p3_m8", "stress/pruning", 3, 8, extra=SHORT),
    ShortRun("freezing_p2_m8", "stress/freezing", 2, 8, extra=SHORT),
    ShortRun("freezing_p2_m8_optimal", "stress/freezing", 2, 8, "optimal", extra=SHORT),
    ShortRun("freezing_p3_m8", "stress/freezing", 3, 8, extra=SHORT),
    ShortRun("default_p2_m8", "default", 2, 8, extra=SMALL_BATCH),
    ShortRun("default_p3_m8", "default", 3, 8, extra=SMALL_BATCH),
    ShortRun("elastic_p4_m8", "elastic", 4, 8, extra=NO_PACKING, steps=40),
    ShortRun("elastic_p4_m8_packing", "elastic", 4, 8, "optimal", steps=40),
)

PAIRS: tuple[tuple[str, str], ...] = (
    # uniform -> a balancer, same stages
    ("imbalanced_p2_m6", "imbalanced_p2_m6_optimal"),
    ("imbalanced_p2_m6", "imbalanced_p2_m6_diffusion"),
    ("pruning_p2_m8", "pruning_p2_m8_optimal"),
    ("freezing_p2_m8", "freezing_p2_m8_optimal"),
    # 2 stages -> 3 stages of the same job (the layers' measured costs re-partitioned)
    ("imbalanced_p2_m6", "imbalanced_p3_m6"),
    ("imbalanced_p2_m6", "imbalanced_p3_m6_optimal"),
    ("pruning_p2_m8", "pruning_p3_m8"),
    ("freezing_p2_m8", "freezing_p3_m8"),
    ("default_p2_m8", "default_p3_m8"),
    # a run that never packs -> the same job packing 4 -> 2 stages (compared after the pack)
    ("elastic_p4_m8", "elastic_p4_m8_packing"),
)
"""(source X, target Y): Y predicted from X's load reports under Y's settings. A packing target
is compared on its steps after its first pack (:func:`dynmo_hpc.sim.heldout.after_pack_s`)."""

NATURAL_STEPS = 50
"""The natural scheme runs' steps: past pruning's last step (45), freezing's and early exit's
steady state (40)."""
ANOTHER_SEED = ("job.seed=7",)
"""The trace run of a scheme pair: the same job and settings as its static run, trained from
another seed (its own weights, so its own pruned structures, frozen blocks and exits)."""
SCHEME_RUNS: tuple[ShortRun, ...] = tuple(
    ShortRun(name, f"natural/{scheme}", 2, 8, algorithm, steps=NATURAL_STEPS, extra=extra)
    for scheme in ("pruning", "freezing", "early_exit")
    for name, algorithm, extra in (
        (f"nat_{scheme}_p2_m8_trace", "static", ANOTHER_SEED),
        (f"nat_{scheme}_p2_m8", "static", ()),
        (f"nat_{scheme}_p2_m8_optimal", "optimal", ()),
    )
)
"""The natural scheme jobs (jobs/natural/), each three times at 2 stages: a trace run, static,
and optimal."""

SCHEME_PAIRS: tuple[tuple[str, str, str], ...] = tuple(
    (f"nat_{s}_p2_m8_trace", f"nat_{s}_p2_m8", f"nat_{s}_p2_m8_optimal")
    for s in ("pruning", "freezing", "early_exit")
)
"""(trace T, static X, DynMo Y): X's and Y's steps, so DynMo's speedup X/Y, predicted from T's
load reports alone, neither run's own costs."""

HIDDEN = "imbalanced_p3_m6"
"""The issue's hidden case: jobs/imbalanced.yaml, 3 stages, 6 microbatches, static."""


def run_config(run: ShortRun, runs_dir: Path) -> config_mod.JobConfig:
    """``run``'s job, on the CPU whatever the job file says (the calibration is this CPU's)."""
    on_cpu = dataclasses.replace(run, extra=("runtime.device=cpu", *run.extra))
    return short_run_config(on_cpu, ROOT / "jobs", runs_dir)


def ensure_run(run: ShortRun, runs_dir: Path) -> Path:
    """The run's run.h5; trained first unless a finished one is already there (resumable)."""
    from dynmo_hpc.launch.local import launch_local

    path = runs_dir / run.name / "run.h5"
    if path.exists():
        try:
            if load(path).end_status == "ok":
                return path
        except Exception as exc:  # a torn log from an interrupted invocation: run it again
            print(f"  {run.name}: rerunning ({exc})", file=sys.stderr, flush=True)
    print(f"running {run.name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rc, run_dir = launch_local(run_config(run, runs_dir), timeout_s=900, overwrite=True)
    if rc != 0:
        raise SystemExit(f"run {run.name} failed with exit code {rc}")
    print(f"  {run.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return run_dir / "run.h5"


def repeat_names(name: str, repeats: int) -> list[str]:
    """The run names of ``name``'s repeats: ``name`` itself, then ``name_r1`` ..."""
    return [name, *(f"{name}_r{r}" for r in range(1, repeats))]


def repeated(runs: tuple[ShortRun, ...], repeats: int) -> tuple[ShortRun, ...]:
    """Every run ``repeats`` times, under :func:`repeat_names` (repeat 0 keeps its name, so
    the runs of an earlier single invocation count as repeat 0), in rounds: repeat 0 of every
    run, then repeat 1 of every run, and so on.

    Why rounds: the layers' CPU seconds on a shared machine drift in spells of minutes, and a
    prediction replays its source's costs as measured. Made back to back, a source's repeats
    all fall in one spell and bias every repeat of its pairs alike; in rounds, a pair's source
    and target of one repeat run minutes apart at most, and a spell falls on one repeat of a
    pair, which the median over repeats sets aside."""
    return tuple(
        dataclasses.replace(run, name=repeat_names(run.name, repeats)[r])
        for r in range(repeats)
        for run in runs
    )


def pair_row(
    logs: dict[str, RunLog],
    machine: MachineModel,
    source: str,
    target: str,
    repeats: int,
    trace: str | None = None,
) -> HeldOutRow:
    """The pair's row: repeat r of ``target`` (and of ``source``) predicted from repeat r of
    ``source``, or of ``trace`` when given, then the medians over repeats
    (:func:`dynmo_hpc.sim.heldout.median_row`). A repeat whose
    prediction packed differently from its target (:class:`PackingMismatch`) is left out of
    the medians and counted in the row, which then counts as a miss; if every repeat's did,
    the row has the measured steps only (predictions NaN), and says so."""
    rows, mismatches = [], []
    traces = repeat_names(trace, repeats) if trace is not None else [None] * repeats
    names = zip(repeat_names(source, repeats), repeat_names(target, repeats), traces, strict=True)
    for x, y, t in names:
        with_trace = {} if t is None else {"trace": (t, logs[t])}
        try:
            rows.append(predict_pair(logs[x], logs[y], machine, (x, y), **with_trace))
        except PackingMismatch as exc:
            mismatches.append(str(exc))
    if not rows:
        print(
            f"{source} -> {target}: no repeat's prediction packed as its target did: "
            + mismatches[0],
            file=sys.stderr,
        )
        return _unpredicted_row(logs, source, target, repeats)
    row = median_row(
        [dataclasses.replace(r, source=source, target=target, trace=trace or "") for r in rows]
    )
    return dataclasses.replace(row, mispredicted_repeats=len(mismatches))


def hidden_case(path: Path, machine_file: Path) -> dict[str, Any]:
    """The hidden case with the command a user would type (its own layer costs, the machine
    calibration; no wall times), in this process. When ``machine_file`` is the calibration
    shipped for this machine, the command has no ``--machine``: simulate's default."""
    argv = ["simulate", "--from", str(path), "--json"]
    shipped = shipped_machine_path(len(os.sched_getaffinity(0)))
    if shipped is None or shipped.resolve() != machine_file.resolve():
        argv[3:3] = ["--machine", str(machine_file)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(argv)
    if rc != 0:
        raise SystemExit(f"dynmo-hpc {' '.join(argv)} exited {rc}")
    run = load(path)
    algorithm = target_settings(run.config).algorithm
    predicted = float(json.loads(out.getvalue())[algorithm]["step_time_s"])
    measured = measured_step_s(run)
    return {
        "command": "dynmo-hpc " + " ".join(argv),
        "algorithm": algorithm,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "ratio": predicted / measured,
    }


def hidden_terms(run: RunLog, machine: MachineModel) -> dict[str, float]:
    """predicted / measured for the hidden case with the calibration's terms added one at a
    time: which term the compute-only default (0.88x in the issue) was missing."""
    traces, settings = traces_from_runlog(run), target_settings(run.config)
    measured = measured_step_s(run)
    link = {
        "latency_s": machine.latency_s,
        "bandwidth_bytes_per_s": machine.bandwidth_bytes_per_s,
        "poll_max_s": machine.poll_max_s,
    }
    variants = {
        "compute only (no calibration)": MachineModel(),
        "+ 2 cores shared": MachineModel(cores=machine.cores),
        "+ link and wake-up": MachineModel(cores=machine.cores, **link),
        "+ overheads (optimizer, step, report)": dataclasses.replace(
            machine, external_wall_s_per_cpu_s=None
        ),
        "+ other processes' load": dataclasses.replace(
            machine, oversubscribed_wall_s_per_cpu_s=None, oversubscribed_cpu_s_per_cpu_s=None
        ),
        "+ layers' CPU seconds with more ranks than cores": dataclasses.replace(
            machine, oversubscribed_wall_s_per_cpu_s=None
        ),
        "+ more ranks than cores, wall (all terms)": machine,
        "all terms but a core per stage": dataclasses.replace(machine, cores=None),
    }
    return {
        name: predict(traces, settings, model).median_step_time_s / measured
        for name, model in variants.items()
    }


LOADED = 1.10
"""A run whose layers ran this much slower than its own ranks' sharing explains had other
processes on the machine: its pair is reported, and flagged."""


def _unpredicted_row(logs: dict[str, RunLog], source: str, target: str, repeats: int) -> HeldOutRow:
    """A pair none of whose repeats' predictions packed as the target did: its measured steps
    (the target's after its pack), medians over repeats, and NaN predictions."""

    def measured(name: str) -> float:
        packed = after_pack_s(logs[name])
        return packed[1] if packed is not None else measured_step_s(logs[name])

    return HeldOutRow(
        source=source,
        target=target,
        target_settings=target_settings(logs[target].config, target),
        measured_source_s=statistics.median(measured(n) for n in repeat_names(source, repeats)),
        measured_target_s=statistics.median(measured(n) for n in repeat_names(target, repeats)),
        predicted_source_s=math.nan,
        predicted_target_s=math.nan,
        mispredicted_repeats=repeats,
    )


TOLERANCE = 0.10
"""The held-out target: step time and speedup within 10 %."""


def _mispredicted_note(row: HeldOutRow) -> str:
    """The error cell's note for repeats left out of the medians."""
    if not row.mispredicted_repeats:
        return ""
    return f" ({row.mispredicted_repeats} repeat(s) predicted another packing decision)"


def markdown(
    rows: list[HeldOutRow],
    hidden: dict[str, Any],
    machine: MachineModel,
    load_of: dict[str, float],
) -> str:
    """The table to paste into docs/simulate.md#held-out-validation."""
    fitted_on = ", ".join((machine.notes or {}).get("fitted_on", []))
    over, cpu = machine.oversubscribed_wall_s_per_cpu_s, machine.oversubscribed_cpu_s_per_cpu_s
    lines = [
        f"Machine calibration fitted on {fitted_on} (external load "
        f"{machine.external_wall_s_per_cpu_s:.3f}, more ranks than cores: layers' CPU "
        f"{'none' if cpu is None else f'{cpu:.3f}'}, wall "
        f"{'none' if over is None else f'{over:.3f}'}); "
        f"measured {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| source X | target Y | costs from | P | M | algorithm | Y measured s | Y predicted s "
        "| error | speedup X/Y measured | predicted | error | other load X / Y |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        t = r.target_settings
        lines.append(
            f"| {r.source} | {r.target} | {r.trace or 'X'} | {t.num_stages} "
            f"| {t.num_microbatches} | {t.algorithm} "
            f"| {r.measured_target_s:.4f} | {r.predicted_target_s:.4f} | {r.step_error:+.1%}"
            f"{_mispredicted_note(r)} "
            f"| {r.measured_speedup:.3f} | {r.predicted_speedup:.3f} | {r.speedup_error:+.1%} "
            f"| {load_of[r.source]:.2f} / {load_of[r.target]:.2f} |"
        )
    scheme_rows = [r for r in rows if r.trace]
    predicted = [r for r in rows if math.isfinite(r.predicted_target_s)]
    worst_step = max((abs(r.step_error) for r in predicted), default=math.nan)
    worst_speedup = max((abs(r.speedup_error) for r in predicted), default=math.nan)
    loaded = sorted(name for name, k in load_of.items() if k > LOADED)
    lines += [
        "",
        "Other load: each run's median wall-per-CPU ratio of its layers over what its own ranks "
        "sharing the cores explain (`heldout.external_ratio`; a diagnostic of the measurement, "
        "not an input of any prediction). "
        + (
            f"**Over {LOADED}, i.e. other processes ran: {', '.join(loaded)}; delete those runs' "
            "directories and rerun on an idle machine.**"
            if loaded
            else f"All runs at most {LOADED}."
        ),
        "",
        f"**{sum(r.within(TOLERANCE) for r in rows)} of {len(rows)} held-out pairs within "
        f"{TOLERANCE:.0%} on both the step time and the speedup** (a pair with a repeat whose "
        "prediction packed to another stage count than its target counts as a miss). "
        f"Worst step-time error {worst_step:.1%}, worst speedup error {worst_speedup:.1%} over "
        f"the {len(predicted)} held-out pairs with a prediction."
        + (
            f" Scheme pairs (X and Y predicted from a third run's costs): "
            f"{sum(r.within(TOLERANCE) for r in scheme_rows)} of {len(scheme_rows)} within "
            f"{TOLERANCE:.0%}; DynMo's speedup measured / predicted: "
            + ", ".join(
                f"{r.target} {r.measured_speedup:.3f} / {r.predicted_speedup:.3f}"
                for r in scheme_rows
            )
            + "."
            if scheme_rows
            else ""
        ),
        "",
        f"Hidden case (`{hidden['command']}`): measured {hidden['measured_step_s']:.4f} s, "
        f"predicted {hidden['predicted_step_s']:.4f} s, {hidden['ratio']:.3f}x."
        + (
            " Over its repeats: " + ", ".join(f"{x:.3f}x" for x in hidden["repeat_ratios"]) + "."
            if "repeat_ratios" in hidden
            else ""
        ),
        "",
        "| hidden case, model | predicted / measured |",
        "| --- | --- |",
        *(f"| {name} | {ratio:.3f} |" for name, ratio in hidden["terms"].items()),
    ]
    return "\n".join(lines) + "\n"


def keep_layer_rates(machine: MachineModel, path: Path) -> MachineModel:
    """``machine`` with the per-layer cost model's rates (and their notes) that ``path``
    already holds: benchmarks/fit_cost_model.py writes those into the same file, and this
    script's calibration must not drop them (the base machine has none)."""
    if not path.exists():
        return machine
    existing = load_machine(path)
    if existing.layer_rates is None:
        return machine
    notes = dict(machine.notes or {})
    if existing.notes and "layer_rates" in existing.notes:
        notes["layer_rates"] = existing.notes["layer_rates"]
    return dataclasses.replace(machine, layer_rates=existing.layer_rates, notes=notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/heldout_runs"))
    parser.add_argument("--runs-only", action="store_true", help="make the runs, no table")
    parser.add_argument(
        "--base-machine",
        type=Path,
        default=ROOT / "benchmarks" / "machine_2core.json",
        help="measured constants kept as they are: optimizer per parameter, link, cores, "
        "wake-up (benchmarks/calibrate_sim.py --write-machine)",
    )
    parser.add_argument(
        "--rerun-loaded",
        action="store_true",
        help=f"run again, once, any run whose other load is over {LOADED} (kept or new)",
    )
    parser.add_argument("--write-machine", type=Path, help="where the fitted calibration goes")
    parser.add_argument("--json-out", type=Path, help="the table as JSON")
    parser.add_argument("--markdown-out", type=Path, help="the table as markdown")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each job (repeat r > 0 named NAME_r<r>); each pair's figures are the "
        "medians over repeats, the calibration is fitted on every repeat",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smallest set that exercises every part (2 calibration runs, the first pair, the "
        "hidden case; 8 steps each): checks the script runs, its figures are not the table's",
    )
    parser.add_argument(
        "--pairs",
        choices=("all", "classic", "scheme"),
        default="all",
        help="which held-out pairs: the classic ones (PAIRS), the natural scheme pairs "
        "predicted from a third run (SCHEME_PAIRS), or both; the hidden case always",
    )
    args = parser.parse_args()
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    base = load_machine(args.base_machine)
    calibration, held_out, pairs = CALIBRATION, HELD_OUT, PAIRS
    scheme_runs, scheme_pairs = SCHEME_RUNS, SCHEME_PAIRS
    if args.pairs == "scheme":
        held_out, pairs = tuple(r for r in HELD_OUT if r.name == HIDDEN), ()
    if args.pairs == "classic" or args.quick:
        scheme_runs, scheme_pairs = (), ()
    if args.quick:
        calibration, pairs = CALIBRATION[:2], PAIRS[:1]
        needed = {HIDDEN, *pairs[0]}
        held_out = tuple(r for r in HELD_OUT if r.name in needed)
        calibration = tuple(dataclasses.replace(r, steps=8) for r in calibration)
        held_out = tuple(dataclasses.replace(r, steps=8) for r in held_out)
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats {args.repeats} must be >= 1")
    calibration = repeated(calibration, args.repeats)
    paths: dict[str, Path] = {}
    held_out = (*held_out, *scheme_runs)
    for run in (*calibration, *repeated(held_out, args.repeats)):
        paths[run.name] = ensure_run(run, args.runs_dir)
        if args.rerun_loaded and external_ratio(load(paths[run.name]), base) > LOADED:
            print(f"  {run.name}: other processes ran; once more", file=sys.stderr, flush=True)
            shutil.rmtree(paths[run.name].parent)
            paths[run.name] = ensure_run(run, args.runs_dir)
    if args.runs_only:
        return
    logs = {name: load(path) for name, path in paths.items()}
    machine = fit_machine(
        [(r.name, logs[r.name]) for r in calibration],
        base,
        notes={"how": "benchmarks/heldout_sim.py", "measured": time.strftime("%Y-%m-%d %H:%M")},
    )
    if args.write_machine:
        machine = keep_layer_rates(machine, args.write_machine)
    with tempfile.TemporaryDirectory() as tmp:
        machine_file = args.write_machine or Path(tmp) / "machine.json"
        save_machine(machine, machine_file)
        rows = [pair_row(logs, machine, x, y, args.repeats) for x, y in pairs]
        rows += [pair_row(logs, machine, x, y, args.repeats, t) for t, x, y in scheme_pairs]
        hidden = hidden_case(paths[HIDDEN], machine_file)
        if args.repeats > 1:
            names = repeat_names(HIDDEN, args.repeats)
            hidden["repeat_ratios"] = [hidden_case(paths[n], machine_file)["ratio"] for n in names]
    hidden["terms"] = hidden_terms(logs[HIDDEN], machine)
    load_of = {
        r.name: max(external_ratio(logs[n], machine) for n in repeat_names(r.name, args.repeats))
        for r in held_out
    }
    print(format_table(rows))
    print(
        f"hidden case: {hidden['command']}\n  measured {hidden['measured_step_s']:.4f} s, "
        f"predicted {hidden['predicted_step_s']:.4f} s, {hidden['ratio']:.3f}x"
    )
    text = markdown(rows, hidden, machine, load_of)
    print(text)
    table = {
        "machine": machine.to_json(),
        "rows": [r.to_json() for r in rows],
        "hidden": hidden,
        "other_load": load_of,
    }
    write_json_out(args.json_out, table)
    write_text_out(args.markdown_out, text)


if __name__ == "__main__":
    main()
