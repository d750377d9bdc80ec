"""Per scheme: a short real training on 2 ranks, and the cheapest / dearest block cost it measured.

For each scheme it trains ``jobs/stress/<scheme>.yaml`` on 2 local MPI ranks (``baseline``: the
plain model of jobs/default.yaml; ``sparse_attention_dense``: the long-sequence model of
jobs/stress/sparse_attention.yaml with dense attention), reads the run log
(``runs/<job>/run.h5``) and prints, at the first and the last load report,
the cheapest and the dearest block (layers 1..N) by cost = forward_s + backward_s (thread CPU
seconds per step, as the profiler measures them), the spread (dearest / cheapest), and the
total block cost relative to the start. That is the imbalance DynMo has to correct.

``--kernels`` instead measures what pruning would gain from torch's sparse kernels: the
feed-forward matmuls of the default model (1024 tokens x 128 -> 512 and 512 -> 128) as dense,
CSR and COO at the sparsities the schedule reaches, against the dense matmul of the structurally
shrunk matrix (what ``schemes/pruning.py`` does). The numbers are in docs/schemes.md.

    .venv/bin/python benchmarks/bench_schemes.py [--schemes baseline moe ...] [--steps 60]
    .venv/bin/python benchmarks/bench_schemes.py --kernels
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from dynmo_hpc import config as config_mod
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load

ROOT = Path(__file__).resolve().parent.parent

SCHEMES = ["moe", "pruning", "freezing", "sparse_attention", "early_exit", "mod"]
BASELINES = {
    "baseline": ("default.yaml", []),
    # The long-sequence model of jobs/stress/sparse_attention.yaml with dense attention.
    "sparse_attention_dense": ("stress/sparse_attention.yaml", ["schemes.sparse_attention=null"]),
}


# ------------------------------------------------------------------------------------ runs
def run_scheme(
    scheme: str, out_dir: Path, steps: int | None, overrides: list[str], tag: str = ""
) -> dict:
    """Train one job on 2 ranks; returns the block-cost summary from its run log."""
    job_file, extra = BASELINES.get(scheme, (f"stress/{scheme}.yaml", []))
    job = ROOT / "jobs" / job_file
    sets = [
        *extra,
        f"job.name=bench_{scheme}{tag}",
        f"job.out_dir={out_dir}",
        "pipeline.num_stages=2",
        "checkpoint.at_end=false",
        "checkpoint.every_steps=0",
        "train.log_interval=1000",
    ]
    if steps is not None:
        # This script reads block costs, not the steady state; a shortened run may end before
        # the job's declared steady_state_step, which the config would refuse.
        sets += [f"train.steps={steps}", "train.steady_state_step=null"]
    cfg = config_mod.load(job, [*sets, *overrides])
    rc, run_dir = launch_local(cfg)
    if rc != 0:
        raise SystemExit(f"{scheme}: training failed with exit code {rc} ({run_dir})")
    result = json.loads((run_dir / "result.json").read_text())
    log = load(run_dir / "run.h5")
    costs = log.layer_costs.copy()
    costs["cost_s"] = costs["forward_s"] + costs["backward_s"]
    blocks = costs[(costs["layer"] >= 1) & (costs["layer"] <= cfg.model.num_blocks)]
    steps_reported = sorted(blocks["step"].unique())
    if not steps_reported:
        raise SystemExit(
            f"bench_schemes: {scheme} ran {cfg.train.steps} steps and made no load report "
            f"(balance.interval={cfg.balance.interval}); HINT: use --steps "
            f"{cfg.balance.interval} or more"
        )
    summary: dict = {"scheme": scheme, "final_loss": result["final_loss"]}
    for label, step in (("start", steps_reported[0]), ("end", steps_reported[-1])):
        rows = blocks[blocks["step"] == step].set_index("layer")["cost_s"]
        summary[label] = {
            "step": int(step),
            "cheapest_layer": int(rows.idxmin()),
            "cheapest_s": float(rows.min()),
            "dearest_layer": int(rows.idxmax()),
            "dearest_s": float(rows.max()),
            "total_s": float(rows.sum()),
        }
    summary["median_tokens_per_s"] = result["median_tokens_per_s"]
    tps = log.steps["tokens_per_s"]
    summary["late_tokens_per_s"] = float(tps.iloc[len(tps) // 2 :].median())
    summary["num_migrations"] = int((log.events["kind"] == "migrate").sum())
    return summary


def print_static_vs_dynmo(pairs: list[tuple[dict, dict]]) -> None:
    """Per scheme: block costs at start/end (DynMo run) and tokens/s, static vs DynMo."""
    print(
        f"{'scheme':<23}{'cheapest start':>15}{'dearest start':>14}{'cheapest end':>13}"
        f"{'dearest end':>12}{'static tok/s':>13}{'dynmo tok/s':>12}{'ratio':>7}{'moves':>6}"
    )
    for static, dyn in pairs:
        a, b = dyn["start"], dyn["end"]
        print(
            f"{dyn['scheme']:<23}{1e3 * a['cheapest_s']:>12.0f} ms{1e3 * a['dearest_s']:>11.0f} ms"
            f"{1e3 * b['cheapest_s']:>10.0f} ms{1e3 * b['dearest_s']:>9.0f} ms"
            f"{static['late_tokens_per_s']:>13.0f}{dyn['late_tokens_per_s']:>12.0f}"
            f"{dyn['late_tokens_per_s'] / static['late_tokens_per_s']:>7.2f}"
            f"{dyn['num_migrations']:>6}"
        )
    print("(costs: thread CPU ms per step of one block; tok/s: median over the 2nd half)")


def print_runs(summaries: list[dict]) -> None:
    print(
        f"{'scheme':<23} {'at':<6}{'step':>5}  {'cheapest block':>18}  {'dearest block':>18}  "
        f"{'spread':>6}  {'blocks total':>12}"
    )
    for s in summaries:
        for label in ("start", "end"):
            r = s[label]
            rel = r["total_s"] / s["start"]["total_s"]
            print(
                f"{s['scheme'] if label == 'start' else '':<23} {label:<6}{r['step']:>5}  "
                f"L{r['cheapest_layer']:<2} {1e3 * r['cheapest_s']:>9.1f} ms    "
                f"L{r['dearest_layer']:<2} {1e3 * r['dearest_s']:>9.1f} ms    "
                f"{r['dearest_s'] / r['cheapest_s']:>5.2f}x  {rel:>11.2f}x"
            )
        print(
            f"{'':<23} final loss {s['final_loss']:.4f}, "
            f"median {s['median_tokens_per_s']:.0f} tokens/s"
        )


# ------------------------------------------------------------------------------------ kernels
def _time_s(stmt: str, env: dict) -> float:
    """Fastest block of repeated runs: on a shared machine, the least disturbed estimate."""
    timer = benchmark.Timer(stmt=stmt, globals=env, num_threads=1)
    return min(timer.blocked_autorange(min_run_time=0.5).times)


def bench_kernels(sparsities: list[float]) -> None:
    """Dense vs CSR vs COO vs structurally shrunk matmul, for both feed-forward shapes."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    num_tokens = 8 * 128  # rows per matmul: 8 sequences of 128 bytes
    print(f"torch {torch.__version__}, 1 thread, x: ({num_tokens}, in), y = x @ W.T")
    print(
        f"{'W (out, in)':<12} {'sparsity':>8} {'dense':>9} {'CSR':>9} {'COO':>9} "
        f"{'shrunk':>9}  {'CSR/dense':>9} {'shrunk/dense':>12}"
    )
    for out_f, in_f in ((512, 128), (128, 512)):
        x = torch.randn(num_tokens, in_f, generator=gen)
        w = torch.randn(out_f, in_f, generator=gen)
        for s in sparsities:
            mask = torch.rand(out_f, in_f, generator=gen) >= s  # unstructured, magnitude-like
            w_s = w * mask
            # Structured: the same fraction of whole neurons removed (rows of c_fc / columns of
            # c_proj), i.e. the matrix the pruning scheme leaves behind.
            if out_f > in_f:
                w_shrunk = w[: max(1, round(out_f * (1 - s)))].contiguous()
                x_shrunk = x
            else:
                keep = max(1, round(in_f * (1 - s)))
                w_shrunk, x_shrunk = w[:, :keep].contiguous(), x[:, :keep].contiguous()
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            env = {
                "F": F,
                "torch": torch,
                "x": x,
                "xt": x.t().contiguous(),
                "w": w_s,
                "w_csr": w_s.to_sparse_csr(),
                "w_coo": w_s.to_sparse().coalesce(),
                "w_shrunk": w_shrunk,
                "x_shrunk": x_shrunk,
            }
            dense = _time_s("F.linear(x, w)", env)
            csr = _time_s("torch.sparse.mm(w_csr, xt)", env)
            coo = _time_s("torch.sparse.mm(w_coo, xt)", env)
            shrunk = _time_s("F.linear(x_shrunk, w_shrunk)", env)
            print(
                f"({out_f}, {in_f}){'':<2} {s:>8.2f} {1e3 * dense:>7.3f}ms {1e3 * csr:>7.3f}ms "
                f"{1e3 * coo:>7.3f}ms {1e3 * shrunk:>7.3f}ms  {csr / dense:>9.2f} "
                f"{shrunk / dense:>12.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--schemes", nargs="*", default=[*SCHEMES[:3], "sparse_attention_dense", *SCHEMES[3:]]
    )
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: temp)")
    parser.add_argument("--kernels", action="store_true", help="sparse vs dense matmul only")
    parser.add_argument(
        "--compare-static",
        action="store_true",
        help="per scheme, also train with balance.algorithm=static, back to back, and compare",
    )
    parser.add_argument("--sparsities", type=float, nargs="*", default=[0.0, 0.5, 0.75, 0.9, 0.95])
    args = parser.parse_args()
    if args.kernels:
        bench_kernels(args.sparsities)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or Path(tmp)
        summaries = []
        pairs = []
        for scheme in args.schemes:
            if args.compare_static:
                static_sets = [*args.overrides, "balance.algorithm=static"]
                static = run_scheme(scheme, out_dir, args.steps, static_sets, tag="_static")
                dyn = run_scheme(scheme, out_dir, args.steps, args.overrides)
                pairs.append((static, dyn))
                summaries.append(dyn)
            else:
                summaries.append(run_scheme(scheme, out_dir, args.steps, args.overrides))
            print(f"done: {scheme}", flush=True)
        print_runs(summaries)
        if pairs:
            print()
            print_static_vs_dynmo(pairs)


if __name__ == "__main__":
    main()
