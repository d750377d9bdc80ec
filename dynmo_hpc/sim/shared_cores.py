"""One pipeline step when the ranks share fewer cores than there are stages.

Why: with more ranks than cores (4 stages on a 2-core machine, or several ranks per node with
one core each), a stage's layers do not run at a fixed speed. While every stage computes, each
gets ``cores / P`` of a core; in the bubble, while some stages wait (asleep: waiting ranks do not
spin), the ones still computing get up to a whole core each. One wall-per-CPU ratio per step
stretches the bubble as much as the steady state, so it over-predicts pipelines with a large
bubble. Here the cores
are shared explicitly, as processor sharing: at every moment the ``n`` stages with work in hand
each run at ``min(1, cores / n)`` CPU seconds per wall second, times ``1 / wall_s_per_cpu_s``
for the load of other processes.

The event loop advances from one event to the next: an action finishing, or an activation
arriving at a stage that waits for it. Each event costs a few numpy operations over the stages,
so a step costs O(actions x stages): milliseconds for the few stages of one machine, far too slow
for thousands (which is why :func:`dynmo_hpc.sim.step.simulate_step` takes this path only when
``cores`` is less than the number of stages).

Pure: arrays in, arrays out.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from dynmo_hpc.sim.orders import StageOrders
from dynmo_hpc.sim.wakeup import noticed_s

FloatArray = npt.NDArray[np.float64]
IntpArray = npt.NDArray[np.intp]

_EPS = 1e-12
"""Relative slack when deciding that a share of work is done (float rounding)."""


def shared_rate(num_active: int, cores: float) -> float:
    """CPU seconds per wall second each of ``num_active`` busy ranks gets on ``cores`` cores."""
    return 1.0 if num_active <= cores else cores / num_active


def run_shared(
    orders: StageOrders,
    deps: IntpArray,
    fwd: FloatArray,
    bwd: FloatArray,
    comm_s: float,
    cores: float,
    *,
    poll_max_s: float = 0.0,
) -> tuple[FloatArray, FloatArray]:
    """Each stage's finish time and its wall seconds computing, with processor sharing.

    ``deps`` is :func:`dynmo_hpc.sim.step._dependencies` of ``orders`` (the flat index of the
    action whose output each action needs; the two slots after the actions mean "always there"
    and "never"). ``fwd`` and ``bwd`` are per-stage CPU seconds of one action, already divided
    by any external speed factor; ``comm_s`` is the time from an action's end to its output's
    arrival on the neighbour; a waiting stage notices it as
    :func:`dynmo_hpc.sim.wakeup.noticed_s` says (``poll_max_s``).
    """

    if not (math.isfinite(cores) and cores > 0):
        raise ValueError(f"cores={cores!r} must be finite and > 0")
    num_stages, num_microbatches = orders.num_stages, orders.num_microbatches
    row = 2 * num_microbatches + 1
    work = np.zeros((num_stages, row))
    work[:, :-1] = np.where(orders.is_backward, bwd[:, None], fwd[:, None])
    work_flat = work.ravel()
    end_s = np.full(num_stages * row + 2, np.inf)
    end_s[-2] = -np.inf  # ALWAYS
    stages = np.arange(num_stages)
    next_action = stages * row
    last_action = next_action + row - 1  # the padding column: this stage is done
    running = np.zeros(num_stages, dtype=bool)
    left_s = np.zeros(num_stages)  # CPU seconds left of the running action
    busy_s = np.zeros(num_stages)
    free_s = np.zeros(num_stages)
    now_s = 0.0
    while True:
        waiting = ~running & (next_action < last_action)
        # inf while the input is not made; else when this stage notices it
        arrive_s = noticed_s(end_s[deps[next_action]] + comm_s, free_s, poll_max_s)
        start = waiting & (arrive_s <= now_s)
        running |= start
        left_s[start] = work_flat[next_action[start]]
        num_active = int(np.count_nonzero(running))
        pending = arrive_s[waiting & ~start]
        next_arrival_s = float(pending.min()) if pending.size else math.inf
        if num_active == 0:
            if not math.isfinite(next_arrival_s):
                if np.any(next_action < last_action):
                    raise ValueError("the action orders deadlock: no stage can run its next action")
                return free_s, busy_s
            now_s = next_arrival_s
            continue
        rate = shared_rate(num_active, cores)
        to_finish_s = float(left_s[running].min()) / rate
        dt_s = min(to_finish_s, next_arrival_s - now_s)
        now_s += dt_s
        busy_s[running] += dt_s
        left_s[running] -= dt_s * rate
        done = running & (left_s <= _EPS * np.maximum(work_flat[next_action], 1e-300))
        if dt_s == to_finish_s:  # the action that set the step is done, whatever the rounding
            done |= running & (left_s <= float(left_s[running].min()))
        finished = next_action[done]
        end_s[finished] = now_s
        free_s[done] = now_s
        next_action[done] += 1
        running &= ~done


def shared_tail_s(tails_s: FloatArray, cores: float) -> FloatArray:
    """Per stage, wall seconds until its tail (CPU seconds ``tails_s``, all starting at once) is
    done with processor sharing on ``cores`` cores: the shortest finishes first, and the others
    then share the cores it leaves."""
    tails = np.asarray(tails_s, dtype=np.float64)
    order = np.argsort(tails, kind="stable")
    finish_s = np.zeros_like(tails)
    elapsed_s, done_work = 0.0, 0.0
    for i, stage in enumerate(order):
        elapsed_s += (tails[stage] - done_work) / shared_rate(len(tails) - i, cores)
        done_work = float(tails[stage])
        finish_s[stage] = elapsed_s
    return finish_s
