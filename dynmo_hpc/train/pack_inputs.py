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

from dynmo_hpc.balance.packing import PackPlan, PackRequest, microbatches_in_flight, plan_pack
from dynmo_hpc.balance.restart_overhead import estimated_restart_s
from dynmo_hpc.config import JobConfig
from dynmo_hpc.pipeline.costs import LoadReport
from dynmo_hpc.placement import ranks_per_node
from dynmo_hpc.train import capacity


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
    """What one stage may hold: ``balance.capacity_bytes``; on a GPU its free memory plus this
    stage's own reserve, less a headroom; on a CPU the smallest of the RAM, ``--mem``
    (``SLURM_MEM_PER_NODE``) and the cgroup limit, shared by the ranks on the host
    (:mod:`dynmo_hpc.train.capacity`)."""
    if cfg.balance.capacity_bytes is not None:
        return float(cfg.balance.capacity_bytes)
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        return capacity.device_capacity_bytes(
            free_bytes, total_bytes, torch.cuda.memory_reserved(device)
        )
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return capacity.host_capacity_bytes(
        float(ram_bytes),
        ranks_on_host,
        slurm_mem_bytes=capacity.slurm_mem_per_node_bytes(os.environ),
        cgroup_limit_bytes=capacity.read_cgroup_limit_bytes(),
    )


@dataclass(frozen=True)
class LayerMemory:
    """Per layer: the bytes it holds whatever the schedule, and per microbatch in flight."""

    fixed_bytes: list[float]
    """Weights, gradients and optimizer state."""
    activation_bytes: list[float]
    """The stage's measured peak over its state, per microbatch its stage held in flight,
    shared by its layers in proportion to their state (runtime overhead included: the safe
    side)."""


def layer_memory(
    report: LoadReport, parts: Sequence[int], num_microbatches: int, schedule: str
) -> LayerMemory:
    """Split each stage's measured peak into its layers' state and activations per microbatch
    in flight (stage ``s`` of ``P`` held :func:`microbatches_in_flight` of them: ``P - s`` under
    1F1B). The packing decision prices a layer at the worst stage of a candidate, stage 0."""
    state = [float(b) for b in report.layer_bytes]
    activations = [0.0] * len(state)
    num_stages = len(parts) - 1
    for stage, peak in enumerate(report.peak_mem_bytes or []):
        layers = range(parts[stage], parts[stage + 1])
        stage_state = sum(state[i] for i in layers)
        held = microbatches_in_flight(num_stages - stage, num_microbatches, schedule)
        per_microbatch = max(0.0, float(peak) - stage_state) / max(1, held)
        for i in layers:
            share = state[i] / stage_state if stage_state > 0 else 1.0 / len(layers)
            activations[i] = per_microbatch * share
    return LayerMemory(state, activations)


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
    return estimated_restart_s(startup_s, last_checkpoint_s, state_bytes)


@dataclass
class PackHistory:
    """What one packing decision hands the next, across resizes and restarts (saved in the
    checkpoint's run state as ``pack``): without the original size every launch would judge
    against its own and the job could ratchet down one stage at a time.

    The reference itself is not carried as a number: a maximum over calibrated predictions
    rises with every lucky (quiet-machine) measurement and would block packs for good. It is
    recomputed at each decision as the best partition at ``original_stages`` on the current
    smoothed costs, under the same calibration as the candidates, so their ratio is the
    model's alone (:mod:`dynmo_hpc.balance.packing`)."""

    original_stages: int
    """The job's stage count before any pack."""
    correction: float = 1.0
    """Measured / predicted tokens/s of the last pack (``pack_result``), capped at 1."""
    original_replicas: int = 1
    """The job's replica count before any pack."""

    def to_state(self) -> dict[str, Any]:
        return {
            "original_stages": self.original_stages,
            "original_replicas": self.original_replicas,
            "correction": self.correction,
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any] | None,
        num_stages: int,
        num_replicas: int = 1,
        *,
        num_microbatches: int | None = None,
    ) -> PackHistory:
        """From a checkpoint's ``pack`` entry; a fresh history at ``num_replicas`` x
        ``num_stages`` when it has none (a new run, or a checkpoint written before the entry
        existed). ``num_microbatches``: the job's ``train.num_microbatches`` now; an original
        replica count that no longer divides it (an accepted change of the global batch) is
        taken down to the largest count that does, never below ``num_replicas``: the reference
        size must be one the job could run."""
        if not isinstance(state, dict):
            return cls(num_stages, original_replicas=num_replicas)
        correction = state.get("correction")
        original_replicas = int(state.get("original_replicas") or num_replicas)
        if num_microbatches is not None:
            original_replicas = runnable_replicas(original_replicas, num_replicas, num_microbatches)
        return cls(
            int(state.get("original_stages") or num_stages),
            float(correction)
            if isinstance(correction, int | float) and 0 < correction <= 1
            else 1.0,
            original_replicas,
        )

    def learn(self, result: dict[str, Any] | None) -> None:
        """Take a ``pack_result``'s measured / predicted ratio as the next correction."""
        ratio = (result or {}).get("measured_over_predicted")
        if isinstance(ratio, int | float) and math.isfinite(ratio) and ratio > 0:
            self.correction = min(1.0, float(ratio))


def runnable_replicas(original_replicas: int, num_replicas: int, num_microbatches: int) -> int:
    """The largest replica count at most ``original_replicas`` (and at least ``num_replicas``,
    which divides the batch) that divides ``num_microbatches``.

    Example: ``runnable_replicas(4, 2, 6) == 3``; ``runnable_replicas(4, 1, 5) == 1``."""
    for r in range(max(original_replicas, num_replicas), num_replicas, -1):
        if num_microbatches % r == 0:
            return r
    return num_replicas


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
    history: PackHistory,
    allreduce_s: float = 0.0,
) -> PackPlan:
    """The packing decision for this report (rank 0); ``allreduce_s``: the measured gradient
    all-reduce per step (the slowest rank's), which fewer replicas shrink or remove."""
    el = cfg.elastic
    replicas = cfg.pipeline.replicas
    per_replica = cfg.train.num_microbatches // replicas
    memory = layer_memory(report, parts, per_replica, cfg.pipeline.schedule)
    request = PackRequest(
        num_microbatches=cfg.train.num_microbatches,
        tokens_per_step=float(cfg.tokens_per_step),
        ranks_per_node=shape.ranks_per_node,
        steps_left=steps_left,
        restart_overhead_s=overhead_s,
        pack_policy=el.policy,
        max_slowdown=el.max_slowdown,
        min_stages=el.min_stages,
        min_replicas=el.min_replicas,
        memory_bytes=memory.fixed_bytes,
        activation_bytes=memory.activation_bytes,
        schedule=cfg.pipeline.schedule,
        capacity_bytes=capacity_bytes,
        comm_s=activation_message_s(cfg, bandwidth_bytes_per_s),
        num_cpu_slots=shape.num_cpu_slots,
        measured_step_s=measured_step_s,
        original_stages=history.original_stages,
        correction=history.correction,
        num_replicas=replicas,
        original_replicas=history.original_replicas,
        allreduce_s=allreduce_s,
    )
    return plan_pack(list(costs_s), list(parts), request)


class PackController:
    """Rank 0's packing state over a launch: when to decide, what the last resize cost, the
    prediction a pack made (to log beside what was measured after it), and the
    :class:`PackHistory` carried from launch to launch."""

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
        self.history = PackHistory(cfg.pipeline.num_stages, original_replicas=cfg.pipeline.replicas)

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take the history a checkpoint's run state carried (its ``pack`` entry)."""
        pipeline = self.cfg.pipeline
        self.history = PackHistory.from_state(
            state,
            pipeline.num_stages,
            pipeline.replicas,
            num_microbatches=self.cfg.train.num_microbatches,
        )

    def run_state(self) -> dict[str, Any]:
        """The ``pack`` entry of a checkpoint's run state."""
        return self.history.to_state()

    def consider(
        self,
        report: LoadReport,
        costs_s: Sequence[float],
        parts: Sequence[int],
        *,
        bandwidth_bytes_per_s: float,
        measured_step_s: float | None,
        allreduce_s: float = 0.0,
    ) -> PackPlan | None:
        """The packing decision at this report, or None when none is due (nothing smaller to
        go to: ``elastic.min_replicas`` replicas of ``elastic.min_stages`` stages)."""
        el = self.cfg.elastic
        if not el.enabled:
            return None
        self.num_reports += 1
        steps_left = self.cfg.train.steps - (report.step + 1)
        at_floor = len(parts) - 1 <= el.min_stages and self.cfg.pipeline.replicas <= el.min_replicas
        if self.num_reports % el.interval or steps_left <= 0 or at_floor:
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
            history=self.history,
            allreduce_s=allreduce_s,
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
        "from_replicas": phases.get("from_replicas", 1),
        "to_replicas": phases.get("to_replicas", 1),
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
