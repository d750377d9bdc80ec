"""Smoke tier: each script in benchmarks/ runs once with its smallest settings and prints its table.

Why: the scripts are the commands the README and docs/ quote, and nothing else runs them; a
script that broke (a renamed API, a run directory reused) would only be found by a user. Each
test runs the script as a user would (a subprocess, with its documented flags turned down to
the smallest values that still reach every code path) and asserts that it exits 0 and prints
its table header or valid JSON. No timing is ever asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<name>`` with this interpreter; fails the test on a non-zero exit."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_pipeline_runs_every_configuration_twice() -> None:
    # Two rounds: every runner runs twice, so a run directory reused between runs is caught.
    proc = run_script("bench_pipeline.py", "--rounds", "2", "--steps", "3", "--microbatches", "2")
    assert "configuration" in proc.stdout and "tokens/s" in proc.stdout
    assert "bubble" in proc.stdout
