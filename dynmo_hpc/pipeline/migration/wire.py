"""Checksummed bulk transfer between ranks: many byte buffers, all in flight at once, verified.

What: :func:`exchange` sends a set of byte buffers (a layer's storages) to each peer and
receives each peer's, in chunks, with an XXH3 digest per chunk checked on arrival. A mismatch
is reported, not raised, so that every peer drains and the caller can decide collectively.

Why a module of its own: a migration is only as fast as this loop, and done naively its phases
run one after the other (the sender hashes everything, the bytes move, the receiver hashes them
again while the sender waits). Here they overlap:

- Buffers go out in chunks (:data:`CHUNK_BYTES`), each its own ``Isend``/``Irecv``. A sender
  posts all its sends at once, so all moves of a rebalance are in flight together, each pair of
  ranks on its own point-to-point link. A receiver keeps a small window of chunk receives
  posted (:meth:`_Exchange._post_receives`): one chunk from a rank on its node, several from
  another node, because shared-memory MPI copies a waiting chunk inside the receiver's own MPI
  calls.
- The receiver hashes each chunk in its main thread as soon as it lands. The sender hashes each
  chunk in step with the receiver's copy of it (:meth:`_Exchange._hash_ahead`), so that both
  read the chunk's memory at the same time and it crosses from memory to the caches once. The
  sender starts after the meta is out (the meta is on the receiver's critical path). The
  digests follow the data as a small trailer. On a single node the receiver's hash is the
  largest cost a migration adds to a bare ``Send``: see docs/benchmarks.md ("Migration").
- Nothing is copied to serialise: the sender's chunks are views of the tensors' own memory (a
  layer's storages live in one huge-page arena, see :mod:`.host_memory`); the receiver receives
  into one arena per transfer, recycled from a layer it gave away when it can, whose slices
  become the rebuilt tensors' storages (see :mod:`.move` and :func:`_receive_buffers`).
- Waits yield the core for a moment before they sleep
  (:class:`~dynmo_hpc.pipeline.comm.Backoff`): a sleep ends late, and a migration is a chain of
  short waits. A sender whose sends are still being copied sleeps at once, leaving the cores
  to the copy and the hashing.
- The collective that agrees on the outcome is posted as soon as this rank's part is known
  (``on_received``), while its sends still drain.

Message layout per transfer (MPI keeps messages with one tag in order): on ``tag``, a header
``[buffer count, buffer sizes..., the sender's node, its digest]`` then the meta (pickled
object graph, made while the buffers travel) with its digest appended; on ``tag + 1``, every
chunk of every buffer in order, then the chunk digests. The receiver verifies the meta on
arrival and may rebuild its objects over the buffers before they are full; the buffers are
verified when the digests come.

Invariants: when :func:`exchange` returns, every send and receive it posted has completed,
whatever the digests said (no peer is left blocked), and every incoming transfer's trailer has
been compared, so ``Incoming.error`` is final; a transfer's chunks travel in order on one tag.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from mpi4py import MPI

from dynmo_hpc.pipeline.comm import MIGRATION_YIELD_S, Backoff, fine_timer_slack
from dynmo_hpc.pipeline.migration.host_memory import POOL, aligned_offsets

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Chunk size: large enough that the per-message cost is small beside its transfer, small
enough that hashing a chunk starts soon after it lands and a window of chunks stays small.
Chosen by timing (``benchmarks/bench_migration.py``; docs/benchmarks.md, "Migration")."""

RECV_WINDOW_LOCAL = 1
"""Chunk receives in flight per transfer from a rank on the same node (see
:meth:`_Exchange._post_receives`)."""

RECV_WINDOW_REMOTE = 4
"""Chunk receives in flight per transfer from a rank on another node."""


@functools.cache
def node_id() -> int:
    """This process's node, as a 63-bit number (the hash of MPI's processor name): the header
    carries it, so a receiver knows whether the sender shares its node without a collective."""
    return xxhash.xxh3_64_intdigest(MPI.Get_processor_name().encode()) >> 1


MIN_TAG_UB = 32767
"""The smallest tag upper bound the MPI standard allows (what we assume if MPI does not say)."""


def digest(data: Any) -> int:
    """XXH3-64 of a buffer (a numpy array or bytes), as a signed int64 for an MPI message."""
    value = xxhash.xxh3_64_intdigest(data)
    return value - (1 << 64) if value >= 1 << 63 else value


def tag_upper_bound(comm: MPI.Comm) -> int:
    """This MPI's largest tag (``MPI_TAG_UB``); the standard's minimum if it does not say."""
    value = comm.Get_attr(MPI.TAG_UB)
    return int(value) if value else MIN_TAG_UB


def check_tag_space(highest_tag: int, tag_ub: int, what: str) -> None:
    """Raise if ``highest_tag`` exceeds the MPI tag limit, naming ``what`` needs the tags."""
    if highest_tag > tag_ub:
        raise ValueError(
            f"{what} needs MPI tags up to {highest_tag}, but this MPI's MPI_TAG_UB is {tag_ub}; "
            "HINT: move fewer layers at once (fewer stages or layers), or use an MPI with a "
            "larger tag space (Open MPI and MPICH allow 2**31-1 on most transports)"
        )


def chunk_views(buffer: torch.Tensor, chunk_bytes: int) -> list[np.ndarray]:
    """Contiguous numpy views of ``buffer`` (a 1-D uint8 host tensor), ``chunk_bytes`` each."""
    flat = buffer.numpy()
    return [flat[a : a + chunk_bytes] for a in range(0, flat.size, chunk_bytes)]


@dataclass
class Outgoing:
    """A set of buffers for one peer: ``buffers`` (contiguous uint8 host tensors, sent from
    their own memory) and ``meta`` (small bytes, or a function making them, called once the
    buffers are in flight so that serialising overlaps the transfer)."""

    dst: int
    tag: int
    meta: bytes | Callable[[], bytes]
    buffers: list[torch.Tensor]
    meta_bytes: int = 0
    """Size of the meta once made."""
    _requests: list[Any] = field(default_factory=list)
    _chunk_requests: list[Any] = field(default_factory=list)
    """One send per chunk, in order (the receiver takes them in order)."""
    _digests: list[int] = field(default_factory=list)
    """The digests of the chunks hashed so far (see :meth:`_Exchange._hash_ahead`)."""
    _views: list[np.ndarray] = field(default_factory=list)
    """The chunks: numpy views of the buffers, which MPI reads from and the sender hashes."""
    _keep: list[Any] = field(default_factory=list)
    """The header, framed meta and trailer arrays, alive until the sends complete."""


@dataclass
class Incoming:
    """What one peer will send on ``tag``; filled in as it arrives."""

    src: int
    tag: int
    on_meta: Callable[[Incoming], None] | None = None
    """Called (main thread) as soon as the verified meta is here, while buffers may still be
    arriving: the receiver can rebuild its objects over the buffers in the meantime. It must
    not read the buffers' data."""
    meta: bytes = b""
    buffers: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None
    """Why the data cannot be trusted (a digest mismatch), or None."""
    bad_chunks: list[int] = field(default_factory=list)
    """Global chunk numbers whose digests did not match (see :func:`locate_chunk`)."""
    _chunks: list[np.ndarray] = field(default_factory=list)
    _trailer: np.ndarray | None = None
    _digests: dict[int, int] = field(default_factory=dict)
    _stage: int = 0
    """0: awaiting the header, 1: awaiting the meta, 2: meta in."""
    _next_chunk: int = 0
    """The first chunk whose receive is not posted yet."""
    _trailer_posted: bool = False
    _window: int = 1
    """Chunk receives in flight (see :meth:`_Exchange._post_receives`)."""


def _header(item: Outgoing) -> np.ndarray:
    """``[buffer count, sizes..., sender's node_id, digest]``."""
    sizes = [int(b.numel()) for b in item.buffers]
    arr = np.array([len(sizes), *sizes, node_id(), 0], np.int64)
    arr[-1] = digest(arr[:-1])
    return arr


def exchange(
    comm: MPI.Comm,
    outgoing: Sequence[Outgoing],
    incoming: Sequence[Incoming],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    pin_memory: bool = False,
    max_sleep_s: float = 1e-4,
    on_chunk: Callable[[Incoming, int, np.ndarray], None] | None = None,
    window: int | None = None,
    yield_s: float = MIGRATION_YIELD_S,
    on_received: Callable[[], Sequence[Any]] | None = None,
) -> None:
    """Send every ``outgoing`` and receive every ``incoming`` concurrently; verify on arrival.

    Returns when all data has been sent and received. A digest mismatch does not raise: it sets
    ``Incoming.error`` (the rest still drains, so no peer is left blocked in a send) and the
    caller decides collectively. ``pin_memory`` allocates receive buffers in page-locked memory
    (for a following copy to a GPU). ``on_chunk`` sees each received chunk before it is hashed
    (fault injection in tests: what a bit flip on the wire would look like). ``window``: chunk
    receives in flight per transfer (default: by the sender's node, see
    :meth:`_Exchange._post_receives`). ``yield_s``: how long
    a wait yields the core before it sleeps (:class:`~dynmo_hpc.pipeline.comm.Backoff`).

    ``on_received`` is called once every incoming transfer is in and verified and every trailer
    is posted, while this rank's sends may still be draining. It may post nonblocking requests
    (the collective that agrees on the outcome), which the loop then waits for together with
    the sends: a sender need not first wait for its sends and only then start the agreement.
    """
    if window is not None and window < 1:
        raise ValueError(f"window={window!r} must be >= 1")
    with fine_timer_slack():
        _Exchange(comm, chunk_bytes, pin_memory, on_chunk, window).run(
            outgoing, incoming, Backoff(max_sleep_s, yield_s), on_received
        )


def _receive_buffers(sizes: Sequence[int], pin_memory: bool) -> list[torch.Tensor]:
    """Host buffers of ``sizes`` bytes that will become tensor storages on the receiver: one
    huge-page arena per transfer, recycled when this rank gave a layer away before
    (:mod:`.host_memory` says why both matter). Pinned buffers (staging for a GPU, never tensor
    storages) are carved from one pinned tensor instead."""
    if not pin_memory:
        return POOL.buffers(sizes)
    offsets, total = aligned_offsets(sizes)
    pinned = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    return [pinned[a : a + n] for a, n in zip(offsets, sizes, strict=True)]


class _Exchange:
    """One call of :func:`exchange`: the posted requests and what each one completes."""

    def __init__(
        self,
        comm: MPI.Comm,
        chunk_bytes: int,
        pin_memory: bool,
        on_chunk: Callable[[Incoming, int, np.ndarray], None] | None,
        window: int | None,
    ) -> None:
        self.comm, self.chunk_bytes, self.window = comm, chunk_bytes, window
        self.pin_memory, self.on_chunk = pin_memory, on_chunk
        self.recv_requests: list[Any] = []
        self.recv_targets: list[tuple[Incoming, int]] = []  # chunk index, or -1: the trailer
        self.send_requests: list[Any] = []

    def _post_sends(self, item: Outgoing) -> None:
        comm, tag = self.comm, item.tag
        views = [v for b in item.buffers for v in chunk_views(b, self.chunk_bytes)]
        header = _header(item)
        item._requests.append(comm.Isend(header, dest=item.dst, tag=tag))
        item._chunk_requests = [
            comm.Isend([v, MPI.BYTE], dest=item.dst, tag=tag + 1) for v in views
        ]
        item._requests += item._chunk_requests
        item._views, item._keep = views, [header]

    def _hash_ahead(self, item: Outgoing) -> bool:
        """Hash the chunks whose turn has come; True if it hashed any.

        Chunk ``k`` is hashed once the send of chunk ``k - 1`` is complete, that is while the
        receiver copies chunk ``k`` (or just before): the receiver's copy and this hash then
        read the same memory at the same time, and it crosses from memory to the caches once.
        It runs after the meta is sent: the meta is on the receiver's critical path."""
        views = item._views
        hashed = False
        while len(item._digests) < len(views):
            k = len(item._digests)
            if k > 0 and not item._chunk_requests[k - 1].Test():
                break
            item._digests.append(digest(views[k]))
            hashed = True
        return hashed

    def _post_meta(self, item: Outgoing) -> None:
        meta = item.meta() if callable(item.meta) else item.meta
        item.meta_bytes = len(meta)
        framed = np.empty(len(meta) + 8, dtype=np.uint8)
        framed[:-8] = np.frombuffer(meta, dtype=np.uint8)
        framed[-8:].view(np.int64)[0] = digest(framed[:-8])
        item._keep.append(framed)
        item._requests.append(self.comm.Isend([framed, MPI.BYTE], dest=item.dst, tag=item.tag))

    def _take_header(self, item: Incoming) -> bool:
        status = MPI.Status()
        if not self.comm.Iprobe(source=item.src, tag=item.tag, status=status):
            return False
        header = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
        self.comm.Recv(header, source=item.src, tag=item.tag)
        if digest(header[:-1]) != int(header[-1]):
            raise RuntimeError(
                f"migration header from rank {item.src} (tag {item.tag}) is corrupt; "
                "HINT: the transport damaged a message; rerun, and check the "
                "interconnect if it repeats"
            )
        count = int(header[0])
        sizes = [int(n) for n in header[1 : 1 + count]]
        item._window = self.window or (
            RECV_WINDOW_LOCAL if int(header[1 + count]) == node_id() else RECV_WINDOW_REMOTE
        )
        item.buffers = _receive_buffers(sizes, self.pin_memory)
        item._chunks = [v for b in item.buffers for v in chunk_views(b, self.chunk_bytes)]
        item._trailer = np.empty(len(item._chunks), dtype=np.int64)
        item._stage = 1
        self._post_receives(item, item._window)
        return True

    def _post_receives(self, item: Incoming, count: int) -> None:
        """Post up to ``count`` more of ``item``'s chunk receives, and its trailer after the last.

        Why a window, not every receive at once: when the data is already waiting (the sender
        posts all its sends first), shared-memory MPI copies a chunk inside the ``Irecv`` call
        itself. Posting them all would copy the whole layer before any chunk could be hashed,
        and the hash pass would then run over memory long out of cache. From a sender on the
        same node the window is one chunk: copy it, hash it, then post the next (a second
        receive posted before the hash would copy another chunk over the first one). From
        another node the network moves the data while this rank hashes, so several chunks
        stay in flight (:data:`RECV_WINDOW_REMOTE` x ``chunk_bytes``, far more than a link's
        bandwidth-delay product).
        """
        src, tag = item.src, item.tag + 1
        while count > 0 and item._next_chunk < len(item._chunks):
            k = item._next_chunk
            view = item._chunks[k]
            self.recv_requests.append(self.comm.Irecv([view, MPI.BYTE], source=src, tag=tag))
            self.recv_targets.append((item, k))
            item._next_chunk += 1
            count -= 1
        if item._next_chunk == len(item._chunks) and not item._trailer_posted:
            assert item._trailer is not None
            self.recv_requests.append(self.comm.Irecv(item._trailer, source=src, tag=tag))
            self.recv_targets.append((item, -1))
            item._trailer_posted = True

    def _take_meta(self, item: Incoming) -> bool:
        status = MPI.Status()
        if not self.comm.Iprobe(source=item.src, tag=item.tag, status=status):
            return False
        framed = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([framed, MPI.BYTE], source=item.src, tag=item.tag)
        item._stage = 2
        if digest(framed[:-8]) != int(framed[-8:].view(np.int64)[0]):
            item.error = "the layer's metadata (object graph) digest does not match"
            return True
        item.meta = framed[:-8].tobytes()
        if item.on_meta is not None:
            # In the main thread: the unpickling holds the GIL that the main thread needs
            # between its MPI calls, so a worker thread would gain nothing.
            try:
                item.on_meta(item)
            except Exception as exc:  # reported collectively by the caller, after draining
                item.error = f"rebuilding from the metadata failed: {type(exc).__name__}: {exc}"
        return True

    def _reap_receives(self) -> bool:
        if not self.recv_requests:
            return False
        done = MPI.Request.Testsome(self.recv_requests)
        if not done:
            return False
        landed = []
        for index in done:
            target, k = self.recv_targets[index]
            if k >= 0:
                view = target._chunks[k]
                if self.on_chunk is not None:
                    self.on_chunk(target, k, view)
                target._digests[k] = digest(view)
                landed.append(target)
        keep = [i for i, r in enumerate(self.recv_requests) if r != MPI.REQUEST_NULL]
        self.recv_requests = [self.recv_requests[i] for i in keep]
        self.recv_targets = [self.recv_targets[i] for i in keep]
        for target in landed:  # one landed, one more may go
            self._post_receives(target, 1)
        return True

    def run(
        self,
        outgoing: Sequence[Outgoing],
        incoming: Sequence[Incoming],
        progress: Backoff,
        on_received: Callable[[], Sequence[Any]] | None,
    ) -> None:
        for item in outgoing:
            self._post_sends(item)
        for item in outgoing:
            self._post_meta(item)
        self.send_requests = [r for item in outgoing for r in item._requests]
        trailers_due = list(outgoing)
        waiting = list(incoming)
        received = False
        agreement: list[Any] = []
        while not received or self.send_requests or agreement:
            progressed = False
            for item in list(waiting):
                take = self._take_header if item._stage == 0 else self._take_meta
                if take(item):
                    progressed = True
                    if item._stage == 2:
                        waiting.remove(item)
            progressed |= self._reap_receives()
            for item in list(trailers_due):
                progressed |= self._hash_ahead(item)
                if len(item._digests) == len(item._views):
                    trailer = np.array(item._digests, dtype=np.int64)
                    item._keep.append(trailer)
                    request = self.comm.Isend(trailer, dest=item.dst, tag=item.tag + 1)
                    self.send_requests.append(request)
                    trailers_due.remove(item)
                    progressed = True
            receiving = bool(waiting or self.recv_requests)
            if not received and not receiving and not trailers_due:
                for item in incoming:
                    _verify(item)
                received = progressed = True
                if on_received is not None:
                    agreement = list(on_received())
            if self.send_requests and MPI.Request.Testall(self.send_requests):
                self.send_requests = []
                progressed = True
            if agreement and MPI.Request.Testall(agreement):
                agreement = []
                progressed = True
            # Yield (not sleep) only where a late wake-up delays the migration: while receiving
            # (this rank copies), and at the end when only the agreement is left. A sender
            # whose sends are still being copied sleeps, leaving the cores to the copy and the
            # hashing.
            progress.round(progressed, urgent=receiving or not self.send_requests)


def _verify(item: Incoming) -> None:
    """Compare the receiver's digests with the sender's trailer; set ``item.error`` on mismatch."""
    assert item._trailer is not None
    expected = item._trailer.tolist()
    bad = [k for k in range(len(item._chunks)) if item._digests[k] != expected[k]]
    if bad and item.error is None:
        item.error = f"digest mismatch in chunk(s) {bad[:8]} of {len(item._chunks)}"
    item.bad_chunks = bad
    item._chunks, item._digests, item._trailer = [], {}, None


def locate_chunk(
    sizes: Sequence[int], chunk: int, chunk_bytes: int = CHUNK_BYTES
) -> tuple[int, int]:
    """(buffer index, byte offset) of global chunk number ``chunk`` for buffers of ``sizes``."""
    for index, size in enumerate(sizes):
        count = -(-size // chunk_bytes)
        if chunk < count:
            return index, chunk * chunk_bytes
        chunk -= count
    raise IndexError(f"chunk {chunk} beyond buffers of sizes {list(sizes)}")
