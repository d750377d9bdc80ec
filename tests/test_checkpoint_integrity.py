"""Checkpoint integrity: damaged or incomplete checkpoints are found, the resume falls back to the
previous complete one (and says so), a checkpoint of another model is refused, and a finished
run's directory is never silently reused.

The checkpoints are real: one tiny 2-rank run, stopped by SIGTERM after step 5 with periodic
checkpoints every 2 steps, leaves step_2, step_4 and step_5. Each test damages its own copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_hpc.checkpoint import store
from dynmo_hpc.errors import CheckpointError, LaunchError
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.launch.rundir import claim_run_dir
from dynmo_hpc.runlog import load
from tests.helpers.jobs import ROOT, TINY, read_result, tiny_config

NUM_STEPS = 6
RUN_OVERRIDES = [
    f"train.steps={NUM_STEPS}",
    "pipeline.num_stages=2",
    "checkpoint.every_steps=2",
    "checkpoint.keep=3",
    "checkpoint.at_end=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted reference run and a run stopped after step 5 (checkpoints 2, 4, 5)."""
    out = tmp_path_factory.mktemp("integrity")
    reference = tiny_config(out, *RUN_OVERRIDES, "job.name=reference")
    rc, _ = launch_local(reference, timeout_s=240)
    assert rc == 0
    stopped = tiny_config(
        out,
        *RUN_OVERRIDES,
        "job.name=stopped",
        "fault.inject_step=4",
        "fault.inject_signal=SIGTERM",
    )
    rc, _ = launch_local(stopped, timeout_s=240)
    assert rc == 0
    return {"reference": reference.run_dir, "stopped": stopped.run_dir, "out": out}


@pytest.fixture
def stopped(runs, tmp_path) -> Path:
    """A private copy of the stopped run's directory, under the same job name."""
    copy = tmp_path / "stopped"
    shutil.copytree(runs["stopped"], copy)
    return copy


def _dynmo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynmo_hpc", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "DYNMO_LOG_LEVEL": "WARNING"},
    )


def _sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _layer_file(step_dir: Path) -> Path:
    return sorted(step_dir.glob("layer_*.pt"))[-1]


@pytest.mark.mpi
def test_the_stopped_run_left_three_complete_checkpoints(stopped):
    root = stopped / "checkpoint"
    assert [c.step for c in store.scan(root)] == [5, 4, 2]
    assert all(c.problem is None for c in store.scan(root))
    assert (root / "latest").read_text().strip() == "step_5"
    manifest = json.loads((root / "step_5" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"run_state.json"} | {store.layer_name(i) for i in range(6)}


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncate", r"has \d+ bytes, the manifest says \d+"),
        ("bitflip", r"fails its CRC-32 check"),
        ("no_manifest", r"no manifest.json"),
        ("missing_file", r"layer_0005.pt is missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_detected_and_skipped(stopped, damage, problem):
    newest = stopped / "checkpoint" / "step_5"
    target = _layer_file(newest)
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        target.unlink()
    found = store.verify(newest)
    assert found is not None and re.search(problem, found), found
    chosen, skipped = store.resolve(stopped)
    assert chosen.step == 4
    assert [c.step for c in skipped] == [5] and skipped[0].problem == found
    with pytest.raises(CheckpointError, match="cannot be resumed from"):
        store.resolve(newest)  # named explicitly: refused, with a hint


@pytest.mark.mpi
def test_nothing_intact_is_a_clear_error(stopped):
    for step_dir in (stopped / "checkpoint").glob("step_*"):
        (step_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*HINT"):
        store.resolve(stopped)


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_falls_back_and_matches_the_uninterrupted_run(runs, stopped):
    """Corrupt step_5; ``dynmo-hpc run --resume`` warns, resumes from step_4, logs the skip,
    and still ends bitwise where the uninterrupted run ended."""
    data = bytearray(_layer_file(stopped / "checkpoint" / "step_5").read_bytes())
    data[100] ^= 0x01
    _layer_file(stopped / "checkpoint" / "step_5").write_bytes(bytes(data))
    sets = _sets(*TINY, *RUN_OVERRIDES, f"job.out_dir={stopped.parent}", "job.name=stopped")
    out = _dynmo("run", "jobs/default.yaml", *sets, "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: skipping checkpoint" in out.stderr and "CRC-32" in out.stderr
    assert "resuming from" in out.stdout and "step_4" in out.stdout
    want = read_result(runs["reference"])["losses"]
    got = read_result(stopped)["losses"]
    assert got == want
    run = load(stopped / "run.h5")
    skipped = run.events[run.events["kind"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and "CRC-32" in skipped["detail"].iloc[0]["problem"]
    assert run.restarts["checkpoint_step"].tolist() == [4]
    assert run.superseded["steps"]["step"].tolist() == [4]  # step 4 ran before the stop


@pytest.mark.mpi
def test_a_checkpoint_of_another_model_is_refused(stopped):
    sets = _sets(*TINY, *RUN_OVERRIDES, f"job.out_dir={stopped.parent}", "job.name=stopped")
    out = _dynmo("run", "jobs/default.yaml", *sets, "--set", "model.d_model=64", "--resume")
    assert out.returncode == 2
    assert out.stderr.startswith("error: checkpoint") and "does not fit this job" in out.stderr
    assert "model.d_model (checkpoint 32, job 64)" in out.stderr and "HINT" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.mpi
def test_a_scheme_change_is_refused_naming_the_keys(stopped):
    sets = _sets(*TINY, *RUN_OVERRIDES, f"job.out_dir={stopped.parent}", "job.name=stopped")
    out = _dynmo("run", "jobs/default.yaml", *sets, "--set", "schemes.mod.capacity=0.5", "--resume")
    assert out.returncode == 2 and "schemes.mod" in out.stderr, out.stderr


@pytest.mark.mpi
def test_a_new_run_never_silently_replaces_an_old_one(stopped):
    sets = _sets(*TINY, *RUN_OVERRIDES, f"job.out_dir={stopped.parent}", "job.name=stopped")
    before = (stopped / "run.h5").read_bytes()
    out = _dynmo("run", "jobs/default.yaml", *sets)
    assert out.returncode == 2
    assert "already holds a run" in out.stderr and "--resume" in out.stderr
    assert "--overwrite" in out.stderr
    assert (stopped / "run.h5").read_bytes() == before


def test_resume_with_no_checkpoint_is_a_clear_error(tmp_path):
    sets = _sets(*TINY, f"job.out_dir={tmp_path}", "job.name=fresh")
    out = _dynmo("run", "jobs/default.yaml", *sets, "--resume")
    assert out.returncode == 2 and "no intact checkpoint" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_overwrite_clears_the_earlier_run(tmp_path):
    run_dir = tmp_path / "job"
    (run_dir / "checkpoint" / "step_2").mkdir(parents=True)
    (run_dir / "run.h5").write_bytes(b"old")
    (run_dir / "result.json").write_text("{}")
    with pytest.raises(LaunchError, match="already holds a run"):
        claim_run_dir(run_dir, overwrite=False)
    claim_run_dir(run_dir, overwrite=True)
    assert sorted(p.name for p in run_dir.iterdir()) == []


def test_prune_keeps_the_newest_complete_and_drops_stale_incomplete(tmp_path):
    root = tmp_path / "checkpoint"
    for step in (1, 2, 3, 4):
        (root / f"step_{step}").mkdir(parents=True)
        entry = store.write_run_state(root / f"step_{step}", {"step": step})
        if step != 2:  # step_2 is a crash leftover: no manifest
            store.commit(root, step, {store.RUN_STATE: entry}, keep=2)
    (root / "step_5").mkdir()  # a save in progress, newer than every complete one: kept
    store.prune(root, keep=2)
    names = ["latest", "lineage.json", "step_3", "step_4", "step_5"]  # lineage.json: the branch
    assert sorted(p.name for p in root.iterdir()) == names
    assert (root / "latest").read_text().strip() == "step_4"


@pytest.mark.mpi
def test_time_based_checkpoints(tmp_path):
    """``checkpoint.every_minutes`` alone (rank 0's clock, agreed at the step boundary)."""
    cfg = tiny_config(
        tmp_path,
        "train.steps=3",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=0.00001",
        "checkpoint.keep=5",
        "job.name=minutes",
    )
    rc, run_dir = launch_local(cfg, timeout_s=240)
    assert rc == 0
    steps = [c.step for c in store.scan(run_dir / "checkpoint") if c.problem is None]
    assert steps == [2, 1]  # after steps 1 and 2; none after the last (checkpoint.at_end=false)
    events = load(run_dir / "run.h5").events
    written = events[events["kind"] == "checkpoint"]["detail"].tolist()
    assert [d["step"] for d in written] == [1, 2]
    assert all(d["seconds"] > 0 and d["bytes"] > 0 for d in written)
