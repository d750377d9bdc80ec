"""Smoke tier: each script in benchmarks/ runs once with its smallest settings and prints its table.

Why: the scripts are the commands the README and docs/ quote, and nothing else runs them; a
script that broke (a renamed API, a run directory reused) would only be found by a user. Each
test runs the script as a user would (a subprocess, with its documented flags turned down to
the smallest values that still reach every code path) and asserts that it exits 0 and prints
its table header or valid JSON. No timing is ever asserted: these machines are shared and noisy.
Settings too small for a script's statistics must be refused with one line and a non-zero exit
(never a table of nan); the refusal tests check that.

``test_every_script_has_a_smoke_test`` keeps the tier complete: a script in benchmarks/ needs a
test here or an entry in COVERED_ELSEWHERE. peer_deepspeed.py needs the optional DeepSpeed env
(``make bench-env``); without it, its one-line refusal is checked. The runs that train (marked
``slow``) take most of the file's time: a few minutes on 2 idle cores.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, run_job, tiny_config

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
"""The optional benchmark env with DeepSpeed (``make bench-env``)."""

COVERED_ELSEWHERE = {
    "ab_breakdown.py": "tests/test_bench_ab.py (on the end-to-end bench's A/B run)",
    "ab_schedule.py": "tests/test_bench_ab.py (on an A/B run alternating two schedules)",
    "bench_checkpoint.py": "tests/test_bench_checkpoint.py",
    "bench_data.py": "tests/test_bench_data.py",
    "bench_migration.py": "tests/test_bench_migration.py",
    "stress_runlog_kill.py": "tests/test_runlog_torn_chunk.py",
    "torch_pipelining_rank.py": "tests/test_bench_smoke.py (run by bench_pipeline.py)",
}
"""Scripts whose end-to-end run lives in another test file (or inside another script)."""


def refuse_script(name: str, *args: str, timeout_s: float = 60.0) -> str:
    """Run ``benchmarks/<name>`` expecting a refusal: non-zero exit, one line on stderr."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "nan" not in proc.stdout
    return lines[0]


def run_script(
    name: str, *args: str, timeout_s: float = 240.0, python: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<name>`` (with this interpreter unless ``python``); fails on exit != 0."""
    cmd = [str(python or sys.executable), str(ROOT / "benchmarks" / name), *args]
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


def test_bench_llama_block_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "llama_block.json"
    args = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--json", str(out)]
    proc = run_script("bench_llama_block.py", *args)
    assert "| plain module |" in proc.stdout and "pipeline / plain" in proc.stdout
    assert "nan" not in proc.stdout
    assert len(json.loads(out.read_text())["pipeline_s"]) == 1


def test_bench_llama_block_refuses_no_measured_step() -> None:
    line = refuse_script("bench_llama_block.py", "--steps", "2", "--warmup", "2")
    assert "--steps" in line and "HINT" in line


def test_every_script_has_a_smoke_test() -> None:
    """A new script in benchmarks/ must be run by some test: here or in COVERED_ELSEWHERE."""
    here = Path(__file__).read_text()
    for script in sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")):
        if script in COVERED_ELSEWHERE:
            test_file = COVERED_ELSEWHERE[script].split()[0]
            assert script in (ROOT / test_file).read_text(), (script, test_file)
        else:
            assert f'"{script}"' in here.replace(f'"{script}": "', ""), f"no smoke test: {script}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny 2-rank run with load reports and the optimal balancer: input of the log readers."""
    cfg = tiny_config(tmp_path_factory.mktemp("smoke"), "balance.algorithm=optimal")
    run_job(cfg)
    return cfg.run_dir


@pytest.mark.mpi
def test_run_log_readers_print_their_tables(run_dir: Path) -> None:
    ceiling = run_script("bench_ceiling.py", str(run_dir))
    assert "| run | ceiling over the run | at the last report |" in ceiling.stdout
    assert f"| {run_dir.name} |" in ceiling.stdout
    shift = run_script("scheme_shift.py", str(run_dir))
    assert shift.stdout.splitlines()[0].split()[:3] == ["run", "reports", "tv"]
    assert run_dir.name in shift.stdout


@pytest.mark.mpi
def test_sim_scale_prints_json_and_table(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    shutil.copy(run_dir / "run.h5", tmp_path / "plain" / "run.h5")  # a run with no scheme
    args = ["--runs-dir", str(tmp_path), "--schemes", "plain", "--stages", "8"]
    proc = run_script("sim_scale.py", *args, "--json")
    (row,) = json.loads(proc.stdout)
    (result,) = row["results"]
    assert row["scheme"] == "plain" and row["blocks"] == 128 and result["stages"] == 8
    assert set(result["speedup"]) >= {"megatron", "uniform", "parameters", "optimal", "diffusion"}
    assert result["limits"]["best_static"] in {"megatron", "uniform", "parameters", "profiled"}
    table = run_script("sim_scale.py", *args)
    assert "| scheme | P | over `uniform` | over `megatron` | over `parameters` |" in table.stdout
    assert "| plain | 8 |" in table.stdout


@pytest.mark.mpi
def test_peer_deepspeed_against_a_run_log(run_dir: Path) -> None:
    """With the DeepSpeed env, the real comparison; without it (the main env never has DeepSpeed)
    the script must refuse in one line that says how to get it, not crash or print nothing."""
    args = ["--seeds", "1", "--from", str(run_dir / "run.h5"), "--json"]
    if not BENCH_PYTHON.exists():
        assert "make bench-env" in refuse_script("peer_deepspeed.py", *args)
        return
    proc = run_script("peer_deepspeed.py", *args, python=BENCH_PYTHON)
    out = json.loads(proc.stdout)
    assert out["summary"]["comparisons"] > 0 and out["summary"]["ours_heavier"] == 0


def test_bench_balance_both_parts() -> None:
    proc = run_script("bench_balance.py", "--trials", "2")
    assert "optimal: median wall time" in proc.stdout
    assert "diffusion: bottleneck / optimal bottleneck" in proc.stdout
    assert "bench_balance" in refuse_script("bench_balance.py", "--trials", "0")


@pytest.mark.mpi
def test_bench_duplex_prints_its_three_cases() -> None:
    proc = run_script("bench_duplex.py", "--mib", "1", "--reps", "1")
    for case in ("one-way", "both-ways", "one-way x2"):
        assert case in proc.stdout
    assert "--reps" in refuse_script("bench_duplex.py", "--reps", "0")


@pytest.mark.mpi
@pytest.mark.slow
def test_profile_migration_prints_its_three_parts() -> None:
    proc = run_script("profile_migration.py", "--reps", "1", "--d-models", "64")
    assert "pack ms" in proc.stdout and "XXH3" in proc.stdout
    assert "exchange fresh ms" in proc.stdout


def test_bench_schemes_kernels_table() -> None:
    proc = run_script("bench_schemes.py", "--kernels", "--sparsities", "0.5")
    assert "(512, 128)" in proc.stdout or "(128, 512)" in proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_schemes_compares_static_and_dynmo() -> None:
    tiny = ["model.num_blocks=4", "model.d_model=32", "model.num_heads=2", "model.d_ff=64"]
    tiny += ["model.seq_len=32", "train.micro_batch_size=2", "balance.interval=2"]
    tiny += ["schemes.moe.layers=[2, 4]", "schemes.moe.num_experts=4"]
    sets = [arg for s in tiny for arg in ("--set", s)]
    args = ["--schemes", "moe", "--steps", "4", "--compare-static", *sets]
    proc = run_script("bench_schemes.py", *args)
    assert "cheapest block" in proc.stdout and "static tok/s" in proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_calibrate_sim_on_two_runs(tmp_path: Path) -> None:
    machine, table = tmp_path / "machine.json", tmp_path / "table.json"
    args = ["--runs-dir", str(tmp_path / "runs"), "--only", "plain_p2_m4,plain_p2_m8_gpipe"]
    proc = run_script(
        "calibrate_sim.py", *args, "--write-machine", str(machine), "--json-out", str(table)
    )
    assert "worst |ratio - 1|" in proc.stdout
    assert [row["run"] for row in json.loads(table.read_text())] == [
        "plain_p2_m4",
        "plain_p2_m8_gpipe",
    ]
    assert "action_overhead_s" in json.loads(machine.read_text())
    line = refuse_script("calibrate_sim.py", "--only", "plain_p2_m4")
    assert "at least 2" in line


def test_fit_cost_model_refits_the_shipped_samples(tmp_path: Path) -> None:
    # From the saved samples: the fit and its held-out check, without measuring again.
    out = tmp_path / "fit.json"
    samples = str(ROOT / "benchmarks" / "cost_samples_2core.json")
    proc = run_script("fit_cost_model.py", "--from-samples", samples, "--json-out", str(out))
    assert "192" in proc.stdout and out.stat().st_size > 0


@pytest.mark.mpi
@pytest.mark.slow
def test_heldout_sim_quick_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "heldout.json"
    args = ["--quick", "--runs-dir", str(tmp_path / "runs"), "--json-out", str(out)]
    proc = run_script("heldout_sim.py", *args, timeout_s=600)
    assert "hidden case:" in proc.stdout
    table = json.loads(out.read_text())
    assert len(table["rows"]) == 1 and table["hidden"]["measured_step_s"] > 0


@pytest.mark.mpi
@pytest.mark.slow
def test_bench_allreduce_reports_the_share_at_two_replicas(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    tiny = ["model.num_blocks=2", "model.d_model=32", "model.num_heads=2", "model.d_ff=64"]
    tiny += ["model.seq_len=32", "train.micro_batch_size=2"]
    sets = [arg for value in tiny for arg in ("--set", value)]
    args = ["--repeats", "1", "--steps", "3", "--out", str(out), *sets]
    proc = run_script("bench_allreduce.py", *args)
    assert "| run | replicas x stages |" in proc.stdout and "nan" not in proc.stdout
    (row,) = json.loads(out.read_text())["runs"]
    assert row["replicas"] == 2 and 0 < row["median_share"] < 1
    line = refuse_script("bench_allreduce.py", "--steps", "1")
    assert "--steps 1" in line and "HINT" in line
