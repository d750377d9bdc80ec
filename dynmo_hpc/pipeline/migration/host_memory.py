"""Huge-page host memory for layer storages, and a pool that recycles it between migrations.

Why migration needs its own host memory (``benchmarks/bench_migration.py`` and
``benchmarks/profile_migration.py`` measure both effects; figures in docs/benchmarks.md,
"Migration"):

- **Huge pages on the sending side.** Local MPI moves a large message with one copy that the
  receiver makes out of the sender's memory. Out of memory torch allocated itself (4 KiB pages:
  torch does not ask for transparent huge pages) that copy is much slower than out of a numpy
  allocation (which asks for huge pages from 4 MiB): a layer's storages are copied into one
  huge-page *arena* per layer once (:func:`rehome`), after its optimizer has state, and
  a layer that arrives by migration lands in one.
- **Recycled memory on the receiving side.** Receiving into fresh memory pays the kernel's page
  faults and zeroing (``profile_migration.py`` times the exchange into fresh and into recycled
  memory side by side). When a layer leaves a rank its arena returns to this process's
  :class:`ArenaPool` (once no tensor uses it any more), and the next layer to arrive is received
  into it. A rebalance that moves a layer back and forth between two neighbours (the common
  case as load drifts) then never faults; a rank that receives more than it gave away takes
  fresh memory, exactly as before.

An arena is handed out only when every tensor over its memory is gone: each storage keeps its
numpy slice alive, and a finalizer on each slice tells the pool when the last one dies. The pool
keeps at most ``max_free_arenas`` free arenas (two layers' worth by default); older ones go back
to the operating system.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN_BYTES = 4096
"""Where each buffer starts inside its arena (page-aligned, as a tensor's own allocation)."""

LARGE_STORAGE_BYTES = 64 << 10
"""Storages above this size live in a layer's arena; smaller ones (AdamW's step counts, norms,
biases) travel inside a migration's pickle and stay where torch put them."""

MAX_FIT_RATIO = 1.25
"""A free arena is reused only for a request at least 1/1.25 of its size, so that a small layer
does not pin a large arena."""


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where buffers of ``sizes`` bytes start when laid out page-aligned in one allocation, and
    the allocation's size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, total


class ArenaPool:
    """Hands out page-aligned host buffers carved from one numpy allocation per request, and
    takes the allocation back for reuse once every buffer carved from it is gone."""

    def __init__(self, max_free_arenas: int = 2) -> None:
        self.max_free_arenas = max_free_arenas
        self.enabled = True
        """False within :meth:`fresh`: requests take fresh memory."""
        self._free: list[np.ndarray] = []
        """Arenas no tensor uses, oldest first."""
        self._live: dict[int, list[Any]] = {}
        """id(arena) -> [arena, number of its buffers still alive]."""
        self._lock = threading.Lock()
        self.reused = 0
        """How many requests were served from the free list (for tests and benchmarks)."""

    def buffers(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """uint8 CPU tensors of ``sizes`` bytes, each page-aligned, all from one arena (a free
        one when one fits, else fresh memory). Their contents are undefined."""
        offsets, total = aligned_offsets(sizes)
        arena = self._take(total)
        views = [arena[a : a + n] for a, n in zip(offsets, sizes, strict=True)]
        with self._lock:
            self._live[id(arena)] = [arena, len(views)]
        for view in views:
            weakref.finalize(view, self._release, id(arena))
        return [torch.from_numpy(view) for view in views]

    def _take(self, total: int) -> np.ndarray:
        with self._lock:
            if self.enabled:
                fits = [a for a in self._free if total <= a.size <= MAX_FIT_RATIO * total]
                if fits:
                    arena = min(fits, key=lambda a: a.size)
                    self._free = [a for a in self._free if a is not arena]
                    self.reused += 1
                    return arena
        # numpy asks the kernel for transparent huge pages on allocations of 4 MiB and more.
        return np.empty(max(total, 1), dtype=np.uint8)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._live[key]
            if self.max_free_arenas > 0:
                self._free.append(entry[0])
                del self._free[: -self.max_free_arenas]

    def free_bytes(self) -> int:
        """Bytes held in free arenas, waiting for the next arrival."""
        with self._lock:
            return sum(a.size for a in self._free)

    @contextmanager
    def fresh(self) -> Iterator[None]:
        """Within the block, requests take fresh memory (arenas released meanwhile are still
        kept): what a layer's first move into a rank costs, before it has memory to recycle."""
        with self._lock:
            saved, self.enabled = self.enabled, False
        try:
            yield
        finally:
            with self._lock:
                self.enabled = saved


POOL = ArenaPool()
"""This process's pool (one rank per process)."""


def _large_storages(tensors: Sequence[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > LARGE_STORAGE_BYTES:
            found.setdefault(storage.data_ptr(), storage)
    return found


def in_one_arena(tensors: Sequence[torch.Tensor], pool: ArenaPool = POOL) -> bool:
    """Whether every large storage among ``tensors`` is a buffer of one arena of ``pool``."""
    storages = list(_large_storages(tensors).values())
    if not storages:
        return True
    with pool._lock:
        arenas = list(pool._live.values())
    for arena, _ in arenas:
        start = arena.ctypes.data
        end = start + arena.size
        if all(start <= s.data_ptr() < end for s in storages):
            return True
    return False


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""The attributes every ``nn.Module`` has (parameter, buffer, submodule and hook tables):
:func:`layer_tensors` reads the parameter and buffer tables directly and skips the rest, so it
looks only at what a layer's own code set."""


def layer_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a layer owns: parameters, buffers (persistent or not), optimizer state, and
    tensors that a submodule holds as plain attributes (a view of a weight, say), directly or
    in a list, tuple or dict: :func:`rehome` must re-point every tensor over a storage it
    moves, or such a view would silently keep the old memory. A tensor may be listed twice.

    One pass over the submodules' own tables, not ``parameters()`` and ``buffers()`` plus a
    scan of every attribute: on a migration's critical path (the receiver waits for the header
    this walk precedes), and the full scan costs several times as much."""
    found: list[torch.Tensor] = []
    for sub in module.modules():
        attrs = vars(sub)
        found += [p for p in attrs["_parameters"].values() if p is not None]
        found += [b for b in attrs["_buffers"].values() if b is not None]
        for name, value in attrs.items():
            if name in _MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found += [v for v in value if isinstance(v, torch.Tensor)]
            elif isinstance(value, dict):
                found += [v for v in value.values() if isinstance(v, torch.Tensor)]
    for entry in optimizer.state.values():
        found += [value for value in entry.values() if isinstance(value, torch.Tensor)]
    return found


def rehome(tensors: Sequence[torch.Tensor], pool: ArenaPool = POOL) -> int:
    """Move the large CPU storages under ``tensors`` into one arena of ``pool``; returns bytes.

    Every tensor keeps its identity (``tensor.data`` is re-pointed, so parameters stay the
    optimizer's keys and scheme code holding a mask still holds it), its dtype, shape, strides
    and values, bit for bit; tensors that shared a storage still share one. Run it between
    steps, with no autograd graph alive over these tensors."""
    storages = _large_storages([t for t in tensors if t.device.type == "cpu"])
    if not storages:
        return 0
    keys = list(storages)
    buffers = pool.buffers([storages[k].nbytes() for k in keys])
    new_storage: dict[int, torch.UntypedStorage] = {}
    for key, buffer in zip(keys, buffers, strict=True):
        old = torch.empty(0, dtype=torch.uint8).set_(storages[key])
        buffer.copy_(old)
        new_storage[key] = buffer.untyped_storage()
    for tensor in tensors:  # a tensor listed twice is skipped the second time: already moved
        storage = new_storage.get(tensor.untyped_storage().data_ptr())
        if storage is None or tensor.device.type != "cpu":
            continue
        moved = torch.empty(0, dtype=tensor.dtype).set_(
            storage, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        with torch.no_grad():
            tensor.data = moved
    return sum(int(b.numel()) for b in buffers)
