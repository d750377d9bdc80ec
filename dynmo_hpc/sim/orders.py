"""Each stage's action order as arrays: the schedules of :mod:`dynmo_hpc.pipeline.schedule`,
in a form a simulator can index in bulk.

Why not the :class:`~dynmo_hpc.pipeline.schedule.Action` lists themselves: building them costs
about a microsecond per action, i.e. over 20 s for 2048 stages and 4096 microbatches, ten times
longer than simulating the step. So the same phase structure (warmup forwards, alternating steady
state, cooldown backwards) is written here once more as array operations, and
``tests/test_simulate.py`` checks that it equals the trainer's lists for every stage over a grid
of stage and microbatch counts; a change to a schedule fails that test instead of silently
making the simulator disagree with the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dynmo_hpc.pipeline.schedule import SCHEDULES, Action

IntArray = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class StageOrders:
    """Row ``s`` is stage ``s``'s actions in execution order (``2 * M`` per stage)."""

    is_backward: BoolArray
    """Shape ``(P, 2M)``: True for a backward, False for a forward."""
    microbatch: IntArray
    """Shape ``(P, 2M)``: the microbatch each action works on."""

    @property
    def num_stages(self) -> int:
        return int(self.is_backward.shape[0])

    @property
    def num_microbatches(self) -> int:
        return int(self.is_backward.shape[1]) // 2


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"num_stages({num_stages}) and num_microbatches({num_microbatches}) must be >= 1"
        )


def _gpipe(num_stages: int, num_microbatches: int) -> StageOrders:
    row_bwd = np.repeat([False, True], num_microbatches)
    row_mb = np.tile(np.arange(num_microbatches), 2)
    return StageOrders(
        np.tile(row_bwd, (num_stages, 1)), np.tile(row_mb, (num_stages, 1)).astype(np.int32)
    )


def _one_f_one_b(num_stages: int, num_microbatches: int, extra: int = 0) -> StageOrders:
    """Stage ``s`` with ``w = min(P - s - 1, M)`` warmup forwards: ``w`` forwards, then
    ``M - w`` (forward, backward) pairs, then ``w`` backwards; each kind in microbatch order.
    ``extra``: more warmup forwards on every stage but the last (1 for ``1f1b-slack``).

    In int32 and with one cumulative sum (the ``i``-th backward of a row is microbatch ``i``),
    because at P=2048, M=4096 these arrays hold 16.8 million entries.
    """
    m = num_microbatches
    stage = np.arange(num_stages, dtype=np.int32)[:, None]
    ahead = np.where(stage < num_stages - 1, extra, 0)  # 1f1b-slack: one more, not on the last
    warmup = np.minimum(num_stages - 1 - stage + ahead, m)
    k = np.arange(2 * m, dtype=np.int32)[None, :]
    is_backward = (k >= 2 * m - warmup) | ((k >= warmup) & (((k + warmup) & 1) == 1))
    backwards_so_far = np.cumsum(is_backward, axis=1, dtype=np.int32)
    microbatch = np.where(is_backward, backwards_so_far - 1, k - backwards_so_far)
    return StageOrders(is_backward, microbatch.astype(np.int32, copy=False))


def _one_f_one_b_slack(num_stages: int, num_microbatches: int) -> StageOrders:
    return _one_f_one_b(num_stages, num_microbatches, extra=1)


_BUILDERS = {"1f1b": _one_f_one_b, "1f1b-slack": _one_f_one_b_slack, "gpipe": _gpipe}


def stage_orders(schedule: str, num_stages: int, num_microbatches: int) -> StageOrders:
    """The action order of every stage under ``schedule`` (a ``pipeline.schedule`` name)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    _check(num_stages, num_microbatches)
    return _BUILDERS[schedule](num_stages, num_microbatches)


def orders_from_actions(actions_per_stage: list[list[Action]]) -> StageOrders:
    """Arrays from explicit per-stage action lists (any schedule with ``2M`` actions a stage)."""
    is_backward = np.array([[a.kind == "B" for a in row] for row in actions_per_stage], dtype=bool)
    microbatch = np.array(
        [[a.microbatch for a in row] for row in actions_per_stage], dtype=np.int32
    )
    if is_backward.ndim != 2 or is_backward.shape[1] % 2:
        raise ValueError("every stage must list the same number of actions, 2 per microbatch")
    return StageOrders(is_backward, microbatch)
