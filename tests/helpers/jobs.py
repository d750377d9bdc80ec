"""Run a real multi-rank job from a test: the launcher in a subprocess, with a timeout.

Each rank writes its results to the run directory (result.json on rank 0, the run log, the
checkpoint); the test asserts on those files. A hung job is killed by the launcher's timeout
and fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.launch.local import launch_local

ROOT = Path(__file__).resolve().parents[2]

# A model small enough that 4 ranks on 2 cores finish a few steps in seconds.
TINY = [
    "model.num_blocks=4",
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.num_microbatches=4",
    "train.steps=4",
    "train.log_interval=1",
    "checkpoint.at_end=false",
    "checkpoint.every_steps=0",
    "balance.interval=2",
    "balance.algorithm=static",
    "runtime.device=cpu",  # the CPU tiers stay on the CPU even with a CUDA build of torch
]


def tiny_config(
    tmp_path: Path, *overrides: str, job: str = "jobs/default.yaml"
) -> config_mod.JobConfig:
    return config_mod.load(ROOT / job, [*TINY, f"job.out_dir={tmp_path}", *overrides])


def run_job(cfg: config_mod.JobConfig, timeout_s: float = 180.0) -> dict[str, Any]:
    """Launch ``cfg`` on ``pipeline.num_stages`` local ranks; returns rank 0's result.json."""
    rc, run_dir = launch_local(cfg, timeout_s=timeout_s)
    assert rc == 0, f"job {cfg.job.name} failed with exit code {rc}"
    return read_result(run_dir)


def read_result(run_dir: Path) -> dict[str, Any]:
    """Rank 0's ``result.json`` of the run in ``run_dir`` (losses, tokens/s, partitions)."""
    return json.loads((run_dir / "result.json").read_text())


def assert_losses_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: pipeline {g!r} vs reference {w!r}"


def prepare_small_corpus(root: Path, vocab_size: int = 512) -> Path:
    """``dynmo-hpc prepare-data`` on 120 of CPython's pydoc topics (about 0.5 MB) with a
    byte-level BPE of ``vocab_size`` trained on them; returns the prepared directory."""
    from pydoc_data.topics import topics

    from dynmo_hpc.cli import main

    text = root / "corpus.txt"
    text.write_text("\n\n".join(topics[k] for k in sorted(topics)[:120]), encoding="utf-8")
    out = root / "prepared"
    argv = ["prepare-data", str(text), "--out", str(out), "--train-tokenizer"]
    if main([*argv, "--vocab-size", str(vocab_size)]) != 0:
        raise RuntimeError(f"prepare-data failed on {text}")
    return out
