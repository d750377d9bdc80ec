"""Rank 0's side of packing: turn a load report into the packing decision's inputs.

The decision itself is pure (:func:`dynmo_hpc.balance.packing.plan_pack`); this module measures
what it needs from the running job: the allocation's shape (ranks per node under SLURM; locally
every rank is a worker of its own, and the ranks share the machine's cores), the memory each
layer needs and what a stage may hold, the activation message time, and the restart overhead.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dynmo_hpc.balance.packing import PackPlan, PackRequest, plan_pack
from dynmo_hpc.config import JobConfig
from dynmo_hpc.pipeline.costs import LoadReport
from dynmo_hpc.placement import ranks_per_node

ASSUMED_CHECKPOINT_BYTES_PER_S = 1e8
"""Write (and read) speed assumed for a checkpoint before one was measured: about what the
development machine's shared disk gave (docs/benchmarks.md#checkpoints)."""


@dataclass(frozen=True)
class AllocationShape:
    """How the job's ranks sit on nodes, as the packing decision needs it."""

    ranks_per_node: int
    """Ranks a node holds: SLURM's layout, or 1 locally (each rank a releasable worker)."""
    num_cpu_slots: int | None
    """Cores the ranks share when that limits them (local CPU runs), else None."""
    under_slurm: bool


def allocation_shape(world_size: int, num_nodes: int, device: torch.device) -> AllocationShape:
    """The shape of this job (environment only; called on every rank alike)."""
    if os.environ.get("SLURM_JOB_ID"):
        return AllocationShape(ranks_per_node(world_size, num_nodes), None, True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    slots = cores if device.type == "cpu" and cores else None
    return AllocationShape(1, slots, False)


def stage_capacity_bytes(cfg: JobConfig, device: torch.device, ranks_on_host: int) -> float:
    """What one stage may hold: ``balance.capacity_bytes``, the GPU's memory, or this host's RAM
    shared by the ranks on it."""
    if cfg.balance.capacity_bytes is not None:
        return float(cfg.balance.capacity_bytes)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(ram_bytes) / max(1, ranks_on_host)


def layer_memory_bytes(report: LoadReport, parts: Sequence[int]) -> list[float]:
    """Per layer: its state bytes (weights, gradients, AdamW) scaled by its stage's measured
    peak over state, so activations and runtime overhead travel with the layers (an
    overestimate for packing, which is the safe side)."""
    state = [float(b) for b in report.layer_bytes]
    out = list(state)
    for stage, peak in enumerate(report.peak_mem_bytes or []):
        layers = range(parts[stage], parts[stage + 1])
        stage_state = sum(state[i] for i in layers)
        if peak > 0 and stage_state > 0:
            scale = max(1.0, peak / stage_state)
            for i in layers:
                out[i] = state[i] * scale
    return out


def activation_message_s(cfg: JobConfig, bandwidth_bytes_per_s: float) -> float:
    """Seconds to send one microbatch's activations (float32) between stages."""
    if not bandwidth_bytes_per_s or not math.isfinite(bandwidth_bytes_per_s):
        return 0.0
    message_bytes = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model * 4
    return message_bytes / bandwidth_bytes_per_s


def restart_overhead_s(
    cfg: JobConfig,
    *,
    startup_s: float,
    last_checkpoint_s: float | None,
    last_resize_s: float | None,
    state_bytes: float,
) -> float:
    """Seconds a resize stops training: ``elastic.restart_overhead_s``, else the last resize's
    measured total, else this launch's start-up plus a checkpoint write and a restore."""
    if cfg.elastic.restart_overhead_s is not None:
        return float(cfg.elastic.restart_overhead_s)
    if last_resize_s is not None:
        return last_resize_s
    checkpoint_s = (
        last_checkpoint_s
        if last_checkpoint_s is not None
        else state_bytes / ASSUMED_CHECKPOINT_BYTES_PER_S
    )
    return max(0.0, startup_s) + 2.0 * checkpoint_s


def decide_pack(
    cfg: JobConfig,
    report: LoadReport,
    costs_s: Sequence[float],
    parts: Sequence[int],
    *,
    shape: AllocationShape,
    capacity_bytes: float,
    bandwidth_bytes_per_s: float,
    steps_left: int,
    overhead_s: float,
    measured_step_s: float | None,
) -> PackPlan:
    """The packing decision for this report (rank 0)."""
    el = cfg.elastic
    request = PackRequest(
        num_microbatches=cfg.train.num_microbatches,
        tokens_per_step=float(cfg.tokens_per_step),
        ranks_per_node=shape.ranks_per_node,
        steps_left=steps_left,
        restart_overhead_s=overhead_s,
        pack_policy=el.policy,
        max_slowdown=el.max_slowdown,
        min_stages=el.min_stages,
        memory_bytes=layer_memory_bytes(report, parts),
        capacity_bytes=capacity_bytes,
        comm_s=activation_message_s(cfg, bandwidth_bytes_per_s),
        num_cpu_slots=shape.num_cpu_slots,
        measured_step_s=measured_step_s,
    )
    return plan_pack(list(costs_s), list(parts), request)


class PackController:
    """Rank 0's packing state over a launch: when to decide, what the last resize cost, and
    the prediction a pack made, to log beside what was measured after it."""

    def __init__(
        self, cfg: JobConfig, world_size: int, num_nodes: int, device: torch.device
    ) -> None:
        self.cfg = cfg
        self.shape = allocation_shape(world_size, num_nodes, device)
        on_host = self.shape.ranks_per_node if self.shape.under_slurm else world_size
        self.capacity_bytes = stage_capacity_bytes(cfg, device, on_host)
        self.num_reports = 0
        self.startup_s = 0.0
        """Seconds from the launcher starting this step to the trainer being ready."""
        self.last_checkpoint_s: float | None = None
        self.last_resize_s: float | None = None
        """The previous resize's measured total (from the manager's phases), once there is one."""
        self.predicted_tokens_per_s: float | None = None
        """What the pack that started this launch predicted; checked at the first report."""

    def consider(
        self,
        report: LoadReport,
        costs_s: Sequence[float],
        parts: Sequence[int],
        *,
        bandwidth_bytes_per_s: float,
        measured_step_s: float | None,
    ) -> PackPlan | None:
        """The packing decision at this report, or None when none is due."""
        el = self.cfg.elastic
        if not el.enabled:
            return None
        self.num_reports += 1
        steps_left = self.cfg.train.steps - (report.step + 1)
        if self.num_reports % el.interval or steps_left <= 0 or len(parts) - 1 <= el.min_stages:
            return None
        overhead_s = restart_overhead_s(
            self.cfg,
            startup_s=self.startup_s,
            last_checkpoint_s=self.last_checkpoint_s,
            last_resize_s=self.last_resize_s,
            state_bytes=float(sum(report.layer_bytes)),
        )
        return decide_pack(
            self.cfg,
            report,
            costs_s,
            parts,
            shape=self.shape,
            capacity_bytes=self.capacity_bytes,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            steps_left=steps_left,
            overhead_s=overhead_s,
            measured_step_s=measured_step_s,
        )


def resize_event(
    phases: dict[str, Any], restore_s: float, now_unix_s: float, num_nodes: int
) -> dict[str, Any]:
    """The ``resize`` event's detail: the manager's phases plus the new step's relaunch and
    restore, and the total the next packing decision takes as the restart overhead.

    ``from_nodes``/``to_nodes`` are the plan's (workers locally, SLURM nodes on a cluster);
    ``hosts`` is how many distinct hosts the new step's ranks run on."""
    relaunch_s = max(0.0, now_unix_s - float(phases["relaunch_unix_s"]) - restore_s)
    timed = {
        "checkpoint_s": float(phases.get("checkpoint_s") or 0.0),
        "step_exit_s": float(phases["step_exit_s"]),
        "shrink_s": float(phases["shrink_s"]),
        "relaunch_s": relaunch_s,
        "restore_s": restore_s,
    }
    request = phases.get("request", {})
    return {
        "from_stages": phases["from_stages"],
        "to_stages": phases["to_stages"],
        "from_nodes": request.get("from_nodes"),
        "to_nodes": request.get("to_nodes", num_nodes),
        "hosts": num_nodes,
        "checkpoint": phases["checkpoint"],
        **timed,
        "total_s": sum(timed.values()),
        "predicted_tokens_per_s_before": request.get("predicted_tokens_per_s_before"),
        "predicted_tokens_per_s_after": request.get("predicted_tokens_per_s_after"),
        "measured_tokens_per_s_before": request.get("measured_tokens_per_s_before"),
    }


def pack_result_event(
    predicted_tokens_per_s: float | None, tokens_per_s_since: Sequence[float]
) -> dict[str, Any] | None:
    """The ``pack_result`` detail: measured tokens/s since the pack beside its prediction."""
    if predicted_tokens_per_s is None or not tokens_per_s_since:
        return None
    measured = float(statistics.median(tokens_per_s_since))
    return {
        "predicted_tokens_per_s": predicted_tokens_per_s,
        "measured_tokens_per_s": measured,
        "measured_over_predicted": measured / predicted_tokens_per_s
        if predicted_tokens_per_s
        else None,
        "num_steps": len(tokens_per_s_since),
    }
