"""One pipeline step when the ranks share fewer cores than there are stages.

Why: with more ranks than cores (4 stages on a 2-core machine, or several ranks per node with
one core each), a stage's layers do not run at a fixed speed. While every stage computes, each
gets ``cores / P`` of a core; in the bubble, while some stages wait (asleep: waiting ranks do not
spin), the ones still computing get up to a whole core each. One wall-per-CPU ratio per step
stretches the bubble as much as the steady state, so it over-predicts pipelines with a large
bubble. Here the cores
are shared explicitly, at every moment, among the stages with work in hand, the way the Linux
scheduler (CFS) shares them:

- **Each rank has a home core** (:func:`home_cores`). The kernel's load balancer evens out the
  cores' *loads* (how much of the time their tasks are runnable), not their task counts, so a
  rank that computes most of the step keeps a core to itself while the light ranks share the
  other: on 2 cores, stages costing 0.06, 0.13 and 0.20 CPU seconds a step go {0.20} and
  {0.06, 0.13}. The ranks on one core split it equally while they run together (CFS's
  fairness); so the heaviest stage runs at full speed even while all three compute, where
  pooling the cores (``cores / n`` each) would slow it to two thirds.
- **No core idles while another has a queue** (the kernel's idle balancing pulls a waiting
  task over): the capacity of cores whose ranks all wait goes to the ranks that share a core,
  equally, up to a whole core each.

With a whole number of cores each running stage gets ``1 / (running stages on its home core)``
plus its part of the idle cores; with a fractional ``cores`` (a share of a machine, not cores
one can place a rank on) the cores are pooled: ``min(1, cores / n)`` each. Either way the rates
are divided by ``wall_s_per_cpu_s`` for the load of other processes (by the caller).

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
BoolArray = npt.NDArray[np.bool_]

_EPS = 1e-12
"""Relative slack when deciding that a share of work is done (float rounding)."""


def shared_rate(num_active: int, cores: float) -> float:
    """CPU seconds per wall second each of ``num_active`` busy ranks gets on ``cores`` pooled
    cores."""
    return 1.0 if num_active <= cores else cores / num_active


def home_cores(load_s: FloatArray, cores: float) -> IntpArray | None:
    """Each stage's home core, the cores' loads as even as the stages allow; None where
    ``cores`` is not a whole number (pooled sharing).

    Heaviest stage first (ties: the lower stage), each onto the core with the least load so
    far (ties: the lower core): the placement the load balancer converges to when one load
    per stage (its CPU seconds per step, ``load_s``) stays put over the step.
    """
    if cores != math.floor(cores):
        return None
    home = np.zeros(len(load_s), dtype=np.intp)
    core_load = np.zeros(int(cores))
    for stage in np.argsort(-np.asarray(load_s, dtype=np.float64), kind="stable"):
        core = int(np.argmin(core_load))
        home[stage] = core
        core_load[core] += load_s[stage]
    return home


def placed_rates(running: BoolArray, home: IntpArray | None, cores: float) -> FloatArray:
    """CPU seconds per wall second of each stage (0 where not ``running``).

    Pooled (``home`` None): :func:`shared_rate`. Placed: ``1 / n`` for ``n`` running stages on
    the stage's home core, then the idle cores' capacity shared equally among the stages below
    a whole core, water-filled up to 1. Invariants: each rate is in (0, 1]; the rates sum to
    ``min(running stages, cores)`` (no core idles while a stage waits for one).
    """
    num_active = int(np.count_nonzero(running))
    if home is None:
        return np.where(running, shared_rate(num_active, cores), 0.0)
    per_core = np.bincount(home[running], minlength=int(cores))
    rates = np.where(running, 1.0 / np.maximum(per_core[home], 1), 0.0)
    spare = float(np.count_nonzero(per_core == 0))
    while spare > _EPS:
        short = running & (rates < 1.0 - _EPS)
        if not short.any():
            break
        give = min(spare / int(np.count_nonzero(short)), float((1.0 - rates[short]).min()))
        rates[short] += give
        spare -= give * int(np.count_nonzero(short))
    return rates


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
    """Each stage's finish time and its wall seconds computing, the cores shared as the module says.

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
    home = home_cores(num_microbatches * (fwd + bwd), cores)
    now_s = 0.0
    while True:
        waiting = ~running & (next_action < last_action)
        # inf while the input is not made; else when this stage notices it
        arrive_s = noticed_s(end_s[deps[next_action]] + comm_s, free_s, poll_max_s)
        start = waiting & (arrive_s <= now_s)
        running |= start
        left_s[start] = work_flat[next_action[start]]
        pending = arrive_s[waiting & ~start]
        next_arrival_s = float(pending.min()) if pending.size else math.inf
        if not running.any():
            if not math.isfinite(next_arrival_s):
                if np.any(next_action < last_action):
                    raise ValueError("the action orders deadlock: no stage can run its next action")
                return free_s, busy_s
            now_s = next_arrival_s
            continue
        rate = placed_rates(running, home, cores)
        finish_in_s = np.where(running, left_s / np.where(running, rate, 1.0), np.inf)
        first = int(np.argmin(finish_in_s))
        to_finish_s = float(finish_in_s[first])
        dt_s = min(to_finish_s, next_arrival_s - now_s)
        now_s += dt_s
        busy_s[running] += dt_s
        left_s[running] -= dt_s * rate[running]
        done = running & (left_s <= _EPS * np.maximum(work_flat[next_action], 1e-300))
        if dt_s == to_finish_s:  # the action that set the step is done, whatever the rounding
            done[first] = True
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
