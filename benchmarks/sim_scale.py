"""DynMo's simulated speedups at 8, 16 and 32 stages, from the scheme jobs' measured cost traces.

A 2-core machine measures 2 stages honestly and no more. This script takes the per-layer cost
history of real runs (each load report's forward and backward seconds, parameter counts and
bytes per layer, from ``run.h5``), deepens the model to ``3 x P`` blocks, and replays it under
the four policies with the calibrated event-level simulator (``dynmo_hpc.sim.replay``):

- how a scheme's per-block cost scales with depth: schemes whose pattern is *periodic in the
  block index* (MoD routes every other block; MoE's per-block expert load has no depth trend)
  repeat their measured blocks (``block j`` costs what ``block j mod N`` cost); schemes whose
  pattern follows *relative depth* (freezing front to back, early exit's shrinking token count,
  pruning and sparse attention by layer position) stretch it (``block j`` costs what the block
  at the same relative depth cost). The embedding and the head keep their measured costs;
- ``M = 4 P`` microbatches (``--microbatches-per-stage``), so the fill and drain cost the same
  share at every depth; the report interval, margin and smoothing are the run's; migrations are
  priced at ``--bandwidth-gbps``.

It prints, per run and stage count, the simulated tokens/s of each policy and DynMo's speedups
over static uniform (Megatron-LM) and static by parameters (DeepSpeed), beside the paper's
end-to-end figure for the scheme (DynMo, SC'25, over the better static baseline).

    .venv/bin/python benchmarks/sim_scale.py RUN.h5 [RUN.h5 ...] [--stages 8 16 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from dynmo_hpc.balance import ALGORITHMS
from dynmo_hpc.runlog import load
from dynmo_hpc.sim.replay import CostReport, ReplaySetup, replay
from dynmo_hpc.sim.runlog_traces import traces_from_runlog

SCALE_POLICIES = tuple(ALGORITHMS)
"""The table compares partitioning policies at a fixed stage count (no packing)."""

PAPER_SPEEDUP = {
    "moe": 1.23,
    "pruning": 3.18,
    "freezing": 2.23,
    "sparse_attention": 4.02,
    "early_exit": 4.52,
    "mod": 1.17,
}
"""DynMo's reported end-to-end speedups over static Megatron-LM / DeepSpeed (arXiv 2505.14864)."""

PERIODIC = {"mod", "moe"}
"""Schemes whose per-block cost pattern repeats with the block index rather than with depth."""


def scheme_of(config: dict[str, Any]) -> str:
    """The run's scheme (the one non-null ``schemes`` entry), or ``plain``."""
    on = [name for name, value in (config.get("schemes") or {}).items() if value is not None]
    return on[0] if len(on) == 1 else ("plain" if not on else "+".join(sorted(on)))


def source_blocks(scheme: str, num_blocks: int, new_blocks: int) -> list[int]:
    """For each of ``new_blocks`` blocks, the measured block (0-based) whose costs it takes."""
    if scheme in PERIODIC:
        return [j % num_blocks for j in range(new_blocks)]
    return [min(num_blocks - 1, (j * num_blocks) // new_blocks) for j in range(new_blocks)]


def deepen(report: CostReport, sources: list[int]) -> CostReport:
    """``report`` with its blocks (layers 1..N) replaced by ``sources``' blocks, in order."""

    def pick(values: list[Any]) -> list[Any]:
        blocks = values[1:-1]
        return [values[0], *(blocks[s] for s in sources), values[-1]]

    return CostReport(
        forward_s=pick(report.forward_s),
        backward_s=pick(report.backward_s),
        num_params=pick(report.num_params),
        layer_bytes=pick(report.layer_bytes),
    )


def simulate_run(path: Path, stages: list[int], mb_per_stage: int, bw_gbps: float) -> list[dict]:
    run = load(path)
    traces = traces_from_runlog(run)
    scheme = scheme_of(run.config)
    num_blocks = len(traces.reports[0].forward_s) - 2
    rows = []
    for p in stages:
        sources = source_blocks(scheme, num_blocks, 3 * p)
        reports = [deepen(r, sources) for r in traces.reports]
        setup = ReplaySetup(
            num_stages=p,
            num_microbatches=mb_per_stage * p,
            schedule=traces.schedule,
            interval=traces.interval,
            margin=traces.margin,
            smoothing=traces.smoothing,
            bandwidth_bytes_per_s=bw_gbps * 1e9 / 8,
        )
        tokens = traces.tokens_per_microbatch * setup.num_microbatches
        result = {pol: replay(reports, setup, pol).tokens_per_s(tokens) for pol in SCALE_POLICIES}
        best_static = max(result["uniform"], result["parameters"])
        rows.append(
            {
                "run": str(path),
                "scheme": scheme,
                "stages": p,
                "blocks": 3 * p,
                "microbatches": setup.num_microbatches,
                "tokens_per_s": result,
                "optimal_over_uniform": result["optimal"] / result["uniform"],
                "optimal_over_parameters": result["optimal"] / result["parameters"],
                "diffusion_over_uniform": result["diffusion"] / result["uniform"],
                "diffusion_over_parameters": result["diffusion"] / result["parameters"],
                "optimal_over_best_static": result["optimal"] / best_static,
                "paper": PAPER_SPEEDUP.get(scheme, math.nan),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run logs (run.h5) of scheme jobs")
    parser.add_argument("--stages", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--microbatches-per-stage", type=int, default=4)
    parser.add_argument("--bandwidth-gbps", type=float, default=100.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [
        row
        for path in args.runs
        for row in simulate_run(path, args.stages, args.microbatches_per_stage, args.bandwidth_gbps)
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        "| scheme | P | blocks | M | optimal / uniform | optimal / parameters | "
        "diffusion / uniform | diffusion / parameters | paper (over static) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        paper = "-" if math.isnan(r["paper"]) else f"{r['paper']:.2f}"
        print(
            f"| {r['scheme']} | {r['stages']} | {r['blocks']} | {r['microbatches']} | "
            f"{r['optimal_over_uniform']:.2f} | {r['optimal_over_parameters']:.2f} | "
            f"{r['diffusion_over_uniform']:.2f} | {r['diffusion_over_parameters']:.2f} | {paper} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
