"""The resize cycle shared by every backend: the ranks ask, the manager shrinks and relaunches.

An MPI step cannot drop ranks, and SLURM kills any step still running on a released node, so a
pack is a restart onto fewer ranks:

1. rank 0 decides to pack and broadcasts it (:mod:`dynmo_hpc.pipeline.trainer`);
2. every rank writes the checkpoint;
3. rank 0 writes ``resize_request.json`` (the new stage count and partition, the checkpoint)
   and the step exits 0 without a ``result.json``: the status that asks for a resize;
4. the manager (:func:`run_elastic`, the process outside the step) takes the request and asks
   its backend to shrink: locally nothing to do, under SLURM ``scontrol update`` keeping its
   own node, then the resize environment (:mod:`dynmo_hpc.slurm.resize`);
5. it starts a new step on the remaining ranks, resuming from that checkpoint; the phases it
   timed go to the new step in ``resize_phases.json``, and its rank 0 logs them with its own
   restore time as one ``resize`` event.

One loop serves ``dynmo-hpc run`` (local ``mpiexec``) and the SLURM manager alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.config import JobConfig
from dynmo_hpc.launch.rundir import prepare_run_dir

log = logging.getLogger(__name__)

RESIZE_REQUEST = "resize_request.json"
"""Written by rank 0 after the pack checkpoint: the step asks for a resize."""
RESIZE_PHASES = "resize_phases.json"
"""Written by the manager before relaunching: the phases it timed, for the new step's log."""
MAX_RESIZES = 64
"""A job that asks to shrink more often than this is looping: stop it."""


def write_request(run_dir: Path, request: dict[str, Any]) -> None:
    """Rank 0: ask the manager for a resize (atomically, so it never reads half a request)."""
    atomic_write_text(run_dir / RESIZE_REQUEST, json.dumps(request, indent=1))


def _take(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, removed once read; None when there is none."""
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    path.unlink()
    return data


def take_request(run_dir: Path) -> dict[str, Any] | None:
    """The manager: the pending resize request (removed from the run directory), or None."""
    return _take(run_dir / RESIZE_REQUEST)


def take_phases(run_dir: Path) -> dict[str, Any] | None:
    """The new step's rank 0: the phases the manager timed (removed once read), or None."""
    return _take(run_dir / RESIZE_PHASES)


def resized_config(cfg: JobConfig, num_stages: int, parts: list[int]) -> JobConfig:
    """The job on ``num_stages`` stages with the planned partition (everything else as it was)."""
    pipeline = dataclasses.replace(cfg.pipeline, num_stages=num_stages, partition=list(parts))
    return dataclasses.replace(cfg, pipeline=pipeline)


RunStep = Callable[[JobConfig, Path, Path | None], int]
"""Start one MPI step of ``cfg`` (its config file, the checkpoint to resume from); exit code."""
Shrink = Callable[[JobConfig], float]
"""Release what ``cfg`` (the smaller job) no longer needs; returns the seconds it took."""


def run_elastic(
    cfg: JobConfig, run_step: RunStep, shrink: Shrink, resume_from: Path | None = None
) -> int:
    """Run the job's MPI steps until one ends without asking for a resize; its exit code.

    Raises nothing of its own: a failed step's exit code is returned as it is.
    """
    for _ in range(MAX_RESIZES + 1):
        config_path = prepare_run_dir(cfg)
        rc = run_step(cfg, config_path, resume_from)
        request = take_request(cfg.run_dir)
        if rc != 0 or request is None:
            return rc
        exited_unix_s = time.time()
        step_exit_s = max(0.0, exited_unix_s - float(request["requested_unix_s"]))
        new_stages, parts = int(request["num_stages"]), [int(b) for b in request["parts"]]
        log.warning(
            "resize: %d -> %d stages after step %d (checkpoint %s)",
            cfg.pipeline.num_stages,
            new_stages,
            request["step"],
            request["checkpoint"],
        )
        smaller = resized_config(cfg, new_stages, parts)
        shrink_s = shrink(smaller)
        phases = {
            "from_stages": cfg.pipeline.num_stages,
            "to_stages": new_stages,
            "step": request["step"],
            "checkpoint": request["checkpoint"],
            "checkpoint_s": request.get("checkpoint_s"),
            "step_exit_s": step_exit_s,
            "shrink_s": shrink_s,
            "relaunch_unix_s": time.time(),
            "request": request,
        }
        atomic_write_text(cfg.run_dir / RESIZE_PHASES, json.dumps(phases, indent=1))
        cfg, resume_from = smaller, Path(request["checkpoint"])
    log.error("the job asked for more than %d resizes; stopping", MAX_RESIZES)
    return 1
