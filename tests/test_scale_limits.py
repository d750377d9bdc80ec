"""What limits a row of the at-scale table (:mod:`dynmo_hpc.sim.scale_limits`): the factors
counted by hand on a small report, their product, the limit and the paper's difference in words."""

from __future__ import annotations

import math

import pytest

from dynmo_hpc.sim.replay import CostReport, ReplayResult, ReplaySetup, replay
from dynmo_hpc.sim.scale_limits import (
    RowLimits,
    paper_difference,
    row_limits,
    what_limits,
)


def _report(costs_s: list[float]) -> CostReport:
    """Layer costs split 1:2 into forward and backward, 1 parameter and 1 byte a layer."""
    n = len(costs_s)
    return CostReport(
        forward_s=[c / 3 for c in costs_s],
        backward_s=[2 * c / 3 for c in costs_s],
        num_params=[1] * n,
        layer_bytes=[1] * n,
    )


def _limits(**changes: float | str) -> RowLimits:
    base: dict[str, float | str] = {
        "best_static": "megatron",
        "best_balancer": "optimal",
        "achieved": 1.5,
        "achieved_max": 1.55,
        "imbalance": 1.7,
        "granularity": 1.0,
        "pipeline": 0.9,
        "decisions": 1.5 / (1.7 * 0.9),
        "migrations": 1.0,
    }
    base.update(changes)
    return RowLimits(**base)  # type: ignore[arg-type]


def test_the_factors_of_a_hand_counted_report() -> None:
    # Layers [1, 1, 1, 5] on 2 stages: uniform's [0, 2, 4] loads 2 and 6 (mean 4): imbalance
    # 1.5; the best split [0, 3, 4] loads 3 and 5, so whole layers cap it: granularity 4/5.
    report = _report([1.0, 1.0, 1.0, 5.0])
    setup = ReplaySetup(num_stages=2, num_microbatches=64, interval=5, num_steps=20, margin=0.0)
    results = {a: replay([report], setup, a) for a in ("uniform", "optimal")}
    lim = row_limits([report], setup, results, steady_from_step=5)
    assert (lim.best_static, lim.best_balancer) == ("uniform", "optimal")
    assert lim.imbalance == pytest.approx(1.5)
    assert lim.granularity == pytest.approx(0.8)
    # 1F1B on 2 stages: M microbatches on the heavier stage plus one of the lighter (its
    # first forward and last backward): (6 + 2/64) / (5 + 3/64) against the compute-only 6/5.
    assert lim.ceiling == pytest.approx((6 + 2 / 64) / (5 + 3 / 64))
    assert lim.pipeline == pytest.approx(lim.ceiling / 1.2)
    # Optimal moved once, at step 4 (before the steady state): it runs the best split after.
    assert lim.migrations == 1.0
    assert lim.achieved == pytest.approx(lim.ceiling)
    assert lim.achieved_max == pytest.approx(lim.ceiling)
    assert what_limits(lim) == (
        "at the ceiling (1.20 of 1.20): no partition does better; of the trajectory's "
        "imbalance (1.50x), whole layers take 20%"
    )


def test_a_migration_in_the_steady_state_is_its_own_factor() -> None:
    report = _report([1.0, 1.0, 1.0, 5.0])
    # A slow link: the migration costs seconds, still less than its gain over 15 steps.
    setup = ReplaySetup(
        num_stages=2,
        num_microbatches=64,
        interval=5,
        num_steps=20,
        margin=0.0,
        bandwidth_bytes_per_s=0.5,
    )
    results = {a: replay([report], setup, a) for a in ("uniform", "optimal")}
    step, moved_s = results["optimal"].migration_steps[0]
    assert step == 4 and moved_s > 0
    lim = row_limits([report], setup, results, steady_from_step=0)
    # From step 0: the first interval runs uniform's split and step 4 pays the migration.
    assert lim.migrations < 1.0 and lim.decisions < 1.0
    assert len(results["optimal"].step_parts) == 20
    assert results["optimal"].step_parts[4] == [0, 2, 4] and results["optimal"].step_parts[5] == [
        0,
        3,
        4,
    ]
    product = lim.ceiling * lim.decisions * lim.migrations
    assert product == pytest.approx(lim.achieved)
    text = what_limits(lim)
    assert text.startswith("below the ceiling by") and "partitions chosen on past costs" in text
    assert "migrations" in text


def test_the_best_static_and_balancer_are_the_fastest_over_the_steady_state() -> None:
    fast = ReplayResult(algorithm="x", step_times_s=[9.0, 1.0, 1.0], final_parts=[0, 1, 2])
    slow = ReplayResult(algorithm="y", step_times_s=[1.0, 2.0, 2.0], final_parts=[0, 1, 2])
    report = _report([1.0, 1.0])
    setup = ReplaySetup(num_stages=2, num_microbatches=4, interval=1, num_steps=3)
    results = {"megatron": fast, "uniform": slow, "diffusion": slow, "optimal": fast}
    lim = row_limits([report], setup, results, steady_from_step=1)
    assert (lim.best_static, lim.best_balancer) == ("megatron", "optimal")
    assert lim.achieved == 1.0 and lim.ceiling == pytest.approx(1.0)
    assert what_limits(lim).startswith("nothing to gain")
    with pytest.raises(ValueError, match="no replay of any of"):
        row_limits([report], setup, {"megatron": fast}, steady_from_step=0)
    with pytest.raises(ValueError, match="same number of steps"):
        short = ReplayResult(algorithm="z", step_times_s=[1.0], final_parts=[0, 1, 2])
        row_limits([report], setup, {"megatron": fast, "optimal": short}, steady_from_step=0)


def test_the_limit_in_words() -> None:
    at = _limits()
    assert at.capture == pytest.approx(0.5 / 0.53)  # (1.50 - 1) / (1.53 - 1)
    assert what_limits(at) == (
        "at the ceiling (1.50 of 1.53): no partition does better; of the trajectory's "
        "imbalance (1.70x), fill, drain and transfers take 10%"
    )
    assert what_limits(_limits(imbalance=1.52, pipeline=1.0, decisions=1.5 / 1.52)) == (
        "at the ceiling (1.50 of 1.52): the trajectory's imbalance is all there is"
    )
    below = _limits(achieved=1.2, decisions=0.9, migrations=1.2 / (1.53 * 0.9))
    text = what_limits(below)
    assert text.startswith("below the ceiling by 22% (1.20 of 1.53): migrations 13%")
    assert text.endswith("partitions chosen on past costs 10%")
    assert _limits(imbalance=1.0, pipeline=1.0).capture is None
    slower = _limits(achieved=0.97, imbalance=1.0, pipeline=1.0, decisions=0.98, migrations=0.99)
    assert what_limits(slower) == (
        "nothing to gain: the megatron split is within 1% of the best partition (ceiling 1.00); "
        "ours 3% slower: partitions chosen on past costs 2%, migrations 1%"
    )


def test_the_named_difference_from_the_paper() -> None:
    lim = _limits()
    assert paper_difference(lim, None) == "-"
    assert paper_difference(lim, 1.5) == "ours reaches it (1.55)"
    assert paper_difference(lim, 3.18) == (
        "the trajectory: the megatron split's heaviest stage is 1.70x the mean; "
        "3.18x needs >= 3.18x"
    )
    capped = _limits(imbalance=4.0, granularity=0.5)
    assert paper_difference(capped, 3.18).startswith("whole layers:")
    piped = _limits(imbalance=4.0, pipeline=0.5)
    assert paper_difference(piped, 3.18).startswith("the pipeline:")
    balancer = _limits(imbalance=4.0)
    assert paper_difference(balancer, 3.18) == "the balancer: the ceiling 3.60x allows it"
    assert math.isclose(balancer.ceiling, 3.6)
