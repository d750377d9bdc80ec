"""Smoke tier: each script in benchmarks/ runs once with its smallest settings and prints its table.

Why: the scripts are the commands the README and docs/ quote, and nothing else runs them; a
script that broke (a renamed API, a run directory reused) would only be found by a user. Each
test runs the script as a user would (a subprocess, with its documented flags turned down to
the smallest values that still reach every code path) and asserts that it exits 0 and prints
its table header or valid JSON. No timing is ever asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def refuse_script(name: str, *args: str, timeout_s: float = 60.0) -> str:
    """Run ``benchmarks/<name>`` expecting a refusal: non-zero exit, one line on stderr."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "nan" not in proc.stdout
    return lines[0]


def run_script(name: str, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<name>`` with this interpreter; fails the test on a non-zero exit."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_pipeline_runs_every_configuration_twice(tmp_path: Path) -> None:
    # Two rounds: every runner runs twice, so a run directory reused between runs is caught.
    out = tmp_path / "pipeline.json"
    args = ["--rounds", "2", "--steps", "3", "--microbatches", "2", "--json", str(out)]
    proc = run_script("bench_pipeline.py", *args)
    assert "| microbatches | single process | dynmo_hpc 1F1B" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["microbatches"] == 2 and row["bubble_theory"] == 1 / 3
    for key in ("single", "ours", "torch", "bubble"):
        assert len(row["per_round"][key]) == 2


def test_bench_pipeline_refuses_too_few_steps() -> None:
    line = refuse_script("bench_pipeline.py", "--steps", "2")
    assert "--steps 2" in line and "HINT" in line


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_imbalanced_reports_before_after_static_and_ideal(tmp_path: Path) -> None:
    out = tmp_path / "imbalanced.json"
    proc = run_script("bench_imbalanced.py", "--rounds", "1", "--steps", "8", "--json", str(out))
    assert "| uniform split" in proc.stdout and "| static uniform split" in proc.stdout
    assert "nan" not in proc.stdout
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["parts_before"] != row["parts_after"]


def test_bench_imbalanced_refuses_a_run_too_short_for_its_windows() -> None:
    line = refuse_script("bench_imbalanced.py", "--steps", "6")
    assert "too short" in line and "HINT" in line
