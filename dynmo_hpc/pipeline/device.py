"""Device choice and layer timers: CPU time on CPU, CUDA events on GPU.

Why CPU time on CPU: with more ranks than cores (the normal case on a laptop or a CI box),
wall-clock time per layer includes time the OS gave to other ranks, so it scatters far more
than the thread's CPU time does. With one torch thread per rank
the calling thread's CPU time is the layer's cost. With ``runtime.threads_per_rank > 1`` it is
not: torch's intra-op threads do part of every matmul, and the calling thread's clock misses
their work (and stops while it waits for them). Then the process's CPU time (all threads) is
measured and divided by the thread count: the layer's seconds on the rank's cores when its
threads run in parallel, still immune to time given to other ranks. On GPU, kernels run
asynchronously, so host clocks measure launch time; CUDA events measure the kernels.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Protocol

import torch


def local_rank() -> int:
    """This process's index on its node, from the launcher's environment."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def pick_device(preference: str) -> torch.device:
    """``cpu``, ``cuda`` (GPU = local rank modulo visible GPUs) or ``auto``."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        index = local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if preference == "cuda":
        raise RuntimeError(
            "runtime.device=cuda but torch sees no CUDA device; "
            "HINT: use runtime.device=auto or cpu, or install a CUDA build of torch"
        )
    return torch.device("cpu")


class LayerTimer(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def seconds(self) -> float: ...


class CpuThreadTimer:
    """Accumulates thread CPU time between start/stop pairs."""

    def __init__(self) -> None:
        self._total_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.thread_time()

    def stop(self) -> None:
        self._total_s += time.thread_time() - self._t0

    def seconds(self) -> float:
        return self._total_s


class CpuProcessTimer:
    """Accumulates the process's CPU time (every thread) between start/stop pairs, reported per
    thread: ``threads`` intra-op threads working in parallel for 1 s report 1 s."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._core_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.process_time()

    def stop(self) -> None:
        self._core_s += time.process_time() - self._t0

    def core_seconds(self) -> float:
        """CPU seconds summed over all threads (the work done)."""
        return self._core_s

    def seconds(self) -> float:
        return self._core_s / self.threads


class CudaEventTimer:
    """Accumulates kernel time between start/stop pairs with CUDA events (read after the step)."""

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pairs.append((event, event))

    def stop(self) -> None:
        start, _ = self._pairs[-1]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pairs[-1] = (start, end)

    def seconds(self) -> float:
        if not self._pairs:
            return 0.0
        self._pairs[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in self._pairs) / 1e3


def make_timer(device: torch.device, threads: int | None = None) -> LayerTimer:
    """CUDA events on a GPU; on CPU thread CPU time with one torch thread, else process CPU time
    per thread (``threads`` defaults to torch's intra-op thread count, set from
    ``runtime.threads_per_rank``)."""
    if device.type == "cuda":
        return CudaEventTimer()
    threads = torch.get_num_threads() if threads is None else threads
    return CpuThreadTimer() if threads <= 1 else CpuProcessTimer(threads)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank so far: the CUDA allocator's peak, or the process's max RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib) * (1 if sys.platform == "darwin" else 1024)
