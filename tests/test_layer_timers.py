"""Per-layer costs stay right when torch uses several threads per rank.

A layer's work does not change with ``runtime.threads_per_rank``; how it is measured must not
either. The old measure (the calling thread's CPU time) misses what torch's intra-op threads do;
the timer ``make_timer`` picks for several threads counts every thread's CPU time. CPU time, not
wall clock, so a busy machine slows both runs alike; bounds are generous.
"""

from __future__ import annotations

import os

import pytest
import torch

from dynmo_hpc.pipeline.device import CpuProcessTimer, CpuThreadTimer, make_timer


def _layer_work(timers: list, reps: int = 6) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    )
    x = torch.randn(1024, 512)
    for _ in range(reps):
        for t in timers:
            t.start()
        layer(x).square().mean().backward()
        for t in reversed(timers):
            t.stop()


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_make_timer_follows_the_thread_count():
    cpu = torch.device("cpu")
    assert isinstance(make_timer(cpu, threads=1), CpuThreadTimer)
    timer = make_timer(cpu, threads=4)
    assert isinstance(timer, CpuProcessTimer) and timer.threads == 4


def test_layer_cost_counts_the_intra_op_threads(restore_threads):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores for a second intra-op thread")
    torch.set_num_threads(1)
    one = make_timer(torch.device("cpu"))
    assert isinstance(one, CpuThreadTimer)
    _layer_work([one])
    torch.set_num_threads(2)
    two, thread_only = make_timer(torch.device("cpu")), CpuThreadTimer()
    assert isinstance(two, CpuProcessTimer) and two.threads == 2
    _layer_work([two, thread_only])

    work_1, work_2 = one.seconds(), two.core_seconds()
    # The same work is measured with 1 or 2 threads (spinning OpenMP workers may add some).
    assert 0.7 * work_1 < work_2 < 3.0 * work_1, (work_1, work_2)
    # The calling thread alone misses the second thread's share: what the old timer reported.
    assert thread_only.seconds() < 0.85 * work_2, (thread_only.seconds(), work_2)
    # The reported cost is per thread: the layer's time on the rank's 2 cores.
    assert two.seconds() == pytest.approx(work_2 / 2)
    assert 0.3 * work_1 < two.seconds() < 1.5 * work_1
