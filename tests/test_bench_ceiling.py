"""The pipeline-aware ceiling and the capture, on costs small enough to count by hand."""

from __future__ import annotations

import pytest

from dynmo_hpc.bench.ceiling import (
    Ceiling,
    Overheads,
    capture,
    combined_ceiling,
    partition_step_s,
    report_ceiling,
)

FORWARD_S = [1.0, 1.0, 1.0, 3.0]
"""Per layer, per step; no backward, so GPipe's step is a two-machine flow shop:
``f0 + f1 + (M - 1) * max(f0, f1)`` with ``f`` the stages' seconds per microbatch."""
NO_BACKWARD = [0.0] * 4


def test_step_time_is_the_flow_shop_count() -> None:
    # M = 2: per microbatch [0.5, 0.5, 0.5, 1.5]; [0, 2, 4] gives stages 1.0 and 2.0
    assert partition_step_s(FORWARD_S, NO_BACKWARD, [0, 2, 4], 2, "gpipe") == 1 + 2 + 2
    # [0, 3, 4]: 1.5 and 1.5 -> 1.5 + 1.5 + 1.5
    assert partition_step_s(FORWARD_S, NO_BACKWARD, [0, 3, 4], 2, "gpipe") == 4.5


def test_ceiling_counts_the_fill_and_drain() -> None:
    got = report_ceiling(FORWARD_S, NO_BACKWARD, [0, 2, 4], 2, "gpipe")
    # [0, 1, 4] would take 0.5 + 2.5 + 2.5 = 5.5; the best is [0, 3, 4] at 4.5
    assert got.best_parts == [0, 3, 4]
    assert got.static_step_s == 5.0 and got.best_step_s == 4.5
    assert got.ratio == pytest.approx(5.0 / 4.5)
    # the compute-only bound (bottleneck 2.0 over 1.5) claims 1.33: the fill and drain eat some
    assert got.ratio < 2.0 / 1.5
    # with many microbatches the fill and drain matter less and the ceiling nears 1.33
    many = report_ceiling(FORWARD_S, NO_BACKWARD, [0, 2, 4], 64, "gpipe")
    assert got.ratio < many.ratio < 2.0 / 1.5
    assert many.ratio == pytest.approx((3 + 63 * 2) / (3 + 63 * 1.5))


def test_balanced_split_has_ceiling_one_and_1f1b_agrees_with_its_simulation() -> None:
    balanced = report_ceiling([1.0] * 4, [2.0] * 4, [0, 2, 4], 4)
    assert balanced.ratio == 1.0 and balanced.best_parts == [0, 2, 4]
    skewed = report_ceiling([1.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 6.0], [0, 2, 4], 4)
    assert skewed.best_parts == [0, 3, 4]
    want = partition_step_s([1, 1, 1, 3], [2, 2, 2, 6], [0, 2, 4], 4) / partition_step_s(
        [1, 1, 1, 3], [2, 2, 2, 6], [0, 3, 4], 4
    )
    assert skewed.ratio == pytest.approx(want) and skewed.ratio > 1.0


def test_combined_ceiling_weighs_reports_by_their_seconds() -> None:
    a = Ceiling(static_step_s=5.0, best_step_s=4.5, best_parts=[0, 3, 4])
    b = Ceiling(static_step_s=2.0, best_step_s=2.0, best_parts=[0, 2, 4])
    assert combined_ceiling([a, b]) == pytest.approx(7.0 / 6.5)
    with pytest.raises(ValueError):
        combined_ceiling([])


def test_capture() -> None:
    assert capture(1.2, 1.25) == pytest.approx(0.8)
    assert capture(1.0, 1.3) == 0.0
    assert capture(0.9, 1.2) == pytest.approx(-0.5)
    assert capture(1.1, 1.005) is None  # no room to capture
    assert capture(float("nan"), 1.2) is None


def test_overheads_dilute_the_ceiling_as_they_dilute_a_measured_gain() -> None:
    # a tail of 0.5 s per step, the same on every partition: 5.5 / 5.0 instead of 5.0 / 4.5
    tail = Overheads(stage_s=[0.0, 0.0], tail_s=0.5)
    got = report_ceiling(FORWARD_S, NO_BACKWARD, [0, 2, 4], 2, "gpipe", tail)
    assert got.static_step_s == 5.5 and got.best_step_s == 5.0 and got.best_parts == [0, 3, 4]
    # 0.4 s per step on stage 0 besides its layers: 0.1 s on each of its 2 M = 4 actions, so
    # its forwards take 1.1 (stage 1 starts at 1.1 and ends its two at 5.1), and its two
    # backwards (0 s of layers) 0.1 each after that: 5.3
    stage = Overheads(stage_s=[0.4, 0.0], tail_s=0.0)
    assert partition_step_s(FORWARD_S, NO_BACKWARD, [0, 2, 4], 2, "gpipe", stage) == (
        pytest.approx(5.3)
    )
    with pytest.raises(ValueError, match="one per stage"):
        partition_step_s(
            FORWARD_S, NO_BACKWARD, [0, 2, 4], 2, "gpipe", Overheads(stage_s=[0.0], tail_s=0.0)
        )
    with pytest.raises(ValueError, match=">= 0"):
        Overheads(stage_s=[-1.0, 0.0], tail_s=0.0)
