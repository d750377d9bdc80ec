"""The CLI as a user runs it: real subprocesses, clear one-line errors, non-zero exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import TINY

ROOT = Path(__file__).resolve().parent.parent


def dynmo(*args: str, timeout_s: float = 300, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "dynmo_hpc", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_bad_yaml_key_is_one_clear_line(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("train:\n  stepz: 3\n")
    out = dynmo("run", str(job))
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "train.stepz" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_job_file():
    out = dynmo("run", "jobs/nope.yaml")
    assert out.returncode == 2 and "job file not found" in out.stderr


def test_missing_mpiexec(tmp_path):
    out = dynmo("run", "jobs/default.yaml", "--set", "runtime.mpi_launcher=/no/mpiexec")
    assert out.returncode == 2 and "mpiexec not found" in out.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_run_end_to_end_writes_run_dir(tmp_path):
    sets = [
        a
        for o in [*TINY, f"job.out_dir={tmp_path}", "checkpoint.at_end=true"]
        for a in ("--set", o)
    ]
    out = dynmo("run", "jobs/default.yaml", *sets)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "default"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "run.h5").is_file()
    assert (run_dir / "checkpoint" / "step_4" / "manifest.json").is_file()
    assert (run_dir / "checkpoint" / "latest").read_text().strip() == "step_4"
    assert "done in" in out.stdout and "checkpoint/step_4" in out.stdout
    # Progress lines on rank 0: step, loss, tokens/s, ETA.
    assert "step 4/4 | loss" in out.stderr and "tok/s" in out.stderr and "ETA" in out.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_failure_on_one_rank_aborts_the_job_quickly(tmp_path):
    sets = [
        a
        for o in [
            *TINY,
            f"job.out_dir={tmp_path}",
            "pipeline.num_stages=4",
            "train.steps=50",
            "fault.inject_step=2",
            "fault.inject_rank=2",
            "fault.inject_action=raise",
            "fault.max_restarts=0",  # the abort itself is timed here (restarts: test_faults)
        ]
        for a in ("--set", o)
    ]
    t0 = time.perf_counter()
    out = dynmo("run", "jobs/default.yaml", *sets, timeout_s=120)
    elapsed_s = time.perf_counter() - t0
    assert out.returncode != 0
    assert "injected failure on rank 2 at step 2" in out.stderr  # that rank's traceback
    assert "error: training failed" in out.stderr
    assert elapsed_s < 60, f"abort took {elapsed_s:.0f} s"


def test_a_yaml_syntax_error_is_one_line_with_a_hint(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("train:\n  steps: [1,\n")
    out = dynmo("run", str(job))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ")
    assert "not valid YAML" in out.stderr and "HINT:" in out.stderr


def test_sexagesimal_time_renders_as_the_minutes_it_means(tmp_path):
    """YAML 1.1 would read 1:00:00 as 3600 minutes; the script asks for 60."""
    out = dynmo(
        "sbatch",
        "jobs/default.yaml",
        "--set",
        f"job.out_dir={tmp_path}",
        "--set",
        "slurm.time_min=1:00:00",
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --time=60\n" in out.stdout


def test_a_usage_error_is_one_line_with_a_hint():
    out = dynmo("plan", "--costs", "1,1", "--stages", "two")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: dynmo-hpc plan: argument --stages: invalid int value")
    assert "HINT: see dynmo-hpc plan --help" in out.stderr


def test_printing_an_sbatch_script_leaves_the_runs_config_alone(tmp_path):
    """Issue 42, defect 5: ``dynmo-hpc sbatch`` without ``--submit`` rewrote the run
    directory's ``config.yaml``, which a queued or requeued job of that name reloads."""
    out_dir = f"job.out_dir={tmp_path}"
    first = dynmo("sbatch", "jobs/default.yaml", "--set", out_dir)
    assert first.returncode == 0, first.stderr
    config = tmp_path / "default" / "config.yaml"
    assert "wrote" in first.stderr and "lr: 0.123" not in config.read_text()
    before = config.read_text()
    look = dynmo("sbatch", "jobs/default.yaml", "--set", out_dir, "--set", "train.lr=0.123")
    assert look.returncode == 0, look.stderr
    assert "#SBATCH" in look.stdout and "left as it is" in look.stderr
    assert config.read_text() == before


def test_ctrl_c_while_the_cli_imports_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The entry point catches a Ctrl-C that lands during the CLI's imports (about a second)."""
    import types

    from dynmo_hpc import __main__ as entry

    class Importing(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "dynmo_hpc.cli", Importing("dynmo_hpc.cli"))
    assert entry.main() == 130
    assert capsys.readouterr().err == "interrupted\n"
