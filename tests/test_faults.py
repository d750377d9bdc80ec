"""Crashed ranks, hung ranks and damaged migrations: the job restarts by itself, exactly.

Every fault is real: a rank sends itself SIGKILL (``fault.inject_*``) in the middle of a
load report, a migration or a checkpoint write, or the test SIGKILLs a rank from outside at a
random step; a rank freezes (SIGSTOP) mid-migration; a received migration chunk is damaged.
Each time the supervisor restarts the job from the newest complete checkpoint, and the per-step
losses are bitwise equal to an uninterrupted run's (resume is exact, and the loss does not
depend on the partition).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynmo_hpc.config import JobConfig
from dynmo_hpc.handoff import rank_status
from dynmo_hpc.handoff.failures import FAILURE_PENDING
from dynmo_hpc.launch.local import run_local
from dynmo_hpc.runlog.reader import load
from tests.helpers.jobs import ROOT, TINY, read_result, tiny_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 8
COMMON = [
    "pipeline.num_stages=2",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=2",
    "balance.algorithm=optimal",
    "balance.force_moves=true",  # a migration at every load report (steps 1, 3, 5)
    "model.d_ff=1024",  # MLP weights over 64 KB: they travel as checksummed chunks
]


def _cfg(tmp_path: Path, name: str, *extra: str) -> JobConfig:
    return tiny_config(tmp_path, *COMMON, f"job.name={name}", *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The uninterrupted run's per-step losses."""
    cfg = _cfg(tmp_path_factory.mktemp("ref"), "ref")
    outcome = run_local(cfg, timeout_s=180)
    assert outcome.exit_code == 0 and not outcome.failures
    losses: list[float] = read_result(cfg.run_dir)["losses"]
    assert len(losses) == STEPS
    return losses


def _failure_events(cfg: JobConfig) -> list[dict]:
    log = load(cfg.run_dir / "run.h5")
    return [row["detail"] for _, row in log.events.iterrows() if row["kind"] == "failure"]


@pytest.mark.parametrize(
    ("phase", "action", "step", "rank"),
    [
        ("step", "signal", 4, 0),  # rank 0, which writes the run log, mid-step
        ("load_report", "signal", 3, 1),
        ("migration", "signal", 3, 1),
        ("checkpoint", "signal", 3, 1),  # step_4 half written, never complete
        ("migration", "hang", 3, 1),  # the peer's phase watchdog ends the step
        ("migration", "corrupt", 3, 1),  # the XXH3 check fails on every rank
    ],
)
def test_a_fault_mid_phase_restarts_from_the_last_checkpoint(
    tmp_path: Path, reference: list[float], phase: str, action: str, step: int, rank: int
) -> None:
    cfg = _cfg(
        tmp_path,
        f"{phase}-{action}",
        f"fault.inject_step={step}",
        f"fault.inject_rank={rank}",
        f"fault.inject_phase={phase}",
        f"fault.inject_action={action}",
        *(["fault.phase_timeout_s=8"] if action == "hang" else []),
    )
    t0 = time.perf_counter()
    outcome = run_local(cfg, timeout_s=240)
    elapsed_s = time.perf_counter() - t0
    assert outcome.exit_code == 0, outcome
    assert outcome.restarts == 1 and len(outcome.failures) == 1
    failure = outcome.failures[0]
    result = read_result(cfg.run_dir)
    assert result["losses"] == reference, "losses differ from the uninterrupted run's"

    if action == "signal":
        assert (failure.rank, failure.cause, failure.signal) == (rank, "signal", signal.SIGKILL)
        assert (failure.step, failure.phase) == (step, phase)
        assert f"rank {rank} (pid {failure.pid} on " in failure.describe()
    elif action == "hang":
        # rank 0 gives up waiting on the frozen rank 1 after phase_timeout_s
        assert failure.cause == "exit" and failure.rank_exit_code == 124, failure
        assert failure.phase == "migration"
        assert elapsed_s < 120
    else:
        assert failure.cause == "abort" and failure.phase == "migration", failure
    events = _failure_events(cfg)
    assert len(events) == 1 and events[0]["restarted"] is True
    assert events[0]["rank"] == failure.rank and events[0]["step"] == failure.step
    # the newest complete checkpoint before the fault: one every 2 steps, written at the end of
    # a step (after its load report and migration), so a fault in step 3 or 4 resumes at step_2
    # or step_4
    assert events[0]["from"].endswith(f"step_{step - step % 2}"), events[0]
    assert not (cfg.run_dir / FAILURE_PENDING).exists()
    log = load(cfg.run_dir / "run.h5")
    if phase == "checkpoint":  # the half-written step_4 was passed over, and said so
        skipped = log.events[log.events["kind"] == "checkpoint_skipped"]["detail"].tolist()
        assert [Path(d["path"]).name for d in skipped] == ["step_4"], skipped
    assert log.steps["loss"].tolist() == reference  # the authoritative rows: one per step
    assert len(log.restarts) == 1


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dynmo_hpc", *args]


def _sets(tmp_path: Path, *overrides: str) -> list[str]:
    out = []
    for o in [*TINY, f"job.out_dir={tmp_path}", *overrides]:
        out += ["--set", o]
    return out


def _wait_for_step(run_dir: Path, rank: int, step: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = rank_status.read_all(run_dir).get(rank)
        if status and status["step"] >= step and status["attempt"] == 0:
            return status
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout_s} s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z")


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs whose command line names the run directory (its ranks, its mpiexec)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return [p for p in found if _alive(p)]


def test_sigkill_of_a_rank_at_a_random_step_recovers(tmp_path: Path, reference: list[float]):
    """Kill rank 1 from outside at a random step: the peers end within 10 s, the job recovers."""
    kill_step = random.Random(14).randint(1, STEPS - 2)
    name = "random-kill"
    run_dir = tmp_path / name
    proc = subprocess.Popen(
        _cli("run", "jobs/default.yaml", *_sets(tmp_path, *COMMON, f"job.name={name}")),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = _wait_for_step(run_dir, 1, kill_step)
    peer = rank_status.read_all(run_dir)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    while _alive(peer["pid"]) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    peer_end_s = time.monotonic() - killed
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert peer_end_s < 10, f"rank 0 still ran {peer_end_s:.1f} s after rank 1 died"
    assert "recovered: rank 1" in out and "killed by SIGKILL" in out, out
    assert "Traceback" not in err
    result = read_result(run_dir)
    assert result["losses"] == reference
    log = load(run_dir / "run.h5")
    (event,) = [r["detail"] for _, r in log.events.iterrows() if r["kind"] == "failure"]
    assert event["rank"] == 1 and event["signal"] == signal.SIGKILL
    assert event["step"] in (kill_step, kill_step + 1), (kill_step, event)


def test_max_restarts_zero_ends_the_job_with_a_clear_error(tmp_path: Path):
    name = "no-restarts"
    extra = ["fault.max_restarts=0", "fault.inject_step=3", "fault.inject_rank=1"]
    out = subprocess.run(
        _cli("run", "jobs/default.yaml", *_sets(tmp_path, *COMMON, f"job.name={name}", *extra)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "rank 1" in errors[0] and "killed by SIGKILL in step 4" in errors[0], errors
    assert "fault.max_restarts=0" in errors[0]
    assert "HINT:" in out.stderr and "--resume" in out.stderr
    assert "Traceback" not in out.stderr
    pending = json.loads((tmp_path / name / FAILURE_PENDING).read_text())
    assert pending[0]["restarted"] is False and pending[0]["rank"] == 1
    assert not _processes_of(tmp_path / name)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupting_dynmo_hpc_run_stops_every_rank_cleanly(tmp_path: Path, signum: int):
    """Ctrl-C (or SIGTERM/SIGHUP) to the CLI: a final checkpoint, a closed log, no orphans.

    While it runs, a second run of the same job name is refused (the run directory lock).
    """
    name = "interrupted"
    run_dir = tmp_path / name
    overrides = [*COMMON, "train.steps=400", f"job.name={name}"]
    proc = subprocess.Popen(
        _cli("run", "jobs/default.yaml", *_sets(tmp_path, *overrides)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(run_dir, 1, 3)
    if signum == signal.SIGINT:
        second = subprocess.run(
            _cli("run", "jobs/default.yaml", *_sets(tmp_path, *overrides)),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2, second.stderr
        assert "is in use by a running job (pid" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    ranks = [s["pid"] for s in rank_status.read_all(run_dir).values()]
    t0 = time.monotonic()
    proc.send_signal(signum)
    _out, err = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
    assert proc.returncode == 128 + signum, err[-3000:]
    assert stop_s < 30, f"took {stop_s:.1f} s to stop"
    assert f"interrupted ({signal.Signals(signum).name})" in err
    assert not any(_alive(p) for p in ranks), "a rank outlived the CLI"
    assert not _processes_of(run_dir), "processes of the run are left"
    result = read_result(run_dir)
    assert 3 <= result["completed_steps"] < 400
    latest = (run_dir / "checkpoint" / "latest").read_text().strip()
    assert latest == f"step_{result['completed_steps']}"
    log = load(run_dir / "run.h5")
    assert "preempt" in set(log.events["kind"]) and "end" in set(log.events["kind"])
    assert len(log.steps) == result["completed_steps"]


def test_a_launcher_that_starts_no_rank_is_one_error_without_a_restart(tmp_path: Path):
    out = subprocess.run(
        _cli("run", "jobs/default.yaml", *_sets(tmp_path, "runtime.mpi_launcher=/bin/false")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert "the MPI launcher exited with code 1 naming no rank" in errors[0]
    assert "no rank started" in errors[0] and "traceback is above" not in out.stderr
    assert "HINT: check runtime.mpi_launcher" in out.stderr and "restart 1" not in out.stderr


@pytest.mark.parametrize("how", ["second-ctrl-c", "cli-sigkilled"])
def test_no_rank_outlives_a_killed_cli(tmp_path: Path, how: str):
    """A second Ctrl-C kills at once; a SIGKILLed CLI takes mpiexec along (PDEATHSIG)."""
    name = f"killed-{how}"
    run_dir = tmp_path / name
    overrides = [*COMMON, "train.steps=100000", f"job.name={name}"]
    proc = subprocess.Popen(
        _cli("run", "jobs/default.yaml", *_sets(tmp_path, *overrides)),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(run_dir, 1, 2)
    ranks = [s["pid"] for s in rank_status.read_all(run_dir).values()]
    if how == "second-ctrl-c":
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
    else:
        proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while (_processes_of(run_dir) or any(_alive(p) for p in ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), "a rank outlived the CLI"
    assert not _processes_of(run_dir), "processes of the run are left"
    if how == "second-ctrl-c":
        assert proc.returncode == 128 + signal.SIGINT
