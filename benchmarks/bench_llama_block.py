"""The pipeline engine's cost on Llama blocks: one stage of our engine against one plain module.

Same model, same microbatches, one process, forward + backward only (no optimizer step):

  1. plain: the layers called one after another as one torch module, one autograd backward per
     microbatch (what any single-process training loop does);
  2. pipeline: :class:`dynmo_hpc.pipeline.stage.PipelineStage` on one stage (``MPI.COMM_SELF``),
     running its 1F1B schedule: every layer's input cut from autograd, its forward and backward
     timed on their own, the gradients chained by hand.

The difference is what the engine's per-layer segments and timers cost. Rounds alternate the two
(order rotating), the first ``--warmup`` steps of each are skipped, and the figure is the median
over rounds of each side's median step time, with the range over rounds, and the ratio
(pipeline / plain) of each round's medians.

    .venv/bin/python benchmarks/bench_llama_block.py [--arch llama] [--rounds 5] [--steps 6]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

from dynmo_hpc import config as config_mod
from dynmo_hpc.bench.scripts import write_json_out
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext
from dynmo_hpc.model.schemes import build_layer
from dynmo_hpc.pipeline.comm import StageLink
from dynmo_hpc.pipeline.schedule import build_schedule
from dynmo_hpc.pipeline.stage import PipelineStage

MODEL = {
    "llama": [
        "model.arch=llama",
        "model.num_blocks=4",
        "model.d_model=128",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.d_ff=344",
        "model.seq_len=128",
    ],
    "gpt2": [
        "model.num_blocks=4",
        "model.d_model=128",
        "model.num_heads=4",
        "model.d_ff=512",
        "model.seq_len=128",
    ],
}


def bench_config(arch: str, num_microbatches: int) -> config_mod.JobConfig:
    return config_mod.from_dict(
        config_mod.apply_overrides(
            {},
            [
                *MODEL[arch],
                "train.micro_batch_size=8",
                f"train.num_microbatches={num_microbatches}",
                "pipeline.num_stages=1",
                "runtime.device=cpu",
            ],
        )
    )


def plain_step_s(cfg: config_mod.JobConfig, layers: list, dataset: TextDataset, step: int) -> float:
    t0 = time.perf_counter()
    m = cfg.train.num_microbatches
    for mb in range(m):
        tokens, targets = dataset.batch(cfg.job.seed, step, mb, cfg.train.micro_batch_size)
        ctx = MicrobatchContext(tokens=tokens, targets=targets)
        x = None
        for layer in layers:
            x = layer(x, ctx)
        assert ctx.loss is not None
        (ctx.loss / m).backward()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def pipeline_step_s(stage: PipelineStage, step: int) -> float:
    actions = build_schedule("1f1b", 0, 1, stage.num_microbatches)
    t0 = time.perf_counter()
    stage.run_schedule(step, actions)
    elapsed = time.perf_counter() - t0
    for slot in stage.slots:
        slot.module.zero_grad(set_to_none=True)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(MODEL), default="llama")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.rounds < 1:
        print(
            f"error: --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds} leave "
            "no measured step; HINT: --steps must exceed --warmup, and --rounds be >= 1",
            file=sys.stderr,
        )
        return 1
    torch.set_num_threads(args.threads)
    cfg = bench_config(args.arch, args.microbatches)
    dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
    device = torch.device("cpu")
    link = StageLink(MPI.COMM_SELF, 0, 1, device)
    stage = PipelineStage(cfg, 0, [0, cfg.model.num_layers], link, dataset, device)
    layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
    medians: dict[str, list[float]] = {"plain": [], "pipeline": []}
    for r in range(args.rounds):
        order = ["plain", "pipeline"] if r % 2 == 0 else ["pipeline", "plain"]
        for side in order:
            times = [
                plain_step_s(cfg, layers, dataset, s)
                if side == "plain"
                else pipeline_step_s(stage, s)
                for s in range(args.steps)
            ][args.warmup :]
            medians[side].append(statistics.median(times))
    plain, pipe = statistics.median(medians["plain"]), statistics.median(medians["pipeline"])
    print(
        f"{args.arch}: {cfg.model.num_blocks} blocks d_model {cfg.model.d_model}, "
        f"{args.microbatches} microbatches of {cfg.train.micro_batch_size} x "
        f"{cfg.model.seq_len}, {args.threads} thread(s), {args.rounds} rounds"
    )
    print("| side | median step (s) | range over rounds (s) |")
    print("| --- | --- | --- |")
    for side, value in (("plain module", plain), ("pipeline stage", pipe)):
        key = "plain" if side.startswith("plain") else "pipeline"
        print(f"| {side} | {value:.4f} | {min(medians[key]):.4f} - {max(medians[key]):.4f} |")
    ratios = [p / q for p, q in zip(medians["pipeline"], medians["plain"], strict=True)]
    print(
        f"pipeline / plain = {pipe / plain:.3f} (per round: median {statistics.median(ratios):.3f}"
        f", {min(ratios):.3f} - {max(ratios):.3f})"
    )
    write_json_out(
        args.json,
        {"arch": args.arch, "plain_s": medians["plain"], "pipeline_s": medians["pipeline"]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
