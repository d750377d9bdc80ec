"""benchmarks/bench_checkpoint.py end to end on tiny models: it runs, and its figures make sense.

Real training runs and a real resume on 2 local ranks (a few steps each); asserts only that
every figure is present and positive and that the bigger model is bigger, never that anything
is fast (the machine is shared).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BENCH = ROOT / "benchmarks" / "bench_checkpoint.py"


def test_bench_checkpoint_tiny_writes_sensible_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # 3 steps, a checkpoint after steps 1 and 2 (none at the end), resume from step_1.
    cmd = [sys.executable, str(BENCH), "--tiny", "--repeats", "1", "--steps", "3", "--every", "1"]
    cmd += ["--out", str(out), "--work-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    data = json.loads(out.read_text())
    models = data["models"]
    assert list(models) == ["tiny", "tiny_large"]
    assert data["default_every_steps"] > 0
    for name, m in models.items():
        assert m["num_writes"] == 2, (name, m["raw"])
        assert m["num_restores"] == 1, (name, m["raw"])
        assert all(s > 0 for s in m["raw"]["write_s"]), (name, m["raw"])
        assert all(b > 0 for b in m["raw"]["write_bytes"]), (name, m["raw"])
        assert all(s > 0 for s in m["raw"]["restore_s"]), (name, m["raw"])
        assert m["checkpoint_bytes"] > 0 and m["params"] > 0 and m["tokens_per_step"] > 0
        for key in ("write_s", "restore_s"):
            s = m[key]
            assert 0 < s["min"] <= s["median"] <= s["max"], (name, key, s)
        assert m["write_mb_per_s"] > 0 and m["step_time_s"] > 0
        assert math.isfinite(m["overhead_pct"]) and m["overhead_pct"] > 0
    small, large = models["tiny"], models["tiny_large"]
    assert large["params"] > small["params"]
    assert large["checkpoint_bytes"] > small["checkpoint_bytes"]
    # A checkpoint holds fp32 weights and two AdamW moments: at least 12 bytes per parameter.
    assert small["checkpoint_bytes"] >= 12 * small["params"]

    assert "| tiny |" in proc.stdout and "| tiny_large |" in proc.stdout
    assert "resuming from step_1" in proc.stderr
    # The runs' directories went with the temporary directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
