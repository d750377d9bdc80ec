"""A user's path from text to a trained Llama, through the commands they type.

``dynmo-hpc prepare-data`` tokenizes a text file (a byte-level BPE trained on it); the shipped
``jobs/llama.yaml`` switches to that directory with ``--set data.path`` alone and trains in bf16
on 2 pipeline stages with validation every few steps, its layers rebalanced while it trains;
the run log holds the validation losses, and ``dynmo-hpc report`` plots them beside the
training loss. (Bitwise bf16 resume after a SIGKILL: ``tests/test_resume.py``'s bf16 case.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dynmo_hpc.cli import main
from dynmo_hpc.runlog import load
from tests.helpers.jobs import ROOT, prepare_small_corpus

TINY_LLAMA = [
    "model.num_blocks=4",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.num_microbatches=4",
    "train.steps=8",
    "train.log_interval=1",
    "balance.interval=2",
    "balance.force_moves=true",
    "checkpoint.every_steps=0",
]


@pytest.mark.mpi
def test_prepared_text_trains_a_llama_in_bf16_with_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = prepare_small_corpus(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["vocab_size"] <= 512 and meta["num_tokens"]["val"] > 0

    sets = [*TINY_LLAMA, f"data.path={data}", "train.precision=bf16"]
    sets += ["train.eval_interval=3", "train.eval_windows=4", f"job.out_dir={tmp_path / 'runs'}"]
    argv = ["run", str(ROOT / "jobs" / "llama.yaml"), "--report"]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 0
    run_dir = tmp_path / "runs" / "llama"
    log = load(run_dir / "run.h5")
    assert log.config["model"]["arch"] == "llama"
    assert log.config["model"]["vocab_size"] == meta["vocab_size"]  # the data's, no model key
    assert log.config["train"]["precision"] == "bf16"
    assert log.steps["num_stages"].eq(2).all()
    assert len(log.events.query("kind == 'migrate'")) >= 1
    evals = log.eval.sort_values("step")
    assert evals["step"].tolist() == [2, 5, 7]  # after every 3 steps, and after the last
    assert all(math.isfinite(v) and v < math.log(meta["vocab_size"]) + 1 for v in evals["loss"])
    assert (run_dir / "report" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (run_dir / "report" / "summary.txt").read_text().lower()
    assert "validation" in summary
