"""benchmarks/bench_migration.py runs on 2 local ranks and reports both kinds of migration.

Only that it runs and that its figures are sane: the ratio itself is a performance figure,
measured on a quiet machine (README), never asserted here (the machines are shared and noisy).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_bench_migration_runs_and_reports_both_kinds(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_migration.py"), "--reps", "1"]
    cmd += ["--d-models", "256", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["d_model"] == 256
    assert 9e6 < row["layer_bytes"] < 10e6  # a 256-wide block with its AdamW moments
    for key in ("migrate", "first_move"):
        assert row[f"{key}_s"] > 0
        assert 0 < row[f"{key}_ratio_min"] <= row[f"{key}_ratio_median"] <= row[f"{key}_ratio_max"]
        assert row[f"{key}_raw_s"] > 0
    assert "first move GB/s" in proc.stdout and "recycled memory" in proc.stdout
