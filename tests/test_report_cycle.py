"""The shared helpers of the load-report cycle and of rank placement (one definition each)."""

from __future__ import annotations

from dynmo_hpc.pipeline.costs import CostTracker
from dynmo_hpc.placement import ranks_per_node
from dynmo_hpc.report_cycle import is_report_step, smooth_costs


def test_report_steps_are_every_interval_and_the_last() -> None:
    assert [s for s in range(12) if is_report_step(s, 5, 12)] == [4, 9, 11]
    assert [s for s in range(3) if is_report_step(s, 1, 3)] == [0, 1, 2]


def test_smoothing_is_the_trackers_average() -> None:
    assert smooth_costs([1.0, 2.0], None, 0.5) == [1.0, 2.0]
    assert smooth_costs([3.0, 2.0], [1.0, 4.0], 0.25) == [1.5, 3.5]
    tracker = CostTracker(num_layers=2, smoothing=0.25)
    tracker.update([0.5, 1.0], [0.5, 1.0])
    assert tracker.update([2.0, 1.0], [1.0, 1.0]) == [1.5, 2.0]


def test_ranks_per_node_prefers_slurms_layout() -> None:
    assert ranks_per_node(5, 2) == 3
    assert ranks_per_node(4, 4) == 1
    assert ranks_per_node(3, 0) == 3
    assert ranks_per_node(5, 3, [2, 2, 1]) == 2
