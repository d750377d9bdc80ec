"""Checkpoint cost: write and restore times, and the default interval's share of training time.

Two models on 2 ranks: the default job (jobs/default.yaml) and one with about 10x its
parameters (9 blocks of d_model 384 / d_ff 1536; micro_batch_size 2 instead of 8, so a step
takes seconds, not tens of seconds, on 2 cores: the table shows each model's tokens per step).
Each repeat, for each model (the order alternates between repeats so drift hits both alike):

1. train ``--steps`` steps writing a checkpoint every ``--every`` steps (default keep=2, no
   checkpoint at the end); from the run log take each ``checkpoint`` event's seconds (slowest
   rank's wall time for the collective save, pruning of old checkpoints included) and bytes,
   and the median ``step_time_s`` of the steps that wrote no checkpoint (step 0, warm-up, left
   out too; a save runs after its step's timer stops, so this is the pure training step);
2. resume the same run from the oldest checkpoint still kept (mid-run) for one more step and
   take ``restore_s`` from the ``restart`` event: the slowest rank's seconds to verify the
   checkpoint (rank 0 checks every file's size and CRC-32), read its layers, rebuild them with
   their AdamW state and set up the stage. Process start-up (MPI, importing torch and the
   ``torch._dynamo`` that ``torch.optim`` pulls in, 2-3 s) is paid by every run, resumed or not,
   and is not counted. The files were just written, so they are read from the page cache: a
   warm-cache restore.

Reported per model: parameters, checkpoint MB, write seconds and restore seconds (median and
min-max over all writes/restores of all repeats), write MB/s, median step time, and the
overhead of the default interval ``checkpoint.every_steps`` (read from CheckpointSection):
median write_s / (every_steps x median step_time_s). Both jobs balance statically, so no
migration perturbs the step times. A markdown table goes to stdout, progress to stderr, the
same figures as JSON to ``--out FILE``.

    .venv/bin/python benchmarks/bench_checkpoint.py --repeats 3 [--steps 12 --every 3]
    .venv/bin/python benchmarks/bench_checkpoint.py --tiny --repeats 1 --steps 3 --every 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.bench.scripts import write_json_out
from dynmo_hpc.config.sections import CheckpointSection
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "default.yaml"

# Overrides on top of jobs/default.yaml, per model. "large" has ~10x the default's parameters.
MODELS: dict[str, list[str]] = {
    "default": [],
    "large": [
        "model.num_blocks=9",
        "model.d_model=384",
        "model.d_ff=1536",
        "train.micro_batch_size=2",
    ],
}

# --tiny: a model small enough that a run takes seconds (as tests/helpers/jobs.py TINY), and a
# second one a few times bigger, for the smoke test.
TINY_BASE = [
    "model.num_blocks=4",
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.num_microbatches=4",
    "train.log_interval=1",
    "balance.interval=2",
]
TINY_MODELS: dict[str, list[str]] = {
    "tiny": TINY_BASE,
    "tiny_large": [*TINY_BASE, "model.d_model=64", "model.d_ff=256"],
}

COMMON = ["balance.algorithm=static", "checkpoint.at_end=false"]


@dataclass
class ModelResult:
    """Every measurement of one model over all repeats."""

    name: str
    overrides: list[str]
    params: int = 0
    tokens_per_step: int = 0
    write_s: list[float] = field(default_factory=list)
    write_bytes: list[int] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    """Median step time of each training run (one per repeat)."""


def job_config(overrides: list[str], out_dir: Path, name: str, *extra: str) -> Any:
    return config_mod.load(
        JOB, [*overrides, *COMMON, f"job.out_dir={out_dir}", f"job.name={name}", *extra]
    )


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_once(
    result: ModelResult, out_dir: Path, name: str, steps: int, every: int, timeout_s: float
) -> None:
    """One training run with periodic checkpoints, then one resume from a mid-run checkpoint."""
    cfg = job_config(
        result.overrides, out_dir, name, f"train.steps={steps}", f"checkpoint.every_steps={every}"
    )
    result.tokens_per_step = int(cfg.tokens_per_step)
    progress(f"{name}: training {steps} steps, a checkpoint every {every}")
    rc, run_dir = launch_local(cfg, timeout_s=timeout_s)
    if rc:
        raise SystemExit(f"{name}: training run failed (exit code {rc}); see the output above")
    log = load(run_dir / "run.h5")
    writes = log.events[log.events["kind"] == "checkpoint"]
    if writes.empty:
        raise SystemExit(f"{name}: no checkpoint was written (steps={steps}, every={every})")
    for detail in writes["detail"]:
        result.write_s.append(float(detail["seconds"]))
        result.write_bytes.append(int(detail["bytes"]))
    skip = {0, *(int(s) for s in writes["step"])}
    plain = log.steps[~log.steps["step"].isin(skip)]["step_time_s"]
    if plain.empty:
        plain = log.steps["step_time_s"]
    result.step_time_s.append(float(plain.median()))
    first_report = log.layer_costs[log.layer_costs["step"] == log.layer_costs["step"].min()]
    result.params = int(first_report["num_params"].sum())

    kept = sorted(
        int(p.name.removeprefix("step_"))
        for p in (run_dir / "checkpoint").glob("step_*")
        if p.name.removeprefix("step_").isdigit()
    )
    if not kept:
        raise SystemExit(f"{name}: no checkpoint directory left under {run_dir / 'checkpoint'}")
    from_step = kept[0]
    resume_dir = run_dir / "checkpoint" / f"step_{from_step}"
    progress(f"{name}: resuming from {resume_dir.name} for one step")
    cfg = job_config(
        result.overrides,
        out_dir,
        name,
        f"train.steps={from_step + 1}",
        "checkpoint.every_steps=0",
    )
    rc, run_dir = launch_local(cfg, timeout_s=timeout_s, resume_from=resume_dir)
    if rc:
        raise SystemExit(f"{name}: resume from {resume_dir} failed (exit code {rc})")
    log = load(run_dir / "run.h5")
    restarts = log.events[log.events["kind"] == "restart"]
    if restarts.empty:
        raise SystemExit(f"{name}: the resumed run logged no restart event")
    detail = restarts["detail"].iloc[-1]
    if int(detail["checkpoint_step"]) != from_step:
        raise SystemExit(f"{name}: resumed at step {detail['checkpoint_step']}, not {from_step}")
    result.restore_s.append(float(detail["restore_s"]))


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(result: ModelResult, default_every: int) -> dict[str, Any]:
    write = spread(result.write_s)
    step_s = statistics.median(result.step_time_s)
    rates = [b / s / 1e6 for b, s in zip(result.write_bytes, result.write_s, strict=True) if s > 0]
    return {
        "overrides": result.overrides,
        "params": result.params,
        "tokens_per_step": result.tokens_per_step,
        "checkpoint_bytes": int(statistics.median(result.write_bytes)),
        "checkpoint_mb": statistics.median(result.write_bytes) / 1e6,
        "write_s": write,
        "restore_s": spread(result.restore_s),
        "write_mb_per_s": statistics.median(rates) if rates else 0.0,
        "step_time_s": step_s,
        "default_every_steps": default_every,
        "overhead_pct": 100.0 * write["median"] / (default_every * step_s),
        "num_writes": len(result.write_s),
        "num_restores": len(result.restore_s),
        "raw": {
            "write_s": result.write_s,
            "write_bytes": result.write_bytes,
            "restore_s": result.restore_s,
            "step_time_s": result.step_time_s,
        },
    }


def table(summary: dict[str, dict[str, Any]], default_every: int) -> str:
    base = next(iter(summary.values()))["params"]
    lines = [
        "| model | params | x | tokens/step | ckpt MB | write s (median, min-max) "
        "| restore s (median, min-max) | write MB/s | step s "
        f"| overhead @ every {default_every} steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        w, r = s["write_s"], s["restore_s"]
        lines.append(
            f"| {name} | {s['params'] / 1e6:.2f} M | {s['params'] / base:.1f} "
            f"| {s['tokens_per_step']} | {s['checkpoint_mb']:.1f} "
            f"| {w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f}) "
            f"| {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) "
            f"| {s['write_mb_per_s']:.0f} | {s['step_time_s']:.3f} | {s['overhead_pct']:.2f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--every", type=int, default=3, help="checkpoint interval while measuring")
    parser.add_argument("--tiny", action="store_true", help="tiny models (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--work-dir", type=Path, default=None, help="where runs go (default: tmp)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.every < 1 or args.steps <= args.every:
        parser.error("need --repeats >= 1, --every >= 1 and --steps > --every")
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    models = TINY_MODELS if args.tiny else MODELS
    default_every = CheckpointSection().every_steps
    results = {name: ModelResult(name, overrides) for name, overrides in models.items()}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_", dir=args.work_dir) as tmp:
        for rep in range(args.repeats):
            order = list(results) if rep % 2 == 0 else list(reversed(results))
            for name in order:
                progress(f"repeat {rep + 1}/{args.repeats}, model {name}")
                measure_once(
                    results[name],
                    Path(tmp) / f"r{rep}",
                    name,
                    args.steps,
                    args.every,
                    args.timeout,
                )
                r = results[name]
                progress(
                    f"{name}: write {r.write_s[-1]:.3f} s, restore {r.restore_s[-1]:.2f} s, "
                    f"step {r.step_time_s[-1]:.3f} s, {r.write_bytes[-1] / 1e6:.1f} MB"
                )
    summary = {name: summarise(r, default_every) for name, r in results.items()}
    print(
        f"jobs/default.yaml on 2 ranks, {args.repeats} repeats, {args.steps} steps per run, "
        f"a checkpoint every {args.every} ({sum(s['num_writes'] for s in summary.values())} "
        f"writes, {sum(s['num_restores'] for s in summary.values())} restores); overhead = "
        f"median write s / ({default_every} x median step s)"
    )
    print(table(summary, default_every))
    if args.out is not None:
        figures = {
            "repeats": args.repeats,
            "steps": args.steps,
            "every_steps": args.every,
            "default_every_steps": default_every,
            "tiny": args.tiny,
            "elapsed_s": time.perf_counter() - started,
            "models": summary,
        }
        write_json_out(args.out, figures, newline=False)  # creates args.out's directory
        progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
