"""The run log across processes: a SIGKILLed writer leaves a readable file; SWMR readers see growth.

The writer runs as a real subprocess (as rank 0 of a job would), so nothing is shared with the
test process and the kill is as abrupt as the OOM killer or ``scancel -s KILL``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import pytest

from dynmo_hpc.runlog import RunLogWriter, load, schema
from dynmo_hpc.runlog.report import summarize

REPO = Path(__file__).resolve().parents[1]
NUM_STAGES = 3
PARTS = [0, 2, 4, 6]

# Logs steps without pause and flushes every 5 steps, printing the last flushed step after each
# flush; with --steps it stops (and closes) after that many steps, sleeping --sleep-s per step.
WRITER = textwrap.dedent(
    """
    import sys, time
    from dynmo_hpc.runlog import RunLogWriter
    path, max_steps, sleep_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    with RunLogWriter(path, config_yaml="job:\\n  name: crash\\n", meta={"launcher": "test"},
                      flush_every_rows=10**9, flush_every_s=1e9) as w:
        step = 0
        while max_steps < 0 or step < max_steps:
            w.log_step(step=step, loss=1.0 / (step + 1), step_time_s=0.1, tokens_per_s=1e4,
                       lr=1e-3, num_stages=3, num_ranks=3, num_nodes=1)
            w.log_stage_times(step=step, compute_s=[0.1, 0.2, 0.3], idle_s=[0.2, 0.1, 0.0])
            if step % 5 == 4:
                w.log_layer_report(step=step, forward_s=[0.01] * 6, backward_s=[0.02] * 6,
                                   num_params=[10] * 6, param_bytes=[40] * 6, grad_bytes=[40] * 6,
                                   optim_bytes=[80] * 6, parts=[0, 2, 4, 6])
                w.log_event(step=step, kind="checkpoint", detail={"step": step, "pad": "x" * step})
                w.flush()
                print(step, flush=True)
            time.sleep(sleep_s)
            step += 1
    """
)


def _start_writer(tmp_path: Path, path: Path, max_steps: int, sleep_s: float) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, str(script), str(path), str(max_steps), str(sleep_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_flushed_step(proc: subprocess.Popen, min_step: int, timeout_s: float = 30.0) -> int:
    """Read the writer's acknowledgements until it has flushed ``min_step``; return the last one."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if int(line) >= min_step:
            return int(line)
    proc.kill()
    pytest.fail(f"writer did not flush step {min_step} within {timeout_s} s (rc={proc.poll()})")


def _check_consistent_prefix(path: Path, flushed_step: int) -> None:
    run = load(path)
    steps = run.steps["step"].tolist()
    assert steps == list(range(len(steps))), "steps must be a gap-free prefix"
    assert steps[-1] >= flushed_step
    # Every acknowledged flush is complete in every table.
    st = run.stage_times[run.stage_times["step"] <= flushed_step]
    assert len(st) == NUM_STAGES * (flushed_step + 1)
    assert st.groupby("step")["compute_s"].apply(list).map(lambda c: c == [0.1, 0.2, 0.3]).all()
    num_reports = (flushed_step + 1) // 5
    assert run.report_steps()[:num_reports] == [5 * i + 4 for i in range(num_reports)]
    assert all(run.parts_at(s) == PARTS for s in run.report_steps())
    assert len(run.layer_costs) == 6 * len(run.report_steps())
    events = run.events
    assert events["kind"].tolist() == ["checkpoint"] * len(events)  # no end event: crashed
    assert events["step"].tolist()[:num_reports] == [5 * i + 4 for i in range(num_reports)]
    for event in events.itertuples():
        assert event.detail == {"step": event.step, "pad": "x" * event.step}
    assert run.config == {"job": {"name": "crash"}}
    assert run.end_status is None


@pytest.mark.parametrize("kill_after_step", [4, 149])
def test_sigkill_mid_writing_leaves_a_readable_file(tmp_path: Path, kill_after_step: int) -> None:
    path = tmp_path / "run.h5"
    proc = _start_writer(tmp_path, path, max_steps=-1, sleep_s=0.0)
    flushed = _wait_for_flushed_step(proc, kill_after_step)
    proc.send_signal(signal.SIGKILL)  # the writer is busy logging or flushing the next rows
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".py"] == ["run.h5"]

    with pytest.raises(OSError, match="h5clear"):  # why load() always opens with swmr=True
        h5py.File(path, "r")
    _check_consistent_prefix(path, flushed)
    assert "NOT CLOSED" in summarize(load(path))

    # A requeued job can carry on in the same file.
    with RunLogWriter(path, config_yaml="job:\n  name: crash\n", meta={}, resume=True) as w:
        last = int(load(path).steps["step"].iloc[-1])
        w.log_step(
            step=last + 1,
            loss=0.0,
            step_time_s=0.1,
            tokens_per_s=1e4,
            lr=1e-3,
            num_stages=2,
            num_ranks=2,
            num_nodes=1,
        )
    run = load(path)
    assert run.steps["step"].tolist() == list(range(last + 2))
    assert run.events["kind"].tolist()[-2:] == [schema.RESTART_EVENT_KIND, schema.END_EVENT_KIND]
    assert run.end_status == "ok"
    with h5py.File(path, "r") as f:  # closed cleanly now: any HDF5 tool opens it
        assert f["steps"].shape == (last + 2,)


def test_swmr_reader_sees_the_file_grow(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    num_steps = 200
    proc = _start_writer(tmp_path, path, max_steps=num_steps, sleep_s=0.004)
    deadline = time.monotonic() + 30
    while not path.exists():  # created atomically: once it exists it is complete
        assert time.monotonic() < deadline and proc.poll() is None, "writer never created the file"
        time.sleep(0.005)

    seen: list[int] = []
    loads_while_running = 0
    with h5py.File(path, "r", swmr=True) as f:
        steps, events, detail = f["steps"], f["events"], f[schema.EVENT_DETAIL]
        while proc.poll() is None and time.monotonic() < deadline:
            steps.refresh()
            events.refresh()  # events before their bytes, as load() does
            detail.refresh()
            seen.append(steps.shape[0])
            rows = events[()]
            if len(rows):
                ends = rows["detail_offset"] + rows["detail_len"]
                assert ends.max() <= detail.shape[0], "an event row points past its bytes"
            if len(seen) % 10 == 0:
                run = load(path)  # the full loader works on the live file too
                assert run.steps["step"].tolist() == list(range(len(run.steps)))
                loads_while_running += 1
            time.sleep(0.01)
    assert proc.wait(timeout=30) == 0
    assert seen == sorted(seen), "row counts never shrink"
    assert len(set(seen)) >= 3, f"reader should see several sizes while writing, saw {set(seen)}"
    assert loads_while_running >= 1
    run = load(path)
    assert len(run.steps) == num_steps
    assert run.end_status == "ok"
