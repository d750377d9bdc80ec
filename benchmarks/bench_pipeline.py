"""Pipeline throughput, side by side in one run on this machine.

Three ways to train the same model, same split, same microbatches:
  1. a single process (dynmo_hpc.testing.reference: all layers, no pipeline);
  2. our engine: 2 MPI ranks, 1F1B;
  3. torch.distributed.pipelining Schedule1F1B over gloo, 2 ranks
     (benchmarks/torch_pipelining_rank.py).
Each round runs all three for every M given, back to back, each in its own run directory; the
order rotates between rounds, and figures are medians over rounds of per-run medians (the first
``WARMUP_STEPS`` steps are warm-up and skipped), with the range over rounds. It prints a markdown
table of tokens/s, the ratios, and our measured bubble fraction (idle / (idle + compute), from
the run log) against the theoretical (P - 1) / (M + P - 1). Settings that leave no measured step
are refused with one line and exit status 1.

    .venv/bin/python benchmarks/bench_pipeline.py [--rounds 3] [--steps 12] [--microbatches 8 16]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dynmo_hpc import config as config_mod
from dynmo_hpc.bench.scripts import write_json_out
from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, launch_local, openmpi_env
from dynmo_hpc.launch.rundir import prepare_run_dir
from dynmo_hpc.pipeline.schedule import theoretical_bubble_fraction
from dynmo_hpc.runlog import load
from dynmo_hpc.testing.reference import train_reference

ROOT = Path(__file__).resolve().parent.parent

WARMUP_STEPS = 2


def bench_config(
    out_dir: Path, steps: int, num_microbatches: int, name: str
) -> config_mod.JobConfig:
    return config_mod.load(
        ROOT / "jobs" / "default.yaml",
        [
            f"job.name={name}",
            f"job.out_dir={out_dir}",
            "model.seq_len=64",
            "train.micro_batch_size=4",
            f"train.num_microbatches={num_microbatches}",
            f"train.steps={steps}",
            "train.grad_clip=0",  # torch's pipelining baseline does not clip
            "checkpoint.at_end=false",
            "checkpoint.every_steps=0",
            "train.log_interval=1000",
            "pipeline.num_stages=2",
            "pipeline.partition=[0, 5, 10]",
            f"balance.interval={steps}",
            "balance.algorithm=static",
        ],
    )


def run_single(cfg: config_mod.JobConfig) -> float:
    result = train_reference(cfg)
    times = result.step_time_s[WARMUP_STEPS:]
    return cfg.tokens_per_step / statistics.median(times)


def run_ours(cfg: config_mod.JobConfig) -> tuple[float, float]:
    rc, run_dir = launch_local(cfg, timeout_s=900)
    if rc != 0:
        raise SystemExit(f"our pipeline run failed with exit code {rc}")
    result = json.loads((run_dir / "result.json").read_text())
    tokens_per_s = statistics.median(result["tokens_per_s"][WARMUP_STEPS:])
    times = load(run_dir / "run.h5").stage_times
    times = times[times["step"] >= WARMUP_STEPS]
    bubble = float(times["idle_s"].sum() / (times["idle_s"].sum() + times["compute_s"].sum()))
    return tokens_per_s, bubble


def run_torch(cfg: config_mod.JobConfig) -> float:
    config_path = prepare_run_dir(cfg)
    out = config_path.parent / "torch_result.json"
    mpiexec = LocalMpiLauncher()
    cmd = mpiexec.command(
        LaunchSpec(
            num_ranks=2,
            rank_argv=[
                sys.executable,
                "-m",
                "mpi4py",
                str(ROOT / "benchmarks" / "torch_pipelining_rank.py"),
                str(config_path),
                str(out),
            ],
        )
    )
    env = {**os.environ, **openmpi_env(), "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
    return statistics.median(json.loads(out.read_text())["tokens_per_s"][WARMUP_STEPS:])


RUNNERS = ("single", "ours", "torch")


def check_settings(rounds: int, steps: int, microbatches: list[int]) -> None:
    """Refuse settings whose medians would be empty (one line on stderr, exit status 1)."""
    if rounds < 1:
        raise SystemExit(f"bench_pipeline: --rounds must be >= 1, got {rounds}")
    if steps <= WARMUP_STEPS:
        raise SystemExit(
            f"bench_pipeline: --steps {steps} leaves no measured step after the "
            f"{WARMUP_STEPS} warm-up steps; HINT: use --steps {WARMUP_STEPS + 1} or more"
        )
    if min(microbatches) < 1:
        raise SystemExit(f"bench_pipeline: --microbatches must be >= 1, got {microbatches}")


def measure(
    tmp: Path, rounds: int, steps: int, microbatches: list[int]
) -> dict[int, dict[str, list[float]]]:
    """Per M, per runner, one figure per round; every run gets its own run directory.

    Each round runs every (M, runner) pair back to back; the order rotates between rounds so
    drift on a shared machine hits every configuration alike.
    """
    figures: dict[int, dict[str, list[float]]] = {
        m: {"single": [], "ours": [], "torch": [], "bubble": []} for m in microbatches
    }
    pairs = [(m, runner) for m in microbatches for runner in RUNNERS]
    for rnd in range(rounds):
        shift = rnd % len(pairs)
        for m, runner in pairs[shift:] + pairs[:shift]:
            cfg = bench_config(tmp, steps, m, f"bench_{runner}_m{m}_r{rnd}")
            if runner == "single":
                figures[m]["single"].append(run_single(cfg))
            elif runner == "ours":
                tokens_per_s, bubble = run_ours(cfg)
                figures[m]["ours"].append(tokens_per_s)
                figures[m]["bubble"].append(bubble)
            else:
                figures[m]["torch"].append(run_torch(cfg))
            print(f"round {rnd + 1}/{rounds}: M={m} {runner} done", file=sys.stderr, flush=True)
    return figures


def summarise(m: int, fig: dict[str, list[float]]) -> dict[str, object]:
    """Medians and ranges over rounds for one M, with the ratios and the bubble against theory."""
    med = statistics.median
    return {
        "microbatches": m,
        **{f"{k}_tokens_per_s": med(fig[k]) for k in RUNNERS},
        **{f"{k}_tokens_per_s_range": [min(fig[k]), max(fig[k])] for k in RUNNERS},
        "ours_over_single": med(fig["ours"]) / med(fig["single"]),
        "ours_over_torch": med(fig["ours"]) / med(fig["torch"]),
        "bubble_measured": med(fig["bubble"]),
        "bubble_measured_range": [min(fig["bubble"]), max(fig["bubble"])],
        "bubble_theory": theoretical_bubble_fraction(2, m),
        "per_round": {k: fig[k] for k in (*RUNNERS, "bubble")},
    }


def print_table(rows: list[dict[str, object]], rounds: int) -> None:
    """A markdown table: medians over rounds with [min-max] in brackets."""

    def tps(row: dict[str, object], key: str) -> str:
        lo, hi = row[f"{key}_tokens_per_s_range"]  # type: ignore[misc]
        return f"{row[f'{key}_tokens_per_s']:.0f} [{lo:.0f}-{hi:.0f}]"

    print(
        "model: 10 layers (embedding, 8 blocks d_model=128, head), split [0,5,10], "
        f"microbatches of 4 x 64 tokens, {rounds} rounds interleaved; tokens/s, "
        "median [min-max] over rounds"
    )
    print(
        "| microbatches | single process | dynmo_hpc 1F1B, 2 ranks | torch pipelining 1F1B, "
        "2 ranks | ours / single | ours / torch | bubble measured [min-max] / theory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        lo, hi = row["bubble_measured_range"]  # type: ignore[misc]
        print(
            f"| {row['microbatches']} | {tps(row, 'single')} | {tps(row, 'ours')} | "
            f"{tps(row, 'torch')} | {row['ours_over_single']:.2f}x | "
            f"{row['ours_over_torch']:.2f}x | {row['bubble_measured']:.3f} "
            f"[{lo:.3f}-{hi:.3f}] / {row['bubble_theory']:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=[8], help="one or more M, interleaved"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    check_settings(args.rounds, args.steps, args.microbatches)
    import logging

    logging.getLogger("dynmo_hpc").setLevel(logging.WARNING)
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(Path(tmp), args.rounds, args.steps, args.microbatches)
    rows = [summarise(m, figures[m]) for m in args.microbatches]
    print_table(rows, args.rounds)
    figures = {"rounds": args.rounds, "steps": args.steps, "rows": rows}
    write_json_out(args.json, figures, indent=None, newline=False)


if __name__ == "__main__":
    main()
