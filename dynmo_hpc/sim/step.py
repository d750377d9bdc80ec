"""Event-level simulation of one pipeline step: every forward and backward of every microbatch
on every stage, in the order the trainer's schedule runs them.

Why simulate rather than use the closed form of :func:`dynmo_hpc.balance.packing.
predict_step_time_s`: the closed form is exact only when all stages take the same time; with
unequal stages, a slow stage in the middle, or latency between stages, the bubble depends on
where the imbalance sits and on the schedule's order. The simulation follows the dependencies
themselves:

- forward ``i`` on stage ``s`` starts when stage ``s`` is free (its previous action is done)
  and forward ``i`` on stage ``s - 1`` has finished and its activations have arrived;
- backward ``i`` on stage ``s`` waits the same way for backward ``i`` on stage ``s + 1``;
- one transfer takes ``latency_s + activation_bytes / bandwidth_bytes_per_s`` and occupies
  neither stage's compute (sends are asynchronous; links never contend);
- optionally (both 0 by default): each action also takes ``action_overhead_s`` (posting its
  receive and send, the runner's Python), and after its schedule each stage spends its
  ``stage_overhead_s`` (optimizer, clipping). The trainer's clipping all-reduce waits for every
  stage's schedule and the gather that ends the step waits for every optimizer, so the step is
  the schedule's makespan plus the largest stage overhead.

How it stays fast: actions are processed in rounds, all stages at once with numpy. In each
round every stage whose next action has its input ready runs it, so the number of rounds is the
length of the longest chain of actions (``2M + 2P - 2`` for both schedules), and each round is a
handful of array operations over the stages. Measured on a shared 2-core machine
(``docs/simulate.md``): 1F1B with P=2048, M=4096 (16.8 million actions) in 2.6 s (median of
3), 0.5 GB peak memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dynmo_hpc.balance.common import check_parts, check_values
from dynmo_hpc.sim.orders import StageOrders, stage_orders
from dynmo_hpc.sim.shared_cores import run_shared, shared_tail_s
from dynmo_hpc.sim.wakeup import noticed_s

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class StepResult:
    """What one simulated step took, overall and per stage."""

    step_time_s: float
    """Makespan (from the first forward's start to the last backward's end) plus the largest
    stage overhead; without overheads, the makespan."""
    busy_s: list[float]
    """Per stage: seconds computing (its forwards and backwards, their action overheads and
    its stage overhead); wall seconds, stretched by sharing when ``cores`` is set."""
    idle_s: list[float]
    """Per stage: ``step_time_s - busy_s`` (bubble and waits for input)."""


def transfer_time_s(
    latency_s: float, bandwidth_bytes_per_s: float, activation_bytes: float
) -> float:
    """Seconds one activation (or its gradient) takes between neighbouring stages."""
    for name, value in (("latency_s", latency_s), ("activation_bytes", activation_bytes)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    if math.isnan(bandwidth_bytes_per_s) or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0")
    return latency_s + activation_bytes / bandwidth_bytes_per_s


def stage_times_s(
    layer_s: Sequence[float], parts: Sequence[int], num_microbatches: int
) -> list[float]:
    """Per-stage seconds per microbatch from per-layer seconds per step and a partition."""
    values = check_values(layer_s, "layer costs")
    checked = check_parts(parts, len(values))
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    bounds = np.asarray(checked)
    return [float(x) for x in (prefix[bounds[1:]] - prefix[bounds[:-1]]) / num_microbatches]


def _durations(values: Sequence[float], name: str, num_stages: int) -> FloatArray:
    array = np.asarray(check_values(values, name), dtype=np.float64)
    if array.shape != (num_stages,):
        raise ValueError(f"{name} has {array.size} entries; pass one per stage ({num_stages})")
    return array


def simulate_step(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    schedule: str = "1f1b",
    *,
    comm_s: float = 0.0,
    orders: StageOrders | None = None,
    action_overhead_s: float = 0.0,
    stage_overhead_s: Sequence[float] | None = None,
    cores: float | None = None,
    poll_max_s: float = 0.0,
    poll_yield_s: float = 0.0,
) -> StepResult:
    """Simulate one step of ``num_microbatches`` on ``len(forward_s)`` stages.

    Args:
        forward_s, backward_s: per stage, seconds of one microbatch's forward (backward).
        num_microbatches: M.
        schedule: ``"1f1b"`` or ``"gpipe"`` (``pipeline.schedule``).
        comm_s: seconds per transfer between neighbouring stages (:func:`transfer_time_s`).
        orders: explicit per-stage action orders instead of ``schedule``'s.
        action_overhead_s: seconds every forward and every backward takes besides its compute.
        stage_overhead_s: per stage, seconds after its schedule (optimizer and clipping);
            None: 0 on every stage.
        cores: the cores the stages' ranks share; None (or at least one per stage): every
            stage has a core of its own. Fewer: the durations are CPU seconds, and the busy
            stages share the cores (:mod:`dynmo_hpc.sim.shared_cores`), the tails too.
        poll_max_s: a waiting stage's longest sleep between tests; it notices an input late by
            :func:`dynmo_hpc.sim.wakeup.noticed_s`. 0: at once.
        poll_yield_s: where every stage has a core of its own, how long a wait yields the core
            before it sleeps (``runtime.wait_mode``'s window,
            :data:`dynmo_hpc.pipeline.waiting.WAIT_YIELD_S`). Stages that share cores sleep
            at once, as ``auto`` makes them.

    Example: GPipe, 2 stages, 2 microbatches, forward 1 s, backward 2 s, no communication:
    ``simulate_step([1, 1], [2, 2], 2, "gpipe").step_time_s == 9.0``.
    """
    num_stages = len(forward_s)
    if num_stages < 1:
        raise ValueError("forward_s must have one entry per stage (at least one)")
    fwd = _durations(forward_s, "forward_s", num_stages)
    bwd = _durations(backward_s, "backward_s", num_stages)
    checked = (
        ("comm_s", comm_s),
        ("action_overhead_s", action_overhead_s),
        ("poll_max_s", poll_max_s),
        ("poll_yield_s", poll_yield_s),
    )
    for name, value in checked:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    tail = (
        np.zeros(num_stages)
        if stage_overhead_s is None
        else _durations(stage_overhead_s, "stage_overhead_s", num_stages)
    )
    if orders is None:
        orders = stage_orders(schedule, num_stages, num_microbatches)
    elif orders.num_stages != num_stages or orders.num_microbatches != num_microbatches:
        raise ValueError("orders must have one row per stage and 2 actions per microbatch")
    if cores is not None and not (math.isfinite(cores) and cores > 0):
        raise ValueError(f"cores={cores!r} must be finite and > 0")
    f_s, b_s = fwd + action_overhead_s, bwd + action_overhead_s
    if cores is not None and cores < num_stages:
        end_s, busy = run_shared(
            orders, _dependencies(orders), f_s, b_s, comm_s, cores, poll_max_s=poll_max_s
        )
        tail_wall_s = shared_tail_s(tail, cores)
        step_time_s = float(end_s.max() + tail_wall_s.max())
        busy = busy + tail_wall_s
    else:
        end_s = _run_rounds(orders, f_s, b_s, comm_s, poll_max_s, poll_yield_s)
        step_time_s = float(end_s.max() + tail.max())
        busy = num_microbatches * (f_s + b_s) + tail
    return StepResult(
        step_time_s=step_time_s,
        busy_s=[float(x) for x in busy],
        idle_s=[float(step_time_s - x) for x in busy],
    )


def _dependencies(orders: StageOrders) -> npt.NDArray[np.intp]:
    """Per action (flat index ``s * (2M + 1) + k``), the flat index of the action on the
    neighbouring stage whose output it needs; row ``s`` ends with a padding action.

    Two extra slots follow the ``P * (2M + 1)`` actions: ``ALWAYS`` (an input that is always
    there: stage 0's forwards, the last stage's backwards) and ``NEVER`` (what a stage's
    padding action waits for, so a stage that is done never runs again). Because every stage
    runs its forwards, and its backwards, in microbatch order (checked here), forward ``i`` of
    stage ``s`` is the ``i``-th forward of its row, and its input is the ``i``-th forward of
    row ``s - 1``: a shift of one array instead of a search.
    """
    num_stages, num_microbatches = orders.num_stages, orders.num_microbatches
    row = 2 * num_microbatches + 1
    padded = np.ones((num_stages, row), dtype=bool)  # the padding column counts as neither
    padded[:, :-1] = orders.is_backward
    in_order = np.arange(num_microbatches)
    forwards = np.flatnonzero(~padded).reshape(num_stages, num_microbatches)
    padded[:, -1] = False
    backwards = np.flatnonzero(padded).reshape(num_stages, num_microbatches)
    flat_mb = orders.microbatch.ravel()
    unpad = np.arange(num_stages)[:, None]  # flat index in the padded rows minus this
    for name, flat in (("forwards", forwards), ("backwards", backwards)):
        if not np.array_equal(flat_mb[flat - unpad], np.broadcast_to(in_order, flat.shape)):
            raise ValueError(f"every stage must run its {name} in microbatch order")
    deps = np.full(num_stages * row, num_stages * row + 1, dtype=np.intp)  # NEVER
    deps[forwards[0]] = deps[backwards[-1]] = num_stages * row  # ALWAYS
    deps[forwards[1:]] = forwards[:-1]
    deps[backwards[:-1]] = backwards[1:]
    return deps


def _run_rounds(
    orders: StageOrders,
    fwd: FloatArray,
    bwd: FloatArray,
    comm_s: float,
    poll_max_s: float = 0.0,
    poll_yield_s: float = 0.0,
) -> FloatArray:
    """Each stage's finish time; see the module docstring for the round structure."""
    num_stages, num_microbatches = orders.num_stages, orders.num_microbatches
    row = 2 * num_microbatches + 1
    deps = _dependencies(orders)
    duration = np.zeros((num_stages, row))
    duration[:, :-1] = np.where(orders.is_backward, bwd[:, None], fwd[:, None])
    duration_flat = duration.ravel()
    end_s = np.zeros(num_stages * row + 2)
    end_s[-2] = -np.inf  # ALWAYS: the input is there before the step starts
    finished = np.zeros(num_stages * row + 2, dtype=bool)
    finished[-2] = True
    stages = np.arange(num_stages)
    next_action = stages * row  # flat index of each stage's next action
    free_s = np.zeros(num_stages)
    remaining = num_stages * (row - 1)
    while remaining:
        dep = deps[next_action]
        ready = finished[dep]
        count = int(np.count_nonzero(ready))
        if count == 0:
            raise ValueError("the action orders deadlock: no stage can run its next action")
        s, action = stages[ready], next_action[ready]
        start = noticed_s(end_s[dep[ready]] + comm_s, free_s[s], poll_max_s, poll_yield_s)
        finish = start + duration_flat[action]
        end_s[action] = finish
        finished[action] = True
        free_s[s] = finish
        next_action[s] += 1
        remaining -= count
    return free_s
