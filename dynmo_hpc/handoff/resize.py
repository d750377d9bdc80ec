"""The resize cycle shared by every backend: the ranks ask, the manager shrinks and relaunches.

An MPI step cannot drop ranks, and SLURM kills any step still running on a released node, so a
pack is a restart onto fewer ranks:

1. rank 0 decides to pack and broadcasts it (:mod:`dynmo_hpc.train.trainer`);
2. every rank writes the checkpoint;
3. rank 0 writes ``resize_request.json`` (the new replica and stage counts, the partition,
   the checkpoint)
   and the step exits 0 without a ``result.json``: the status that asks for a resize;
4. the manager (:func:`~dynmo_hpc.launch.supervisor.supervise`, the process outside the step)
   takes the request and asks its backend to shrink: locally nothing to do, under SLURM
   ``scontrol update`` keeping its own node, then the resize environment
   (:mod:`dynmo_hpc.slurm.resize`);
5. it starts a new step on the remaining ranks, resuming from that checkpoint; the phases it
   timed go to the new step in ``resize_phases.json``, and its rank 0 logs them with its own
   restore time as one ``resize`` event.

One loop serves ``dynmo-hpc run`` (local ``mpiexec``) and the SLURM manager alike.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text
from dynmo_hpc.config import JobConfig

RESIZE_REQUEST = "resize_request.json"
"""Written by rank 0 after the pack checkpoint: the step asks for a resize."""
RESIZE_PHASES = "resize_phases.json"
"""Written by the manager before relaunching: the phases it timed, for the new step's log."""


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


def size_change(from_replicas: int, from_stages: int, to_replicas: int, to_stages: int) -> str:
    """``"4 -> 2 stages"`` for one pipeline, ``"2 x 2 -> 1 x 2 (replicas x stages)"`` when
    either side has replicas (logs and the report)."""
    if from_replicas == 1 and to_replicas == 1:
        return f"{from_stages} -> {to_stages} stages"
    return f"{from_replicas} x {from_stages} -> {to_replicas} x {to_stages} (replicas x stages)"


def resized_config(
    cfg: JobConfig, num_stages: int, parts: list[int], num_replicas: int | None = None
) -> JobConfig:
    """The job on ``num_stages`` stages with the planned partition, in ``num_replicas``
    replicas (None: as many as now); everything else as it was (the global batch too)."""
    replicas = cfg.pipeline.replicas if num_replicas is None else num_replicas
    pipeline = dataclasses.replace(
        cfg.pipeline, num_stages=num_stages, partition=list(parts), replicas=replicas
    )
    return dataclasses.replace(cfg, pipeline=pipeline)


class ShrinkRefused(Exception):
    """The scheduler refused to release nodes (``scontrol update`` failed or did not answer).

    Raised by a backend's shrink; the supervisor then keeps the nodes and continues the job at
    the size it had, from the pack's checkpoint (:func:`unshrunk_config`), instead of ending a
    healthy job that still holds its checkpoint and its whole allocation.
    """


def unshrunk_config(cfg: JobConfig) -> JobConfig:
    """The job at the size it has now, with packing off: after a refused shrink, asking again
    at the next load report would checkpoint, end the step and be refused the same way."""
    return dataclasses.replace(cfg, elastic=dataclasses.replace(cfg.elastic, enabled=False))
