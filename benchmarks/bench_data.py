"""Data and precision figures: prepare-data throughput and peak memory, the step-time overhead of
memory-mapped shards, and bf16 against fp32 step time on this machine's CPU.

- ``prepare``: generates a corpus of ``--mb`` MB (CPython's documentation topics, each copy in a
  fresh random order, so the text does not repeat in one block), then runs ``dynmo-hpc
  prepare-data`` on it in a child process, once training a BPE tokenizer and once with that
  tokenizer given (encoding only); reports MB/s and the child's peak RSS. Run it at two sizes:
  a peak that does not grow with the corpus is the streaming claim.
- ``mmap``: batches from a prepared directory (memory-mapped shards) against the same tokens held
  in memory; the overhead is the per-step difference in batch-building time over the step time
  of the single-process reference on the same job (``jobs/default.yaml``'s model).
- ``precision``: the single-process reference's step time in fp32 and bf16, the arms alternated
  ``--repeats`` times (A/B/A/B...), the first step of each arm dropped (warm-up).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_data.py prepare --mb 120
    PYTHONPATH=. .venv/bin/python benchmarks/bench_data.py mmap --steps 3
    PYTHONPATH=. .venv/bin/python benchmarks/bench_data.py precision --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write about ``megabytes`` MB of shuffled documentation text; returns its bytes."""
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 1e6:
            rng.shuffle(docs)
            block = "\n\n".join(docs) + "\n\n"
            out.write(block)
            written += len(block.encode("utf-8"))
    return written


_MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
    "capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
"""A fresh wrapper per child, so its children's peak RSS is that one child's."""


def _run_child(argv: list[str]) -> tuple[float, float]:
    """(wall s, peak RSS MB) of a child process running ``argv``."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, *argv], check=True, capture_output=True, text=True
    )
    wall_s = time.perf_counter() - t0
    return wall_s, int(done.stdout.split()[-1]) / 1024


def bench_prepare(megabytes: float, vocab_size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        tmp = Path(d)
        text = tmp / "corpus.txt"
        num_bytes = _corpus(text, megabytes)
        cli = [sys.executable, "-m", "dynmo_hpc", "prepare-data", str(text)]
        train_s, train_rss = _run_child(
            [*cli, "--out", str(tmp / "a"), "--train-tokenizer", "--vocab-size", str(vocab_size)]
        )
        encode_s, encode_rss = _run_child(
            [*cli, "--out", str(tmp / "b"), "--tokenizer", str(tmp / "a" / "tokenizer.json")]
        )
        meta = json.loads((tmp / "b" / "meta.json").read_text())
    mb = num_bytes / 1e6
    return {
        "corpus_mb": round(mb, 1),
        "tokens": meta["num_tokens"]["train"] + meta["num_tokens"]["val"],
        "train_and_encode_s": round(train_s, 1),
        "train_and_encode_mb_per_s": round(mb / train_s, 2),
        "train_and_encode_peak_rss_mb": round(train_rss),
        "encode_s": round(encode_s, 1),
        "encode_mb_per_s": round(mb / encode_s, 2),
        "encode_peak_rss_mb": round(encode_rss),
    }


def _reference_step_s(overrides: list[str], steps: int) -> list[float]:
    from dynmo_hpc import config as config_mod
    from dynmo_hpc.testing.reference import train_reference

    cfg = config_mod.load(
        ROOT / "jobs/default.yaml",
        ["job.out_dir=/tmp/bench_data", "runtime.device=cpu", *overrides],
    )
    return train_reference(cfg, steps=steps).step_time_s[1:]


def bench_mmap(num_batches: int, steps: int) -> dict[str, float]:
    from dynmo_hpc import config as config_mod
    from dynmo_hpc.data.batches import TextDataset
    from dynmo_hpc.data.corpus import default_corpus_text
    from dynmo_hpc.data.prepare import TokenizerChoice, prepare

    with tempfile.TemporaryDirectory() as d:
        text = Path(d) / "docs.txt"
        text.write_text(default_corpus_text(), encoding="utf-8")
        prepare([text], Path(d) / "prep", TokenizerChoice(vocab_size=2048), shard_tokens=50_000)
        cfg = config_mod.load(
            ROOT / "jobs/default.yaml", [f"data.path={Path(d) / 'prep'}", "job.out_dir=/tmp/b"]
        )
        mapped = TextDataset.for_job(cfg)
        in_memory = dataclasses.replace(
            mapped,
            train=np.array(mapped.train[0 : len(mapped.train)]),
            val=np.array(mapped.val[0 : len(mapped.val)]),
        )
        b = cfg.train.micro_batch_size
        times: dict[str, list[float]] = {"mmap": [], "memory": []}
        for rep in range(5):  # alternate the arms
            for name, ds in (("mmap", mapped), ("memory", in_memory)):
                t0 = time.perf_counter()
                for i in range(num_batches):
                    ds.batch(cfg.job.seed, rep, i, b)
                times[name].append((time.perf_counter() - t0) / num_batches)
        overrides = [f"data.path={Path(d) / 'prep'}"]
        step_s = float(np.median(_reference_step_s(overrides, steps + 1)))
    per_step = cfg.train.num_microbatches
    mmap_s = float(np.median(times["mmap"]))
    memory_s = float(np.median(times["memory"]))
    return {
        "batch_us_mmap": round(mmap_s * 1e6, 1),
        "batch_us_memory": round(memory_s * 1e6, 1),
        "batch_us_spread_mmap": round((max(times["mmap"]) - min(times["mmap"])) * 1e6, 1),
        "step_s": round(step_s, 3),
        "overhead_percent": round(100 * per_step * (mmap_s - memory_s) / step_s, 3),
    }


def bench_precision(repeats: int, steps: int) -> dict[str, object]:
    runs: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(repeats):
        for precision in ("fp32", "bf16"):
            step_s = _reference_step_s([f"train.precision={precision}"], steps + 1)
            runs[precision].append(float(np.median(step_s)))
    out: dict[str, object] = {}
    for precision, medians in runs.items():
        out[f"{precision}_step_s_median"] = round(float(np.median(medians)), 3)
        out[f"{precision}_step_s_range"] = [round(min(medians), 3), round(max(medians), 3)]
    fp32 = float(np.median(runs["fp32"]))
    out["bf16_over_fp32"] = round(float(np.median(runs["bf16"])) / fp32, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--mb", type=float, default=120.0)
    p.add_argument("--vocab-size", type=int, default=8192)
    m = sub.add_parser("mmap")
    m.add_argument("--batches", type=int, default=400)
    m.add_argument("--steps", type=int, default=3, help="reference steps timed after a warm-up")
    r = sub.add_parser("precision")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    for key in ("mb", "vocab_size", "batches", "repeats", "steps"):
        if getattr(args, key, 1) <= 0:
            raise SystemExit(f"error: --{key.replace('_', '-')} must be positive")
    if getattr(args, "vocab_size", 256) < 256:
        raise SystemExit("error: --vocab-size must be at least 256 (the byte alphabet)")
    if args.what == "prepare":
        result: dict[str, object] = dict(bench_prepare(args.mb, args.vocab_size))
    elif args.what == "mmap":
        result = dict(bench_mmap(args.batches, args.steps))
    else:
        result = bench_precision(args.repeats, args.steps)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
