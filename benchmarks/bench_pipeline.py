"""Pipeline throughput, side by side in one run on this machine.

Three ways to train the same model, same split, same microbatches:
  1. a single process (dynmo_hpc.pipeline.reference: all layers, no pipeline);
  2. our engine: 2 MPI ranks, 1F1B;
  3. torch.distributed.pipelining Schedule1F1B over gloo, 2 ranks
     (benchmarks/torch_pipelining_rank.py).
Each round runs all three back to back; the order rotates between rounds, and figures are medians
over rounds of per-run medians (the first steps are warm-up and skipped). It prints tokens/s, the
ratios, and our measured bubble fraction (idle / (idle + compute), from the run log) against the
theoretical (P - 1) / (M + P - 1).

    .venv/bin/python benchmarks/bench_pipeline.py [--rounds 3] [--steps 12] [--microbatches 8]
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
from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, launch_local, openmpi_env
from dynmo_hpc.launch.rundir import prepare_run_dir
from dynmo_hpc.pipeline.reference import train_reference
from dynmo_hpc.pipeline.schedule import theoretical_bubble_fraction
from dynmo_hpc.runlog import load

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    import logging

    logging.getLogger("dynmo_hpc").setLevel(logging.WARNING)
    os.environ["DYNMO_LOG_LEVEL"] = "WARNING"
    single, ours, torch_pp, bubbles = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(Path(tmp), args.steps, args.microbatches, "bench")
        runners = [
            ("single", lambda: single.append(run_single(cfg))),
            ("ours", lambda: (lambda r: (ours.append(r[0]), bubbles.append(r[1])))(run_ours(cfg))),
            ("torch", lambda: torch_pp.append(run_torch(cfg))),
        ]
        for rnd in range(args.rounds):
            order = runners[rnd % 3 :] + runners[: rnd % 3]
            for name, fn in order:
                fn()
                print(f"round {rnd + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    med = statistics.median
    p, m = 2, args.microbatches
    print(
        f"model: 10 layers (embedding, 8 blocks d_model=128, head), split [0,5,10], "
        f"M={m} microbatches of 4 x 64 tokens, {args.rounds} rounds, medians"
    )
    print(f"{'configuration':<38}{'tokens/s':>10}")
    print(f"{'single process (1 rank)':<38}{med(single):>10.0f}")
    print(f"{'dynmo_hpc 1F1B (2 ranks)':<38}{med(ours):>10.0f}")
    print(f"{'torch.distributed.pipelining 1F1B (2)':<38}{med(torch_pp):>10.0f}")
    print(f"ours / single process: {med(ours) / med(single):.2f}x  (target >= 1.7x)")
    print(f"ours / torch pipelining: {med(ours) / med(torch_pp):.2f}x  (target >= 1.0x)")
    print(
        f"bubble fraction: measured {med(bubbles):.3f}, theoretical (P-1)/(M+P-1) = "
        f"{theoretical_bubble_fraction(p, m):.3f}"
    )
    print(
        "per round (single, ours, torch): "
        + "; ".join(
            f"{a:.0f}, {b:.0f}, {c:.0f}" for a, b, c in zip(single, ours, torch_pp, strict=True)
        )
    )


if __name__ == "__main__":
    main()
