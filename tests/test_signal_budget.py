"""A step plus a checkpoint must fit in ``slurm.signal_delay_s``: warned at submit time (from the
run log of the run being continued) and by rank 0 in the run log once both are measured."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dynmo_hpc import runlog
from dynmo_hpc.handoff.signal_budget import SignalBudget, measured_budget
from dynmo_hpc.launch.preflight import warn_signal_budget
from dynmo_hpc.runlog.writer import RunLogWriter
from tests.helpers.jobs import run_job, tiny_config


def test_budget_is_median_step_plus_slowest_checkpoint() -> None:
    budget = measured_budget([1.0, 100.0, 3.0], [5.0, 20.0, float("nan")], 22)
    assert budget == SignalBudget(step_time_s=3.0, checkpoint_s=20.0, signal_delay_s=22.0)
    assert budget.needed_s == 23.0 and not budget.fits()
    assert "slurm.signal_delay_s=22" in budget.problem() and "HINT:" in budget.problem()
    assert measured_budget([3.0], [19.0], 22) == SignalBudget(3.0, 19.0, 22.0)
    assert measured_budget([3.0], [19.0], 22).fits()  # type: ignore[union-attr]
    assert measured_budget([], [1.0], 10) is None
    assert measured_budget([1.0], [], 10) is None


def _fake_run_log(run_dir: Path, step_time_s: float, checkpoint_s: float) -> None:
    run_dir.mkdir(parents=True)
    with RunLogWriter(run_dir / "run.h5", config_yaml="{}", meta={"launcher": "test"}) as log:
        for step in range(4):
            log.log_step(step=step, loss=5.0, step_time_s=step_time_s, tokens_per_s=1.0,
                         lr=1e-3, num_stages=2, num_ranks=2, num_nodes=1)  # fmt: skip
        log.log_event(step=1, kind="checkpoint", detail={"seconds": checkpoint_s})


def test_submit_time_warning_from_the_run_log_being_continued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tiny_config(tmp_path, "job.name=slow", "slurm.signal_delay_s=60")
    _fake_run_log(cfg.run_dir, step_time_s=20.0, checkpoint_s=50.0)
    with caplog.at_level(logging.WARNING):
        budget = warn_signal_budget(cfg)
    assert budget is not None and budget.needed_s == 70.0
    assert "more than slurm.signal_delay_s=60" in caplog.text


def test_no_submit_time_warning_when_it_fits_or_nothing_was_measured(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "job.name=fast", "slurm.signal_delay_s=120")
    assert warn_signal_budget(cfg) is None  # no run log yet
    _fake_run_log(cfg.run_dir, step_time_s=20.0, checkpoint_s=50.0)
    assert warn_signal_budget(cfg) is None


def test_rank0_logs_a_signal_budget_event_when_it_does_not_fit(tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path, "job.name=budget", "slurm.signal_delay_s=0", "checkpoint.every_steps=2"
    )
    run_job(cfg)
    run = runlog.load(cfg.run_dir / "run.h5")
    (detail,) = run.events[run.events["kind"] == "signal_budget"]["detail"].tolist()
    assert detail["signal_delay_s"] == 0 and detail["needed_s"] > 0, detail
    assert detail["needed_s"] == pytest.approx(detail["step_time_s"] + detail["checkpoint_s"])
