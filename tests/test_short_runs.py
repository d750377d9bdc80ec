"""The short real runs behind ``benchmarks/calibrate_sim.py`` and ``benchmarks/heldout_sim.py``
(``dynmo_hpc.calibrate.short_runs``): what each run's job is, from its settings alone."""

from __future__ import annotations

from pathlib import Path

from dynmo_hpc.calibrate.short_runs import ShortRun, short_run_config, short_run_overrides
from tests.helpers.jobs import ROOT


def test_a_run_sets_what_it_varies_and_never_checkpoints(tmp_path: Path) -> None:
    run = ShortRun("imb_p3", "imbalanced", 3, 6, "optimal", steps=12, interval=4)
    cfg = short_run_config(run, ROOT / "jobs", tmp_path)
    assert cfg.job.name == "imb_p3" and cfg.run_dir == tmp_path / "imb_p3"
    assert (cfg.pipeline.num_stages, cfg.train.num_microbatches) == (3, 6)
    assert (cfg.train.steps, cfg.balance.interval, cfg.balance.algorithm) == (12, 4, "optimal")
    assert not cfg.checkpoint.at_end and cfg.checkpoint.every_steps == 0


def test_the_schedule_is_the_job_files_unless_named() -> None:
    plain = ShortRun("a", "default", 2, 4)
    assert not any(o.startswith("pipeline.schedule=") for o in short_run_overrides(plain, ROOT))
    gpipe = ShortRun("a", "default", 2, 4, schedule="gpipe")
    assert "pipeline.schedule=gpipe" in short_run_overrides(gpipe, ROOT)


def test_extra_overrides_come_last_and_win(tmp_path: Path) -> None:
    # extra is applied after the run's own settings: a script can override any of them.
    run = ShortRun("a", "default", 2, 4, steps=20, extra=("train.steps=7", "runtime.device=cpu"))
    overrides = short_run_overrides(run, tmp_path)
    assert overrides[-2:] == ["train.steps=7", "runtime.device=cpu"]
    cfg = short_run_config(run, ROOT / "jobs", tmp_path)
    assert cfg.train.steps == 7 and cfg.runtime.device == "cpu"
