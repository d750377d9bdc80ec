"""The SLURM manager's error paths, without a cluster: fake ``srun`` and ``scontrol`` on PATH.

The manager (``python -m dynmo_hpc.slurm.manager``) runs as a subprocess in a faked allocation
(SLURM_* variables for 4 nodes). The fake ``srun`` plays the MPI step: per call it follows a
plan (``pack``: ask for a resize to 2 stages; ``finish``: write result.json; ``no_rank``: fail
before any rank starts) and records its argv; the fake ``scontrol`` records its calls and can
refuse a shrink or send the manager SIGUSR2 while it shrinks. Each test below failed on the main
branch before the error paths were handled (the manager exited 2 on a refused shrink, died of
SIGUSR2 between steps, never retried a relaunch, and never released surplus nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dynmo_hpc.handoff.failures import (
    FAILURE_PENDING,
    add_pending_event,
    event_kind,
    take_pending_failures,
)
from dynmo_hpc.handoff.resize import unshrunk_config
from dynmo_hpc.launch.supervisor import StepResult
from dynmo_hpc.slurm.manager import retry_relaunch
from dynmo_hpc.slurm.resize import nodes_after_release
from tests.helpers.jobs import ROOT, run_job, tiny_config

FAKE_SRUN = """
import json, os, pathlib, sys, time
log = pathlib.Path(os.environ["FAKE_SLURM_LOG"])
plan = json.loads(os.environ["FAKE_SRUN_PLAN"])
done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
n = sum(1 for call in done if call[0] == "srun")
with log.open("a") as f:
    f.write(json.dumps(["srun", *sys.argv[1:]]) + "\\n")
action = plan[min(n, len(plan) - 1)]
run_dir = pathlib.Path(next(a for a in sys.argv if a.endswith("config.yaml"))).parent
if action == "crash_in_checkpoint":  # a rank killed while writing the pack's checkpoint
    partial = run_dir / "checkpoint" / "step_6"
    partial.mkdir(parents=True)
    (partial / "stage_0.pt").write_bytes(b"half a checkpoint")
    (run_dir / "ranks").mkdir(exist_ok=True)
    (run_dir / "ranks" / "rank_1.json").write_text(json.dumps(
        {"rank": 1, "pid": os.getpid(), "attempt": 0, "phase": "checkpoint", "step": 5}))
    print("srun: error: node2: task 1: Killed", file=sys.stderr)
    sys.exit(137)
if action == "no_rank":
    print("srun: error: Unable to create step for job: Requested node configuration is not "
          "available", file=sys.stderr)
    sys.exit(1)
(run_dir / "ranks").mkdir(exist_ok=True)
(run_dir / "ranks" / "rank_0.json").write_text(json.dumps(
    {"rank": 0, "pid": os.getpid(), "attempt": 0, "phase": "step", "step": 3}))
if action == "pack":
    (run_dir / "resize_request.json").write_text(json.dumps({
        "num_stages": 2, "parts": [0, 3, 6], "step": 4,
        "checkpoint": str(run_dir / "checkpoint" / "step_4"), "requested_unix_s": time.time()}))
else:
    (run_dir / "result.json").write_text(json.dumps({"losses": []}))
"""

FAKE_SCONTROL = """
import json, os, pathlib, signal, sys
with pathlib.Path(os.environ["FAKE_SLURM_LOG"]).open("a") as f:
    f.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
mode = os.environ.get("FAKE_SCONTROL", "")
if sys.argv[1] == "update" and mode == "refuse":
    print("slurm_update error: Requested operation is presently disabled", file=sys.stderr)
    sys.exit(1)
if sys.argv[1] == "update" and mode == "signal":
    os.kill(os.getppid(), signal.SIGUSR2)
"""


def _shim(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)


def run_fake_manager(
    tmp_path: Path,
    plan: list[str],
    *overrides: str,
    scontrol: str = "",
    restart_count: int = 0,
    checkpoints: Path | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[list[str]], Path]:
    """The manager in a faked 4-node allocation; (its process, the fake calls, the run dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _shim(bin_dir, "srun", FAKE_SRUN)
    _shim(bin_dir, "scontrol", FAKE_SCONTROL)
    cfg = tiny_config(tmp_path, "job.name=fake", "pipeline.num_stages=4", *overrides)
    cfg.run_dir.mkdir(parents=True)
    if checkpoints is not None:
        shutil.copytree(checkpoints, cfg.run_dir / "checkpoint")
    config_path = cfg.run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    calls_log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHONPATH=str(ROOT),
        FAKE_SLURM_LOG=str(calls_log),
        FAKE_SRUN_PLAN=json.dumps(plan),
        FAKE_SCONTROL=scontrol,
        DYNMO_MPI_LAUNCHER="srun",
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="node[1-4]",
        SLURM_NODELIST="node[1-4]",
        SLURM_JOB_NUM_NODES="4",
        SLURM_NNODES="4",
        SLURM_NTASKS="4",
        SLURM_TASKS_PER_NODE="1(x4)",
        SLURM_JOB_CPUS_PER_NODE="2(x4)",
        SLURMD_NODENAME="node1",
        SLURM_RESTART_COUNT=str(restart_count),
    )
    out = subprocess.run(
        [sys.executable, "-m", "dynmo_hpc.slurm.manager", str(config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    calls = [json.loads(line) for line in calls_log.read_text().splitlines()]
    return out, calls, cfg.run_dir


def _srun_calls(calls: list[list[str]]) -> list[list[str]]:
    return [call for call in calls if call[0] == "srun"]


def _option(call: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in call if a.startswith(f"--{name}=")), None)


def test_a_refused_shrink_continues_at_the_current_size(tmp_path: Path) -> None:
    out, calls, run_dir = run_fake_manager(
        tmp_path, ["pack", "finish"], "elastic.enabled=true", scontrol="refuse"
    )
    context = f"rc {out.returncode}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, context
    first, second = _srun_calls(calls)
    assert _option(first, "ntasks") == "4" and _option(second, "ntasks") == "4", calls
    assert second[second.index("--resume") + 1] == str(run_dir / "checkpoint" / "step_4")
    assert "shrink to 2 stages was refused" in out.stderr, context
    resumed = (run_dir / "config.yaml").read_text()
    assert "num_stages: 4" in resumed and "enabled: false" in resumed, resumed
    (record,) = take_pending_failures(run_dir)
    kind, detail = event_kind(record)
    assert kind == "shrink_refused", record
    assert (detail["from_stages"], detail["to_stages"], detail["step"]) == (4, 2, 3), detail
    assert "presently disabled" in detail["message"], detail


def test_a_relaunch_that_starts_no_rank_is_retried_once(tmp_path: Path) -> None:
    out, calls, _ = run_fake_manager(
        tmp_path, ["pack", "no_rank", "finish"], "elastic.enabled=true"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_srun_calls(calls)) == 3, calls
    assert "started no rank" in out.stderr and "relaunching it once" in out.stderr


def test_a_relaunch_that_starts_no_rank_twice_fails_clearly(tmp_path: Path) -> None:
    out, calls, _ = run_fake_manager(tmp_path, ["pack", "no_rank"], "elastic.enabled=true")
    assert out.returncode != 0
    assert len(_srun_calls(calls)) == 3, calls  # the step, the relaunch, one retry
    assert "started no rank twice" in out.stderr, out.stderr[-3000:]


def test_a_first_launch_that_starts_no_rank_is_not_retried(tmp_path: Path) -> None:
    out, calls, _ = run_fake_manager(tmp_path, ["no_rank", "finish"])
    assert out.returncode != 0
    assert len(_srun_calls(calls)) == 1, calls


def test_sigusr2_during_the_shrink_requeues_instead_of_killing_the_manager(
    tmp_path: Path,
) -> None:
    out, calls, _ = run_fake_manager(
        tmp_path, ["pack", "finish"], "elastic.enabled=true", scontrol="signal"
    )
    context = f"rc {out.returncode}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, context  # the fake `scontrol requeue` accepts
    assert len(_srun_calls(calls)) == 1, calls  # no step starts after the signal
    assert ["scontrol", "requeue", "77"] in calls, calls
    assert f"received signal {int(signal.SIGUSR2)} between MPI steps" in out.stderr, context


def test_a_requeued_packed_job_releases_the_nodes_it_does_not_need(tmp_path: Path) -> None:
    out, calls, _ = run_fake_manager(tmp_path, ["finish"], "pipeline.num_stages=2", restart_count=1)
    assert out.returncode == 0, out.stderr[-3000:]
    updates = [call for call in calls if call[:2] == ["scontrol", "update"]]
    assert updates == [["scontrol", "update", "JobId=77", "NodeList=node1,node2"]], calls
    (step,) = _srun_calls(calls)
    assert calls.index(updates[0]) < calls.index(step)
    assert "shrunk to node1,node2 (4 -> 2 nodes)" in out.stderr


def test_a_first_run_on_the_nodes_it_needs_releases_nothing(tmp_path: Path) -> None:
    out, calls, _ = run_fake_manager(tmp_path, ["finish"], restart_count=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [call for call in calls if call[:2] == ["scontrol", "update"]], calls


def test_a_crash_during_the_pack_checkpoint_restarts_from_the_last_complete_one(
    tmp_path: Path,
) -> None:
    """A requeued job continues from step_4 and dies while writing checkpoint step_6 (no
    manifest): the manager's restart resumes from step_4 again, the newest complete checkpoint
    of the run's lineage, never from the partial one. (A first run on copied checkpoints would
    be a new branch: it never resumes from them.)"""
    source = tiny_config(
        tmp_path / "src", "job.name=src", "train.steps=5", "checkpoint.every_steps=2"
    )
    run_job(source)
    assert (source.run_dir / "checkpoint" / "step_4" / "manifest.json").is_file()
    out, calls, run_dir = run_fake_manager(
        tmp_path,
        ["crash_in_checkpoint", "finish"],
        "elastic.enabled=true",
        "fault.max_restarts=1",
        checkpoints=source.run_dir / "checkpoint",
        restart_count=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = _srun_calls(calls)
    step_4 = str(run_dir / "checkpoint" / "step_4")
    assert first[first.index("--resume") + 1] == step_4
    assert second[second.index("--resume") + 1] == step_4


@pytest.mark.parametrize(
    ("nodes", "own", "needed", "kept"),
    [
        (["node1", "node2", "node3", "node4"], "node1", 2, ["node1", "node2"]),
        (["node1", "node2", "node3", "node4"], "node3", 1, ["node3"]),
        (["node1", "node2", "node3", "node4"], None, 3, ["node1", "node2", "node3"]),
        (["node1", "node2"], "node1", 2, None),
        (["node1", "node2"], "node2", 5, None),
    ],
)
def test_nodes_after_release(
    nodes: list[str], own: str | None, needed: int, kept: list[str] | None
) -> None:
    assert nodes_after_release(nodes, own, needed) == kept


def test_retry_relaunch_only_after_a_resize_with_no_rank_started() -> None:
    failed, stopped = StepResult(1), StepResult(1, interrupted=int(signal.SIGTERM))
    assert retry_relaunch(True, failed, any_rank_started=False)
    assert not retry_relaunch(False, failed, any_rank_started=False)
    assert not retry_relaunch(True, failed, any_rank_started=True)
    assert not retry_relaunch(True, StepResult(0), any_rank_started=False)
    assert not retry_relaunch(True, stopped, any_rank_started=False)


def test_unshrunk_config_keeps_the_size_and_turns_packing_off(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "pipeline.num_stages=4", "elastic.enabled=true")
    kept = unshrunk_config(cfg)
    assert kept.pipeline == cfg.pipeline and not kept.elastic.enabled
    assert kept.elastic.policy == cfg.elastic.policy


def test_queued_events_keep_their_kind_and_failures_stay_failures(tmp_path: Path) -> None:
    add_pending_event(tmp_path, "shrink_refused", {"step": 3, "message": "no"})
    (tmp_path / "x").mkdir()
    records: list[dict[str, Any]] = take_pending_failures(tmp_path)
    assert [event_kind(r) for r in records] == [("shrink_refused", {"step": 3, "message": "no"})]
    assert not (tmp_path / FAILURE_PENDING).exists()
    assert event_kind({"cause": "signal"}) == ("failure", {"cause": "signal"})
