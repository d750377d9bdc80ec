"""What a checkpoint's ``run_state.json`` holds: the run's state after a step (rank 0).

A pure function of the trainer's parts, so the record is built in one place; what each field
means for a resume: :mod:`dynmo_hpc.checkpoint.resume`.
"""

from __future__ import annotations

import math
from typing import Any

from dynmo_hpc.checkpoint import resume
from dynmo_hpc.config import JobConfig
from dynmo_hpc.model.optim import lr_at
from dynmo_hpc.train.lifecycle import TrainResult
from dynmo_hpc.train.load_report import ReportState


def run_state(
    cfg: JobConfig,
    step: int,
    *,
    report: ReportState,
    schemes: dict[str, Any],
    pack: dict[str, Any],
    result: TrainResult,
) -> dict[str, Any]:
    """The run's state after ``step`` completed steps. ``num_replicas`` is a record only: a
    checkpoint resumes onto any replica count (it holds every layer once)."""
    return {
        "step": step,
        "num_stages": cfg.pipeline.num_stages,
        "num_replicas": cfg.pipeline.replicas,
        "parts": list(report.parts),
        "num_layers": cfg.model.num_layers,
        "identity": resume.identity(cfg),
        "config_sha256": resume.config_sha256(cfg),
        "config": resume.config_dict(cfg),
        "data": {"next_step": step, "batches": "pure function of (job.seed, step, microbatch)"},
        "lr_schedule": {"next_step": step, "next_lr": lr_at(step, cfg.train)},
        "rng": {"seed": cfg.job.seed, "stateful_generators": []},
        "schemes": schemes,
        "balancer": {
            "costs_s": report.tracker.costs_s,
            "num_reports": report.num_reports,
            # None, not Infinity, for one rank (no link): strict JSON
            "bandwidth_bytes_per_s": report.bandwidth_bytes_per_s
            if math.isfinite(report.bandwidth_bytes_per_s)
            else None,
        },
        "pack": pack,
        "history": {
            "losses": result.losses,
            "tokens_per_s": result.tokens_per_s,
            "step_time_s": result.step_time_s,
        },
    }
