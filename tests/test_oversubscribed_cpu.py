"""The layers' CPU seconds with more ranks than cores (``dynmo_hpc.sim.oversubscribed_cpu``):
fitted on runs of one job at both kinds of stage count, divided out of a source's reports and
multiplied into the target's oversubscribed steps."""

from __future__ import annotations

import pytest

from dynmo_hpc.sim.oversubscribed_cpu import alone_costs, fit_oversubscribed_cpu
from dynmo_hpc.sim.replay import CostReport, PackingSetup, ReplaySetup, replay
from dynmo_hpc.sim.runlog_traces import RunTraces

COSTS_S = [0.010, 0.013, 0.016, 0.019, 0.022, 0.025]
"""Forward seconds per microbatch of six layers (backward twice that)."""


def _report(scale: float, num_microbatches: int) -> CostReport:
    forward = [scale * num_microbatches * x for x in COSTS_S]
    return CostReport(
        forward_s=forward,
        backward_s=[2 * x for x in forward],
        num_params=[10] * len(forward),
        layer_bytes=[100] * len(forward),
    )


def _traces(num_stages: int, num_microbatches: int, scales: list[float]) -> RunTraces:
    """A run of the six layers on ``num_stages`` uniform stages, one report per scale (every
    4 steps), each layer costing ``scale`` times :data:`COSTS_S` per microbatch."""
    n = len(COSTS_S)
    parts = [n * i // num_stages for i in range(num_stages + 1)]
    return RunTraces(
        reports=[_report(s, num_microbatches) for s in scales],
        report_steps=[4 * i + 3 for i in range(len(scales))],
        report_parts=[parts] * len(scales),
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule="1f1b",
        interval=4,
        margin=0.1,
        smoothing=0.5,
        tokens_per_microbatch=64,
        activation_bytes=0,
        packing=PackingSetup(),
        measured_restart_s=None,
        step_wall_s_per_cpu_s=[None] * len(scales),
    )


def test_the_factor_is_per_microbatch_shared_over_alone_for_one_job() -> None:
    alone = _traces(2, 4, [1.0, 1.0, 1.0])
    shared = _traces(4, 8, [1.1, 1.1, 1.1])  # twice the microbatches: per-step costs double
    assert fit_oversubscribed_cpu([(alone, "a"), (shared, "a")], cores=2) == pytest.approx(1.1)
    # Another job's runs are never compared with these.
    other = _traces(4, 8, [3.0, 3.0, 3.0])
    fitted = fit_oversubscribed_cpu([(alone, "a"), (shared, "a"), (other, "b")], cores=2)
    assert fitted == pytest.approx(1.1)
    # The median over every pair and report: one noisy report does not move it.
    noisy = _traces(4, 8, [1.1, 1.1, 5.0])
    assert fit_oversubscribed_cpu([(alone, "a"), (noisy, "a")], cores=2) == pytest.approx(1.1)


def test_no_job_at_both_kinds_of_stage_count_fits_nothing() -> None:
    assert fit_oversubscribed_cpu([(_traces(2, 4, [1.0]), "a")], cores=2) is None
    assert fit_oversubscribed_cpu([(_traces(4, 8, [1.1]), "a")], cores=2) is None
    two_jobs = [(_traces(2, 4, [1.0]), "a"), (_traces(4, 8, [1.1]), "b")]
    assert fit_oversubscribed_cpu(two_jobs, cores=2) is None
    # Reports at steps the other run never logged are not compared.
    late = _traces(4, 8, [1.1])
    late = RunTraces(**{**late.__dict__, "report_steps": [99]})
    assert fit_oversubscribed_cpu([(_traces(2, 4, [1.0]), "a"), (late, "a")], cores=2) is None


def test_alone_costs_divide_only_reports_measured_with_more_ranks_than_cores() -> None:
    shared, alone = _traces(4, 8, [1.1]), _traces(2, 4, [1.0])
    (back,) = alone_costs(shared, cores=2, factor=1.1)
    assert back.forward_s == pytest.approx(_report(1.0, 8).forward_s)
    assert back.backward_s == pytest.approx(_report(1.0, 8).backward_s)
    assert alone_costs(alone, cores=2, factor=1.1) == alone.reports
    assert alone_costs(shared, cores=None, factor=1.1) == shared.reports
    assert alone_costs(shared, cores=2, factor=None) == shared.reports


def _step_s(
    reports: list[CostReport], num_stages: int, factor: float, external: bool = True
) -> float:
    setup = ReplaySetup(
        num_stages=num_stages,
        num_microbatches=8,
        interval=4,
        cores=2.0,
        ratios_are_external=external,
        oversubscribed_cpu_s_per_cpu_s=factor,
    )
    return replay(reports, setup, "uniform").median_step_time_s


def test_the_replay_charges_the_factor_only_to_oversubscribed_steps() -> None:
    alone = [_report(1.0, 8)]
    # 4 stages on 2 cores: every layer's CPU seconds times the factor (no link, no wake-up:
    # the step is all CPU work, so it scales by it).
    assert _step_s(alone, 4, 1.1) == pytest.approx(1.1 * _step_s(alone, 4, 1.0))
    # 2 stages on 2 cores: a core per rank, nothing charged.
    assert _step_s(alone, 2, 1.1) == _step_s(alone, 2, 1.0)
    # A run's own measured ratios already contain it: not charged again.
    assert _step_s(alone, 4, 1.1, external=False) == _step_s(alone, 4, 1.0, external=False)
    with pytest.raises(ValueError, match=r"oversubscribed_cpu_s_per_cpu_s=0\.0 must be"):
        _step_s(alone, 4, 0.0)


def test_a_source_predicting_its_own_stage_count_is_unchanged_by_the_factor() -> None:
    """Divided out on the source side, multiplied back on the target side: a 4-stage run
    replayed on 4 stages gets its own costs back; on 2 stages, its costs with a core per rank."""
    shared = _traces(4, 8, [1.1])
    for factor in (1.0, 1.1, 1.3):
        reports = alone_costs(shared, cores=2, factor=factor)
        assert _step_s(reports, 4, factor) == pytest.approx(_step_s(shared.reports, 4, 1.0))
    packed = _step_s(alone_costs(shared, cores=2, factor=1.1), 2, 1.1)
    assert packed == pytest.approx(_step_s([_report(1.0, 8)], 2, 1.0))
