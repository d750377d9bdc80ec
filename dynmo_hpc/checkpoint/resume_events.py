"""Rank 0 of a resumed launch: the run-log events that say what the resume found.

Kept out of the trainer so that it only decides *when* to log; what a resume reports (damaged
checkpoints passed over, settings that changed since the checkpoint) lives here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dynmo_hpc.checkpoint import resume, store
from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.resume_rules import is_bitwise

log = logging.getLogger(__name__)


def log_skipped_checkpoints(writer: Any, chosen: Path, step: int) -> None:
    """Warn (log and run log) about newer checkpoints of the lineage that were damaged or
    incomplete (:func:`~dynmo_hpc.checkpoint.store.skipped_before`)."""
    for candidate in store.skipped_before(chosen):
        if candidate.problem is not None:
            log.warning("skipped checkpoint %s: %s", candidate.path, candidate.problem)
            writer.log_event(
                step=step,
                kind="checkpoint_skipped",
                detail={"path": str(candidate.path), "problem": candidate.problem},
            )


def log_config_changes(writer: Any, cfg: JobConfig, state: dict[str, Any], step: int) -> None:
    """Log (and record as a ``config_change`` event) each change that alters the training math,
    its length or its bits since the checkpoint: the launcher refused those not allowed
    (``--allow-change``), so every one logged here applies from this step on. A FREE change is
    logged when it is not bit-exact (:data:`~dynmo_hpc.config.resume_rules.NOT_BITWISE`:
    replicas, device, gradient buckets), with its rule ``free``."""
    verdict = resume.judge(cfg, state)
    changes = [c for c in verdict.accepted + verdict.passed if not is_bitwise(c.key)]
    if not changes:
        return
    detail = {
        "changes": [
            {"key": c.key, "saved": c.saved, "new": c.new, "rule": c.rule.value} for c in changes
        ]
    }
    writer.log_event(step=step, kind="config_change", detail=detail)
    log.warning("resumed with changed settings: %s", ", ".join(c.describe() for c in changes))
