"""Smoke tier for ``benchmarks/bench_data.py`` (listed in test_bench_smoke's COVERED_ELSEWHERE):
each part runs once with its smallest settings and prints valid JSON; settings that cannot
measure anything are refused with one line. No timing is asserted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.test_bench_smoke import refuse_script, run_script

SCRIPT = "bench_data.py"


def _json(*args: str) -> dict[str, Any]:
    proc = run_script(SCRIPT, *args, timeout_s=300)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_prepare_reports_throughput_and_peak_memory() -> None:
    result = _json("prepare", "--mb", "0.3", "--vocab-size", "300")
    assert result["corpus_mb"] >= 0.3 and result["tokens"] > 0
    assert result["encode_peak_rss_mb"] > 0 and result["encode_mb_per_s"] > 0


@pytest.mark.slow
def test_mmap_and_precision_report_their_comparisons() -> None:
    mmap = _json("mmap", "--batches", "3", "--steps", "1")
    assert {"batch_us_mmap", "batch_us_memory", "overhead_percent"} <= set(mmap)
    precision = _json("precision", "--repeats", "1", "--steps", "1")
    assert {"fp32_step_s_median", "bf16_step_s_median", "bf16_over_fp32"} <= set(precision)


def test_settings_that_measure_nothing_are_refused() -> None:
    assert "--repeats must be positive" in refuse_script(SCRIPT, "precision", "--repeats", "0")
    assert "at least 256" in refuse_script(SCRIPT, "prepare", "--vocab-size", "100")
