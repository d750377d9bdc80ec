"""The short real runs the simulator is calibrated and checked against, as job configs.

Why one place: ``benchmarks/calibrate_sim.py`` (fits the machine constants) and
``benchmarks/heldout_sim.py`` (fits on some runs, predicts others) both train short jobs that
differ only in the settings a user chooses before a run (stages, microbatches, schedule,
algorithm, steps, report interval). Both build those jobs here, so a run of one script and a
run of the other with the same settings are the same job.

Invariants: a run never checkpoints (its log is all either script reads, and a checkpoint's
write would sit inside the measured steps); every other setting is the job file's unless
:class:`ShortRun` or its ``extra`` overrides name it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from dynmo_hpc import config as config_mod
from dynmo_hpc.config import JobConfig


@dataclass(frozen=True)
class ShortRun:
    """One short real run: a job file with the settings a calibration varies."""

    name: str
    """The run's name: its directory under the runs directory (``job.name``)."""
    job: str
    """The job file's path under ``jobs/`` without ``.yaml`` (``"imbalanced"``,
    ``"stress/pruning"``)."""
    num_stages: int
    """``pipeline.num_stages``."""
    num_microbatches: int
    """``train.num_microbatches``."""
    algorithm: str = "static"
    """``balance.algorithm``."""
    _: KW_ONLY
    steps: int = 20
    """``train.steps``."""
    interval: int = 5
    """``balance.interval``: steps between load reports."""
    schedule: str | None = None
    """``pipeline.schedule``; None keeps the job file's."""
    extra: tuple[str, ...] = ()
    """More ``section.key=value`` overrides, applied last."""


def short_run_overrides(run: ShortRun, runs_dir: Path) -> list[str]:
    """The ``--set`` overrides that make ``run``'s job, writing its run under ``runs_dir``.

    Example: ``ShortRun("a", "default", 2, 4, steps=12, interval=4)`` gives ``job.name=a``,
    ``train.steps=12``, ``pipeline.num_stages=2``, ``balance.interval=4``, ... and no
    ``pipeline.schedule`` (the job file's stands).
    """
    schedule = [] if run.schedule is None else [f"pipeline.schedule={run.schedule}"]
    return [
        f"job.name={run.name}",
        f"job.out_dir={runs_dir}",
        f"train.steps={run.steps}",
        f"train.num_microbatches={run.num_microbatches}",
        f"pipeline.num_stages={run.num_stages}",
        *schedule,
        f"balance.interval={run.interval}",
        f"balance.algorithm={run.algorithm}",
        "checkpoint.at_end=false",
        "checkpoint.every_steps=0",
        *run.extra,
    ]


def short_run_config(run: ShortRun, jobs_dir: Path, runs_dir: Path) -> JobConfig:
    """``run``'s validated job: ``jobs_dir/<run.job>.yaml`` with :func:`short_run_overrides`."""
    return config_mod.load(jobs_dir / f"{run.job}.yaml", short_run_overrides(run, runs_dir))
