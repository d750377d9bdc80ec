"""The loop outside the MPI step: run it, and after it ends resize, restart or stop.

One loop serves ``dynmo-hpc run`` (local ``mpiexec``) and the SLURM manager alike; the backend
only says how to start one step (:data:`RunStep`) and how to give nodes back (:data:`Shrink`).

* A step that exits 0 with a resize request (:mod:`dynmo_hpc.handoff.resize`) is followed by a
  shrink and a new, smaller step that resumes from the pack's checkpoint.
  When the backend cannot shrink (:class:`~dynmo_hpc.handoff.resize.ShrinkRefused`), the job
  continues at its current size from that checkpoint, with packing off, and the next step's
  rank 0 logs a ``shrink_refused`` event.
* A step that fails (a rank killed by a signal, an aborted rank, a failed migration) is
  restarted from the newest complete checkpoint (or from the start when there is none yet), up
  to ``fault.max_restarts`` times. A packed step that ran out of memory (a rank wrote
  :data:`~dynmo_hpc.handoff.oom.OUT_OF_MEMORY`) is not restarted as it was: it falls back to the
  pre-pack replica and stage counts and partition when the backend still holds them
  (``can_run``), with ``elastic.min_stages`` / ``elastic.min_replicas`` raised above whichever
  the failed pack lowered, or the job stops with an error that says so. Each
  failure is described from the launcher's report and the ranks' status files
  (:mod:`dynmo_hpc.launch.failure`), logged, and handed to the next step's rank 0 in
  ``failure_pending.json`` for the run log's ``failure`` events. The same failure twice in a
  row (same rank, cause and step) is not retried again: it is not transient.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.checkpoint import lineage
from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.elastic import ElasticSection
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.handoff import rank_status
from dynmo_hpc.handoff.failures import add_pending_event, add_pending_failure
from dynmo_hpc.handoff.oom import take_out_of_memory
from dynmo_hpc.handoff.resize import (
    RESIZE_PHASES,
    ShrinkRefused,
    resized_config,
    size_change,
    take_request,
    unshrunk_config,
)
from dynmo_hpc.launch.failure import StepFailure, describe_failure
from dynmo_hpc.launch.rundir import prepare_run_dir

log = logging.getLogger(__name__)

MAX_STEPS = 256
"""Resizes plus restarts: a job that needs more MPI steps than this is looping: stop it."""


@dataclass(frozen=True)
class StepLaunch:
    """What one MPI step is asked to do."""

    config_path: Path
    resume_from: Path | None
    """The checkpoint to resume from, or None."""
    attempt: int
    """0 for the job's first step; resizes and restarts count up."""
    restart: bool = False
    """A restart with no checkpoint yet: start over, appending to the run log."""


@dataclass(frozen=True)
class StepResult:
    exit_code: int
    output_tail: str = ""
    """The launcher's last output (stderr), where it says which rank failed and how."""
    interrupted: int = 0
    """The signal that asked the step to stop (Ctrl-C, SIGTERM, a preemption), or 0."""


RunStep = Callable[[JobConfig, StepLaunch], StepResult]
"""Start one MPI step of a job and wait for it."""
Shrink = Callable[[JobConfig], float]
"""Release what ``cfg`` (the smaller job) no longer needs; returns the seconds it took."""
CanRun = Callable[[JobConfig], bool]
"""Whether the backend still holds what ``cfg`` needs (a fallback to the pre-pack size)."""


@dataclass
class JobOutcome:
    """How the loop ended: the last step's exit code, and every failure on the way."""

    exit_code: int
    failures: list[StepFailure]
    restarts: int
    gave_up: str = ""
    """Why a failed job was not restarted again (empty when it was not given up)."""
    interrupted: int = 0
    """The signal that stopped the job early (Ctrl-C, SIGTERM, a preemption), or 0."""


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete, verified checkpoint of the run's current lineage, or None (see
    :mod:`dynmo_hpc.checkpoint.lineage`: never one of an abandoned branch)."""
    from dynmo_hpc.checkpoint import store

    try:
        return store.resolve(run_dir)[0].path
    except CheckpointError:
        return None


def supervise(
    cfg: JobConfig,
    run_step: RunStep,
    shrink: Shrink,
    resume_from: Path | None = None,
    *,
    restart: bool = False,
    can_run: CanRun | None = None,
) -> JobOutcome:
    """Run the job's MPI steps until one ends without asking for a resize or a restart.

    ``restart``: the first step starts over, appending to the run log (a requeued job with no
    checkpoint yet). The job continues the run's checkpoint branch when it resumes from the
    newest checkpoint of the lineage, else starts one (:func:`dynmo_hpc.checkpoint.lineage.enter`).
    ``can_run``: whether the backend can still run a configuration after a shrink (locally
    always; None: it cannot, the nodes are gone).
    """
    failures: list[StepFailure] = []
    restarts, restart_fresh = 0, restart
    unpacked: _Unpacked | None = None  # the job before the last pack, while it runs packed
    lineage.enter(cfg.run_dir / "checkpoint", resume_from, restart=restart)  # continue or fork
    _clear_stale(cfg.run_dir)
    for attempt in range(MAX_STEPS):
        config_path = prepare_run_dir(cfg)
        rank_status.clear(cfg.run_dir)
        launch = StepLaunch(config_path, resume_from, attempt, restart=restart_fresh)
        result = run_step(cfg, launch)
        request = take_request(cfg.run_dir)
        if result.interrupted:  # asked to stop: never resized or restarted
            return JobOutcome(result.exit_code, failures, restarts, interrupted=result.interrupted)
        if result.exit_code == 0:
            if request is None:
                return JobOutcome(0, failures, restarts)
            unpacked = _unpacked(cfg, request)
            cfg, resume_from = _resize(cfg, request, shrink), Path(request["checkpoint"])
            restart_fresh = False
            continue
        statuses = rank_status.read_all(cfg.run_dir)
        failure = describe_failure(result.exit_code, result.output_tail, statuses)
        log.error("the MPI step failed: %s", failure.describe())
        repeated = failure.same_as(failures[-1] if failures else None)
        failures.append(failure)
        record = {**failure.to_event(), "attempt": attempt, "unix_s": time.time()}
        oom = take_out_of_memory(cfg.run_dir)
        if unpacked is not None and oom is not None:
            cfg, why = _fall_back(cfg, unpacked.cfg, oom, can_run, record)
            if why:
                return JobOutcome(result.exit_code, failures, restarts, gave_up=why)
            resume_from = newest_checkpoint(cfg.run_dir) or unpacked.checkpoint
            restart_fresh, unpacked = False, None
            continue
        why = _why_not_restart(cfg.fault.max_restarts, restarts, repeated, bool(statuses))
        if why:
            add_pending_failure(cfg.run_dir, {**record, "restarted": False})
            return JobOutcome(result.exit_code, failures, restarts, gave_up=why)
        restarts += 1
        resume_from = newest_checkpoint(cfg.run_dir)
        restart_fresh = resume_from is None
        add_pending_failure(
            cfg.run_dir,
            {**record, "restarted": True, "restart": restarts, "from": str(resume_from or "")},
        )
        log.warning(
            "restart %d of %d from %s",
            restarts,
            cfg.fault.max_restarts,
            resume_from or "the beginning (no complete checkpoint yet)",
        )
    log.error("the job needed more than %d MPI steps (resizes and restarts); stopping", MAX_STEPS)
    return JobOutcome(1, failures, restarts, gave_up=f"more than {MAX_STEPS} MPI steps")


def _clear_stale(run_dir: Path) -> None:
    """Remove what a launcher that died left behind: not this run's to act on."""
    take_request(run_dir)
    take_out_of_memory(run_dir)
    (run_dir / RESIZE_PHASES).unlink(missing_ok=True)


def _why_not_restart(
    max_restarts: int, restarts: int, repeated: bool, any_rank_started: bool
) -> str:
    """Why a failed step is not restarted ("" when it is): the restarts are used up, it failed
    the same way twice in a row, or no rank started."""
    if restarts >= max_restarts:
        return f"fault.max_restarts={max_restarts} restarts used"
    if repeated:
        return "it failed the same way at the same step twice in a row"
    if not any_rank_started:
        return "no rank started, so a restart would fail the same way"
    return ""


@dataclass(frozen=True)
class _Unpacked:
    """The job as it ran before a pack, and the pack's checkpoint (a fallback's start)."""

    cfg: JobConfig
    checkpoint: Path


def _unpacked(cfg: JobConfig, request: dict[str, Any]) -> _Unpacked:
    """The job as it ran before a pack: its stage count, on the partition it had then."""
    from_parts = request.get("from_parts")
    parts = [int(b) for b in from_parts] if from_parts else cfg.pipeline.partition
    before = resized_config(cfg, cfg.pipeline.num_stages, parts) if parts else cfg
    return _Unpacked(before, Path(request["checkpoint"]))


def _fall_back(
    cfg: JobConfig,
    unpacked: JobConfig,
    oom: dict[str, Any],
    can_run: CanRun | None,
    record: dict[str, Any],
) -> tuple[JobConfig, str]:
    """After a packed step ran out of memory: the pre-pack job, packing no further than above
    the size that failed (:func:`_raised_floors`), or ``cfg`` and why the job stops."""
    pipe, pre = cfg.pipeline, unpacked.pipeline
    packed, before = _size(pipe.replicas, pipe.num_stages), _size(pre.replicas, pre.num_stages)
    elastic = _raised_floors(unpacked, pipe.replicas, pipe.num_stages)
    floors = " ".join(
        f"elastic.{name}={value}"
        for name, value, lowered in (
            ("min_replicas", elastic.min_replicas, pipe.replicas < pre.replicas),
            ("min_stages", elastic.min_stages, pipe.num_stages < pre.num_stages),
        )
        if lowered
    )
    what = f"the packed step ({packed}) ran out of memory on rank {oom.get('rank')}"
    if can_run is None or not can_run(unpacked):
        why = (
            f"{what}, and the nodes of the {before} before the pack were released, so it "
            f"cannot fall back: resume from the newest checkpoint on {before} with {floors} "
            "(or give each node more memory)"
        )
        log.error("%s", why)
        add_pending_failure(cfg.run_dir, {**record, "restarted": False, "out_of_memory": oom})
        return cfg, why
    fallback = dataclasses.replace(unpacked, elastic=elastic)
    log.warning(
        "%s: falling back to the size before the pack (%s) on partition %s, packing no "
        "further than %s",
        what,
        before,
        fallback.pipeline.partition,
        floors,
    )
    add_pending_failure(
        cfg.run_dir,
        {
            **record,
            "restarted": True,
            "fallback_stages": pre.num_stages,
            "fallback_replicas": pre.replicas,
            "out_of_memory": oom,
        },
    )
    return fallback, ""


def _size(num_replicas: int, num_stages: int) -> str:
    """``"3 stages"`` for one pipeline, ``"2 replicas x 2 stages"`` otherwise (messages)."""
    if num_replicas == 1:
        return f"{num_stages} stages"
    return f"{num_replicas} replicas x {num_stages} stages"


def _raised_floors(unpacked: JobConfig, packed_replicas: int, packed_stages: int) -> ElasticSection:
    """The pre-pack job's ``elastic`` section with each floor the failed pack went below raised
    just above it: ``min_stages`` when the pack took stages away, ``min_replicas`` when it took
    replicas away (both when it did both: either may have caused the out-of-memory). A floor
    is never raised above the pre-pack size, so the fallback's config stays valid."""
    el, pre = unpacked.elastic, unpacked.pipeline
    min_stages, min_replicas = el.min_stages, el.min_replicas
    if packed_stages < pre.num_stages:
        min_stages = max(min_stages, packed_stages + 1)
    if packed_replicas < pre.replicas:
        min_replicas = max(min_replicas, packed_replicas + 1)
    return dataclasses.replace(el, min_stages=min_stages, min_replicas=min_replicas)


def _resize(cfg: JobConfig, request: dict[str, Any], shrink: Shrink) -> JobConfig:
    """Shrink for the step's resize request; returns the smaller job (phases go to its rank 0)."""
    exited_unix_s = time.time()
    step_exit_s = max(0.0, exited_unix_s - float(request["requested_unix_s"]))
    new_stages, parts = int(request["num_stages"]), [int(b) for b in request["parts"]]
    new_replicas = int(request.get("num_replicas") or cfg.pipeline.replicas)
    log.warning(
        "resize: %s after step %d (checkpoint %s)",
        size_change(cfg.pipeline.replicas, cfg.pipeline.num_stages, new_replicas, new_stages),
        request["step"],
        request["checkpoint"],
    )
    smaller = resized_config(cfg, new_stages, parts, new_replicas)
    try:
        shrink_s = shrink(smaller)
    except ShrinkRefused as exc:
        return _continue_unshrunk(cfg, request, str(exc))
    phases = {
        "from_stages": cfg.pipeline.num_stages,
        "to_stages": new_stages,
        "from_replicas": cfg.pipeline.replicas,
        "to_replicas": new_replicas,
        "step": request["step"],
        "checkpoint": request["checkpoint"],
        "checkpoint_s": request.get("checkpoint_s"),
        "step_exit_s": step_exit_s,
        "shrink_s": shrink_s,
        "relaunch_unix_s": time.time(),
        "request": request,
    }
    atomic_write_text(cfg.run_dir / RESIZE_PHASES, json.dumps(phases, indent=1))
    return smaller


def _continue_unshrunk(cfg: JobConfig, request: dict[str, Any], why: str) -> JobConfig:
    """After a refused shrink: the job on the stages it had (packing off), resuming from the
    pack's checkpoint; the refusal goes to the log now and to the run log with the next step."""
    log.error(
        "the shrink to %d stages was refused (%s); continuing on %d stages from %s, with packing "
        "off for the rest of this run",
        int(request["num_stages"]),
        why,
        cfg.pipeline.num_stages,
        request["checkpoint"],
    )
    add_pending_event(
        cfg.run_dir,
        "shrink_refused",
        {
            "step": int(request["step"]) - 1,
            "from_stages": cfg.pipeline.num_stages,
            "to_stages": int(request["num_stages"]),
            "checkpoint": str(request["checkpoint"]),
            "message": why,
            "unix_s": time.time(),
        },
    )
    return unshrunk_config(cfg)
