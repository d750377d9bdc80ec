"""What a resize stops training for, before one was measured: the packing decision's overhead.

A pack checkpoints, ends the MPI step, relaunches on fewer ranks and restores. Until the job has
resized once, the trainer estimates that pause from what it has measured in this launch: its own
start-up (launch to first step) plus one checkpoint write and one read, each taken as long as
the last checkpoint write, or, before any, as the state's bytes at an assumed disk speed.

Pure, so that the simulator applies the same rule to a run log's measurements
(:func:`dynmo_hpc.sim.runlog_traces.measured_restart_s`) and predicts the same decisions.
"""

from __future__ import annotations

import math

ASSUMED_CHECKPOINT_BYTES_PER_S = 1e8
"""Write (and read) speed assumed for a checkpoint before one was measured: about what the
development machine's shared disk gave (docs/benchmarks.md#checkpoints)."""


def estimated_restart_s(
    startup_s: float, last_checkpoint_s: float | None, state_bytes: float
) -> float:
    """Seconds a resize is expected to stop training: ``startup_s`` (a NaN start-up, unknown,
    counts 0) plus a checkpoint write and a restore, each ``last_checkpoint_s`` or, when no
    checkpoint was measured, ``state_bytes`` at :data:`ASSUMED_CHECKPOINT_BYTES_PER_S`."""
    checkpoint_s = (
        last_checkpoint_s
        if last_checkpoint_s is not None
        else state_bytes / ASSUMED_CHECKPOINT_BYTES_PER_S
    )
    startup = startup_s if math.isfinite(startup_s) else 0.0
    return max(0.0, startup) + 2.0 * checkpoint_s
