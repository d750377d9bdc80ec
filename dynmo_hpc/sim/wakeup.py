"""When a waiting rank notices that its input has arrived.

Why a module: the trainer's ranks never block in MPI to wait (a blocked rank may busy-poll and
steal a core from one that computes); they test, then sleep, each sleep twice the last up to a
cap (:func:`dynmo_hpc.pipeline.comm.poll_quietly`). So an input that arrives while its rank
sleeps waits for the sleep to end, and the longer the wait, the later it is noticed; where each
rank has a core of its own the wait yields the core for its first milliseconds instead of
sleeping (:mod:`dynmo_hpc.pipeline.waiting`), and only the rest of a longer wait sleeps. Both step
simulations (:mod:`.step` and :mod:`.shared_cores`) start an action at :func:`noticed_s`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def noticed_s(
    ready_s: FloatArray, free_s: FloatArray, poll_max_s: float, yield_s: float = 0.0
) -> FloatArray:
    """When a stage free since ``free_s`` notices an input that is there at ``ready_s``.

    ``poll_max_s`` is the back-off's cap (the trainer's:
    :data:`dynmo_hpc.pipeline.comm.WAIT_MAX_SLEEP_S`). After ``s`` seconds of sleeping the sleep
    in progress is between ``s / 2`` and ``s`` long (capped at ``poll_max_s``), so on average
    the input is noticed ``min(0.375 s, poll_max_s / 2)`` late. ``yield_s``: the wait's first
    seconds are spent yielding the core, not sleeping
    (:data:`dynmo_hpc.pipeline.waiting.WAIT_YIELD_S` where each rank has a core of its own), so
    a wait no longer than that is noticed at once and a longer one sleeps only for the rest. An
    input already there when the stage gets free costs nothing; ``poll_max_s = 0`` turns the
    term off.
    """
    if poll_max_s <= 0:
        return np.maximum(ready_s, free_s)
    wait_s = ready_s - free_s
    asleep_s = np.maximum(wait_s - yield_s, 0.0)
    late_s = np.minimum(0.375 * asleep_s, poll_max_s / 2)
    return np.where(wait_s > 0, ready_s + late_s, free_s)
