"""Live layer migration: move layers between ranks with everything they carry, copy-free.

A migrated layer must arrive exactly as it left, or training silently becomes a different
computation. So a move ships the whole layer module (its parameters, buffers and any scheme
state such as pruning masks, router weights or frozen flags) plus its AdamW optimizer itself
(both moments, the step count, its hyperparameters), and the receiver inserts it at its global
position. Every byte is verified end to end: XXH3 digests of the sender's tensor memory against
the receiver's, per chunk (see :mod:`.wire`, which also overlaps hashing with the transfer).
After every migration each rank checks its invariants: it owns exactly its new contiguous range
in order, and the owned layer counts add up to the model.

Why it is fast: the layer's object graph is pickled with every large tensor storage kept *out
of band*, so the pickle holds only the graph and the small storages, and the tensor bytes are
sent straight from the tensors' memory (no serialisation, no copy). The receiver receives into
one host arena per layer (:mod:`.host_memory`), and the unpickled module and optimizer are
built *on those buffers*: nothing is copied or re-initialised (unpickling a module does not run
its ``__init__``; the optimizer arrives as an object whose state is keyed by the module's own
parameters, ready to step). Tensors are reduced by hand (:class:`_StoragePickler`), which is
cheaper than torch's own reduction. How close this comes to a bare ``Send`` of the same bytes,
and where the rest of the time goes: docs/benchmarks.md ("Migration").

Devices: storages may live on a GPU. They are staged through (pinned) host buffers, one copy
each way, because migration runs over MPI; the receiver builds its storages on *its* device, so
the module, its optimizer state and all scheme state arrive where the receiving stage computes.

A failed verification raises :class:`MigrationError` on every rank (they agree collectively,
after all data has drained, so nobody hangs), and leaves every stage as it was: the senders still
own their layers, and the caller may retry or fall back to a checkpoint.

The plan (which layers move where) is computed by :func:`dynmo_hpc.balance.plan_moves` from the
old and new partitions, identically on every rank, so no plan needs to be sent.
"""

from __future__ import annotations

import gc
import io
import logging
import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from dynmo_hpc.balance import Move, plan_moves
from dynmo_hpc.errors import DynmoError
from dynmo_hpc.pipeline.comm import wait_quietly
from dynmo_hpc.pipeline.migration.host_memory import LARGE_STORAGE_BYTES, POOL, layer_tensors
from dynmo_hpc.pipeline.migration.wire import (
    CHUNK_BYTES,
    Incoming,
    Outgoing,
    check_tag_space,
    exchange,
    locate_chunk,
    tag_upper_bound,
)

if TYPE_CHECKING:
    from dynmo_hpc.pipeline.stage import LayerSlot, PipelineStage

log = logging.getLogger(__name__)

INLINE_BYTES = LARGE_STORAGE_BYTES
"""Storages up to this size travel inside the pickle (AdamW's scalar step counts, norms, masks):
one message instead of dozens of tiny ones, still covered by the pickle's digest. The larger
ones are exactly those a layer's arena holds (:mod:`.host_memory`)."""


class MigrationError(DynmoError, RuntimeError):
    """A migration could not be verified; raised on every rank, with every stage left as it was."""


@dataclass(frozen=True)
class MigrationStats:
    """What one migration did, as seen by this rank."""

    num_moves: int
    bytes_sent: int
    bytes_received: int
    seconds: float


@dataclass
class PackedLayer:
    """A layer ready to send: its large storages as uint8 host tensors (views of the tensors' own
    memory on CPU), and a function that pickles the rest (run while the storages travel)."""

    meta: Callable[[], bytes]
    buffers: list[torch.Tensor]


def _storage_key(storage: torch.UntypedStorage) -> tuple[bool, int]:
    # Not str(storage.device): building the device name is costly in the walk of every tensor.
    return (storage.is_cuda, storage.data_ptr())


_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def _rebuild_tensor(*args: Any) -> Any:
    """A placeholder the pickle names; :class:`_StorageUnpickler` resolves it to its own method."""
    raise RuntimeError("a migration pickle can only be loaded by migration._StorageUnpickler")


def _rebuild_storage(*args: Any) -> Any:
    """A placeholder the pickle names; :class:`_StorageUnpickler` resolves it to its own method."""
    raise RuntimeError("a migration pickle can only be loaded by migration._StorageUnpickler")


class _StoragePickler(pickle.Pickler):
    """Pickles a layer's object graph but keeps tensor storages out of the byte stream.

    A storage found in ``large`` (the layer's big tensors, already on their way) is referred to
    by its buffer index; any other (small ones, or one the walk in :func:`pack_layer` did not
    find) travels inline, as bytes in the pickle. Storages are deduplicated, so views share one.

    Why ``reducer_override`` and not ``persistent_id``: the pickler calls ``persistent_id`` for
    every object in the graph (about 1600 for a 512-wide block with its AdamW state),
    ``reducer_override`` only for objects that are not plain ints, strings,
    dicts, lists or tuples. A plain tensor or parameter (dense, no Python attributes of its
    own: every tensor of our layers) is reduced to its storage reference, offset, shape and
    strides, and rebuilt with one ``set_`` (torch's own rebuild goes through much more Python). Any
    other tensor takes torch's own reduction, whose storage still comes here.
    """

    def __init__(self, file: io.BytesIO, large: dict[tuple[bool, int], int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.large = large
        self.inline: list[tuple[bytes, bool]] = []
        """Per small storage: its bytes, and whether it lived on an accelerator (the receiver
        puts it on its own device then, on the CPU otherwise: AdamW keeps its step count on
        the CPU beside GPU moments)."""
        self._inline_index: dict[tuple[bool, int], int] = {}

    def _storage_ref(self, untyped: torch.UntypedStorage) -> tuple[str, int]:
        key = _storage_key(untyped)
        if untyped.nbytes() and key in self.large:
            return ("buf", self.large[key])
        if not untyped.nbytes() or key not in self._inline_index:
            self._inline_index[key] = len(self.inline)
            data = _bytes_view(untyped).cpu().numpy().tobytes()
            self.inline.append((data, untyped.device.type != "cpu"))
        return ("inline", self._inline_index[key])

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is nn.Parameter:
            if (
                obj.layout is not torch.strided
                or obj.__dict__
                or obj.device.type not in ("cpu", "cuda")
                or obj.is_quantized
                or obj.is_conj()
                or obj.is_neg()
                or (obj.requires_grad and not obj.is_leaf)
            ):
                return NotImplemented  # torch's own reduction (or its refusal)
            kind, index = self._storage_ref(obj.untyped_storage())
            dtype = str(obj.dtype).removeprefix("torch.")
            args = (kind, index, dtype, obj.storage_offset(), tuple(obj.size()), obj.stride())
            return (_rebuild_tensor, (*args, obj.requires_grad, cls is nn.Parameter))
        if cls is torch.storage.TypedStorage:
            kind, index = self._storage_ref(obj._untyped_storage)
            return (_rebuild_storage, (kind, index, str(obj.dtype).removeprefix("torch.")))
        if cls is torch.UntypedStorage:
            return (_rebuild_storage, (*self._storage_ref(obj), None))
        return NotImplemented


class _StorageUnpickler(pickle.Unpickler):
    def __init__(
        self,
        file: io.BytesIO,
        buffers: list[torch.UntypedStorage],
        inline: list[torch.UntypedStorage],
    ) -> None:
        super().__init__(file)
        self.sources = {"buf": buffers, "inline": inline}

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_rebuild_tensor":
            return self._rebuild_tensor
        if module == __name__ and name == "_rebuild_storage":
            return self._rebuild_storage
        return super().find_class(module, name)

    def _rebuild_tensor(
        self,
        kind: str,
        index: int,
        dtype: str,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        requires_grad: bool,
        is_parameter: bool,
    ) -> torch.Tensor:
        storage = self.sources[kind][index]
        tensor = torch.empty(0, dtype=_DTYPES[dtype], device=storage.device)
        tensor.set_(storage, offset, size, stride)
        if is_parameter:
            return nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad)

    def _rebuild_storage(self, kind: str, index: int, dtype: str | None) -> Any:
        untyped = self.sources[kind][index]
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(
            wrap_storage=untyped, dtype=_DTYPES[dtype], _internal=True
        )


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the storage's memory, on the storage's device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def pack_layer(slot: LayerSlot) -> PackedLayer:
    """The layer's large storages, found by walking its tensors (no pickling yet), plus a function
    that pickles the object graph (module with all scheme state, optimizer with its state)
    around them. The layer itself is not changed or moved."""
    large: dict[tuple[bool, int], int] = {}
    buffers: list[torch.Tensor] = []
    staged = False
    for tensor in layer_tensors(slot.module, slot.optimizer):
        storage = tensor.untyped_storage()
        if storage.nbytes() <= INLINE_BYTES:
            continue
        key = _storage_key(storage)
        if key in large:
            continue
        view = _bytes_view(storage)
        if view.device.type != "cpu":  # stage to the host: MPI sends host memory
            host = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(view, non_blocking=True)
            view, staged = host, True
        large[key] = len(buffers)
        buffers.append(view)
    if staged:
        torch.cuda.synchronize()

    def meta() -> bytes:
        stream = io.BytesIO()
        pickler = _StoragePickler(stream, large)
        # The optimizer object itself, not its state_dict: its state is keyed by the very
        # parameters of the module (one pickle memo), so the receiver gets it ready to step,
        # without building an AdamW and loading a state_dict.
        pickler.dump({"index": slot.index, "module": slot.module, "optimizer": slot.optimizer})
        outer = {"graph": stream.getvalue(), "inline": pickler.inline}
        return pickle.dumps(outer, protocol=pickle.HIGHEST_PROTOCOL)

    return PackedLayer(meta=meta, buffers=buffers)


def unpack_layer(
    pipeline_stage: PipelineStage,
    meta: bytes,
    storages: list[torch.UntypedStorage],
    index: int,
) -> LayerSlot:
    """Rebuild a layer slot over ``storages`` (the received buffers, on the stage's device).

    Reads no tensor data, so it may run while the buffers are still being filled.
    """
    device = pipeline_stage.device
    outer = pickle.loads(meta)
    inline = []
    for raw, on_accelerator in outer["inline"]:
        data = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else torch.empty(0, dtype=torch.uint8)
        )
        inline.append((data.to(device) if on_accelerator else data).untyped_storage())
    payload = _StorageUnpickler(io.BytesIO(outer["graph"]), storages, inline).load()
    if payload["index"] != index:
        raise MigrationError(
            f"migration: expected layer {index}, received layer {payload['index']}; "
            "HINT: the ranks disagree about the plan (a bug): report it with the run log"
        )
    return pipeline_stage.make_slot(index, payload["module"], payload["optimizer"])


class _Arrival:
    """One incoming layer: rebuilt as soon as its meta arrives, committed once verified."""

    def __init__(self, pipeline_stage: PipelineStage, layer: int) -> None:
        self.pipeline_stage = pipeline_stage
        self.layer = layer
        self.slot: LayerSlot | None = None
        self.device_buffers: list[torch.Tensor] = []

    def rebuild(self, item: Incoming) -> None:
        device = self.pipeline_stage.device
        if device.type == "cpu":
            storages = [b.untyped_storage() for b in item.buffers]
        else:  # filled from the host buffers once they are verified
            self.device_buffers = [
                torch.empty(b.numel(), dtype=torch.uint8, device=device) for b in item.buffers
            ]
            storages = [b.untyped_storage() for b in self.device_buffers]
        self.slot = unpack_layer(self.pipeline_stage, item.meta, storages, self.layer)
        self.slot.in_arena = device.type == "cpu"  # its storages are the received arena's

    def commit(self, item: Incoming) -> LayerSlot:
        if self.device_buffers:  # not on CPU: there the received buffers are the storages
            for host, dev in zip(item.buffers, self.device_buffers, strict=True):
                dev.copy_(host, non_blocking=True)
        if self.slot is None:
            raise MigrationError(f"layer {self.layer} arrived without its metadata")
        return self.slot


ChunkHook = Callable[[Incoming, int, np.ndarray], None]


def _describe_failure(arrival: _Arrival, item: Incoming, rank: int, chunk_bytes: int) -> str:
    where = ""
    if item.bad_chunks:
        sizes = [int(b.numel()) for b in item.buffers]
        buffer, offset = locate_chunk(sizes, item.bad_chunks[0], chunk_bytes)
        where = f" (first bad chunk: storage {buffer}, bytes from {offset})"
    return f"layer {arrival.layer} from rank {item.src} to {rank}: {item.error}{where}"


def migrate(
    pipeline_stage: PipelineStage,
    comm: MPI.Comm,
    new_parts: list[int],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    on_chunk: ChunkHook | None = None,
) -> MigrationStats:
    """Move layers so this rank owns ``new_parts[rank]..new_parts[rank+1]-1``; collective.

    ``comm``: one replica's pipeline communicator (a duplicate of it), in which rank = stage;
    with data-parallel replicas every replica calls this at once over its own.

    Every rank must call it with the same ``new_parts``. All moves are in flight at once (every
    send and receive is posted before any is waited on), so moves between different pairs of
    ranks overlap; a rank's own sends and receives share its progress loop (which also hashes
    what it receives) and its cores, which is why the decision rule prices a rank's bytes sent
    plus received. Tags: move
    ``i`` of the plan uses ``2i`` and ``2i + 1``, checked against the MPI tag limit. ``on_chunk``
    is for fault-injection tests (see :func:`dynmo_hpc.pipeline.migration.wire.exchange`).
    """
    # No cyclic garbage collection in the middle of a move: unpickling a layer allocates enough
    # objects to trigger one (seen in a profile of back-to-back migrations while developing).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _migrate(pipeline_stage, comm, new_parts, chunk_bytes, on_chunk)
    finally:
        if gc_was_enabled:
            gc.enable()


def _transfers(
    pipeline_stage: PipelineStage, moves: list[Move], rank: int
) -> tuple[list[Outgoing], list[tuple[_Arrival, Incoming]]]:
    """This rank's sends and receives for ``moves``: move ``i`` uses tag ``2 * i`` (the same on
    both ends, since every rank plans the same moves), and each arrival rebuilds its layer as
    soon as its metadata lands."""
    by_index = {slot.index: slot for slot in pipeline_stage.slots}
    outgoing: list[Outgoing] = []
    incoming: list[tuple[_Arrival, Incoming]] = []
    for i, move in enumerate(moves):
        if move.src == rank:
            packed = pack_layer(by_index[move.layer])
            outgoing.append(Outgoing(move.dst, 2 * i, packed.meta, packed.buffers))
        elif move.dst == rank:
            arrival = _Arrival(pipeline_stage, move.layer)
            incoming.append((arrival, Incoming(move.src, 2 * i, on_meta=arrival.rebuild)))
    return outgoing, incoming


def _check_outcome(
    comm: MPI.Comm, gathered: np.ndarray, errors: list[str], new_parts: list[int]
) -> None:
    """Raise on every rank alike if any rank failed verification, or if the layer counts the
    ranks would own do not add up to the model (``gathered`` rows: errors, owned layers)."""
    if gathered[:, 0].any():  # every rank sees the same counts, so all of them gather the text
        all_errors = [e for rank_errors in comm.allgather(errors) for e in rank_errors]
        raise MigrationError(
            f"migration to partition {new_parts} failed verification: "
            + "; ".join(all_errors[:4])
            + "; every stage keeps its old layers (partition unchanged). "
            "HINT: data was damaged in transit or in memory; retry the migration, or resume "
            "from the last checkpoint if it repeats"
        )
    counts = [int(count) for count in gathered[:, 1]]
    if sum(counts) != new_parts[-1]:
        raise RuntimeError(
            f"after migration ranks would own {counts} layers (sum {sum(counts)}), "
            f"expected {new_parts[-1]} in total"
        )


def _migrate(
    pipeline_stage: PipelineStage,
    comm: MPI.Comm,
    new_parts: list[int],
    chunk_bytes: int,
    on_chunk: ChunkHook | None,
) -> MigrationStats:
    t0 = time.perf_counter()
    moves = plan_moves(pipeline_stage.parts, new_parts)
    check_tag_space(
        2 * len(moves) + 1, tag_upper_bound(comm), f"a migration of {len(moves)} layers"
    )
    rank = comm.rank
    outgoing, incoming = _transfers(pipeline_stage, moves, rank)
    leaving = {m.layer for m in moves if m.src == rank}
    errors: list[str] = []
    arrived: list[LayerSlot] = []
    outcome = np.zeros(2, dtype=np.int64)
    gathered = np.zeros((comm.size, 2), dtype=np.int64)

    def agree() -> list[Any]:
        """This rank's outcome is known (its sends may still drain): start the one collective
        that tells every rank of every error and of the layer count each rank will own."""
        for arrival, item in incoming:
            if item.error is None:
                try:
                    arrived.append(arrival.commit(item))
                    continue
                except Exception as exc:  # a bug or a mismatch: all ranks must learn of it
                    item.error = f"{type(exc).__name__}: {exc}"
            errors.append(_describe_failure(arrival, item, rank, chunk_bytes))
        if pipeline_stage.device.type == "cuda" and arrived:
            torch.cuda.synchronize(pipeline_stage.device)  # host buffers may go once copied
        outcome[:] = (len(errors), len(pipeline_stage.slots) - len(leaving) + len(arrived))
        return [comm.Iallgather(outcome, gathered)]

    exchange(
        comm,
        outgoing,
        [item for _, item in incoming],
        chunk_bytes=chunk_bytes,
        pin_memory=pipeline_stage.device.type == "cuda",
        on_chunk=on_chunk,
        on_received=agree,
    )
    _check_outcome(comm, gathered, errors, new_parts)
    pipeline_stage.replace_layers(new_parts, arrived=arrived, leaving=leaving)
    return MigrationStats(
        num_moves=len(moves),
        bytes_sent=sum(o.meta_bytes + sum(int(b.numel()) for b in o.buffers) for o in outgoing),
        bytes_received=sum(
            len(i.meta) + sum(int(b.numel()) for b in i.buffers) for _, i in incoming
        ),
        seconds=time.perf_counter() - t0,
    )


def measure_bandwidth(
    comm: MPI.Comm, num_bytes: int = 32 << 20, repeats: int = 3, chunk_bytes: int = CHUNK_BYTES
) -> float:
    """Rate of one transfer between ranks 0 and 1 in bytes/s (all ranks get the value).

    What the decision rule predicts migration time with before any migration happened, so it is
    measured the way migration moves data (chunked, hashed on both sides, verified) with a
    message as large as a real layer's; the median of ``repeats`` one-way transfers, alternating
    direction. One link, one transfer at a time, the other ranks idle: exactly the unit of
    :func:`dynmo_hpc.balance.should_rebalance`'s model, which prices each rank's bytes sent plus
    received at this rate and lets different pairs of ranks proceed at once, as :func:`migrate`
    does. With one rank there is no link and nothing can move: ``inf`` (the decision glue never
    prices a migration for one stage).
    """
    if comm.size < 2:
        return math.inf
    (buf,) = POOL.buffers([num_bytes])  # huge pages, as a re-homed layer's storages
    buf.zero_()
    rates = []
    for rep in range(repeats):
        src = rep % 2
        wait_quietly([comm.Ibarrier()])
        t0 = time.perf_counter()
        if comm.rank == src:
            exchange(comm, [Outgoing(1 - src, 0, b"probe", [buf])], [], chunk_bytes=chunk_bytes)
        elif comm.rank == 1 - src:
            exchange(comm, [], [into := Incoming(src, 0)], chunk_bytes=chunk_bytes)
            if into.error:
                raise MigrationError(f"bandwidth probe failed verification: {into.error}")
        elapsed_s = time.perf_counter() - t0 if comm.rank < 2 else 0.0
        wait_quietly([comm.Ibarrier()])
        seconds = comm.allreduce(elapsed_s, op=MPI.MAX)
        rates.append(num_bytes / seconds)
    value = float(np.median(rates))
    log.debug("migration bandwidth %.2f GB/s (%s)", value / 1e9, [f"{r / 1e9:.2f}" for r in rates])
    return value
