"""Live layer migration: move layers between ranks with everything they carry.

A migrated layer must arrive exactly as it left, or training silently becomes a different
computation. So a move ships the whole layer module (its parameters, buffers and any scheme
state such as pruning masks, router weights or frozen flags) plus its AdamW ``state_dict`` (both
moments and the step count), and the receiver inserts it at its global position. After every
migration each rank checks its invariants: it owns exactly its new contiguous range in order, the
owned layer counts add up to the model, and every moved tensor's checksum matches on both sides.

The plan (which layers move where) is computed by :func:`dynmo_hpc.balance.plan_moves` from the
old and new partitions, identically on every rank, so no plan needs to be sent. Transfers use
mpi4py buffer calls on a duplicated communicator (no tag clashes with the pipeline traffic) and
the same non-spinning wait as the pipeline.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from dynmo_hpc.balance import plan_moves
from dynmo_hpc.pipeline.comm import poll_quietly, wait_quietly

if TYPE_CHECKING:
    from dynmo_hpc.pipeline.stage import LayerSlot, PipelineStage

log = logging.getLogger(__name__)

_TAGS_PER_LAYER = 4096
"""Tag block per layer: header, pickle, then one tag per storage."""


@dataclass(frozen=True)
class MigrationStats:
    """What one migration did, as seen by this rank."""

    num_moves: int
    bytes_sent: int
    bytes_received: int
    seconds: float


def tensor_checksums(module: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, int]:
    """CRC-32 of every parameter, buffer and optimizer-state tensor, by name."""
    sums = {}
    for name, tensor in module.state_dict().items():
        sums[f"module.{name}"] = _crc(tensor)
    for pid, state in optimizer_state.get("state", {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                sums[f"optimizer.{pid}.{key}"] = _crc(value)
    return sums


def _crc(tensor: torch.Tensor) -> int:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy() if data.numel() else b""
    return zlib.crc32(raw, zlib.crc32(str(data.dtype).encode()))


class _StoragePickler(pickle.Pickler):
    """Pickles a layer's object graph but keeps tensor storages out of the byte stream.

    Storages are collected (deduplicated) and sent as raw MPI buffers, so a migration moves
    tensor data once, without serialising it into a byte string first.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, torch.uint8
        else:
            return None
        key = untyped.data_ptr() if untyped.nbytes() else -1 - len(self.storages)
        if key not in self._index:
            self._index[key] = len(self.storages)
            self.storages.append(untyped)
        return ("storage", self._index[key], str(dtype).removeprefix("torch."))


class _StorageUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, storages: list[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid: Any) -> Any:
        _, index, dtype_name = pid
        dtype = getattr(torch, dtype_name)
        return torch.storage.TypedStorage(
            wrap_storage=self.storages[index], dtype=dtype, _internal=True
        )


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the storage's memory (what MPI sends, via DLPack)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def pack_layer(slot: LayerSlot) -> tuple[bytes, list[torch.Tensor]]:
    """The layer's object graph (module with all scheme state, optimizer state, checksums) as a
    small pickle, plus the raw tensor storages it refers to."""
    module = slot.module.to("cpu")
    state = slot.optimizer.state_dict()
    stream = io.BytesIO()
    pickler = _StoragePickler(stream)
    pickler.dump(
        {
            "index": slot.index,
            "module": module,
            "optimizer": state,
            "checksums": tensor_checksums(module, state),
        }
    )
    return stream.getvalue(), [_storage_bytes(s) for s in pickler.storages]


def unpack_layer(
    pipeline_stage: PipelineStage, meta: bytes, buffers: list[torch.Tensor], index: int
) -> LayerSlot:
    """Rebuild a layer slot on the receiver and verify every tensor's checksum."""
    storages = [b.untyped_storage() for b in buffers]
    payload = _StorageUnpickler(io.BytesIO(meta), storages).load()
    if payload["index"] != index:
        raise RuntimeError(f"migration: expected layer {index}, received layer {payload['index']}")
    module, state = payload["module"], payload["optimizer"]
    received = tensor_checksums(module, state)
    if received != payload["checksums"]:
        bad = sorted(k for k in payload["checksums"] if received.get(k) != payload["checksums"][k])
        raise RuntimeError(f"migration of layer {index}: checksum mismatch in {bad[:5]}")
    slot = pipeline_stage.make_slot(index, module)
    slot.optimizer.load_state_dict(state)
    return slot


def migrate(pipeline_stage: PipelineStage, comm: MPI.Comm, new_parts: list[int]) -> MigrationStats:
    """Move layers so this rank owns ``new_parts[rank]..new_parts[rank+1]-1``; collective.

    Every rank must call it with the same ``new_parts``. Sends are posted before receives are
    waited on, so any pattern of moves completes.
    """
    t0 = time.perf_counter()
    old_parts = pipeline_stage.parts
    moves = plan_moves(old_parts, new_parts)
    rank = comm.rank
    outgoing = [m for m in moves if m.src == rank]
    incoming = [m for m in moves if m.dst == rank]
    by_index = {slot.index: slot for slot in pipeline_stage.slots}

    # Per move: a header (pickle length, storage sizes), the pickle, then each storage raw.
    # Tags: 64 per layer index, so concurrent moves never match each other's messages.
    send_requests: list[Any] = []
    keep_alive: list[Any] = []
    bytes_sent = 0
    for move in outgoing:
        meta, buffers = pack_layer(by_index[move.layer])
        header = np.array([len(meta), len(buffers), *(b.numel() for b in buffers)], dtype=np.int64)
        meta_arr = np.frombuffer(meta, dtype=np.uint8)
        keep_alive += [header, meta_arr, buffers]
        base = _TAGS_PER_LAYER * move.layer
        send_requests.append(comm.Isend(header, dest=move.dst, tag=base))
        send_requests.append(comm.Isend([meta_arr, MPI.BYTE], dest=move.dst, tag=base + 1))
        for k, buf in enumerate(buffers):
            send_requests.append(
                comm.Isend([buf.numpy(), MPI.BYTE], dest=move.dst, tag=base + 2 + k)
            )
        bytes_sent += meta_arr.size + sum(b.numel() for b in buffers)

    arrived = []
    bytes_received = 0
    for move in incoming:
        base = _TAGS_PER_LAYER * move.layer
        status = MPI.Status()
        src = move.src
        poll_quietly(lambda s=src, t=base, st=status: bool(comm.Iprobe(source=s, tag=t, status=st)))
        header = np.zeros(status.Get_count(MPI.INT64_T), dtype=np.int64)
        comm.Recv(header, source=move.src, tag=base)
        meta_arr = np.empty(int(header[0]), dtype=np.uint8)
        buffers = [torch.empty(int(n), dtype=torch.uint8) for n in header[2:]]
        requests = [comm.Irecv([meta_arr, MPI.BYTE], source=move.src, tag=base + 1)]
        requests += [
            comm.Irecv([buf.numpy(), MPI.BYTE], source=move.src, tag=base + 2 + k)
            for k, buf in enumerate(buffers)
        ]
        wait_quietly(requests)
        arrived.append(unpack_layer(pipeline_stage, meta_arr.tobytes(), buffers, move.layer))
        bytes_received += meta_arr.size + sum(b.numel() for b in buffers)
    wait_quietly(send_requests)
    del keep_alive

    pipeline_stage.replace_layers(new_parts, arrived=arrived, leaving={m.layer for m in outgoing})
    counts = comm.allgather(len(pipeline_stage.slots))
    if sum(counts) != new_parts[-1]:
        raise RuntimeError(
            f"after migration ranks own {counts} layers (sum {sum(counts)}), "
            f"expected {new_parts[-1]} in total"
        )
    return MigrationStats(
        num_moves=len(moves),
        bytes_sent=bytes_sent,
        bytes_received=bytes_received,
        seconds=time.perf_counter() - t0,
    )


def measure_bandwidth(comm: MPI.Comm, num_bytes: int = 4 << 20) -> float:
    """Point-to-point bandwidth between ranks 0 and 1 in bytes/s (all ranks get the value).

    Used by the decision rule to predict migration time before any migration happened.
    """
    if comm.size < 2:
        return float("inf")
    buf = np.zeros(num_bytes, dtype=np.uint8)
    comm.Barrier()
    t0 = time.perf_counter()
    if comm.rank == 0:
        wait_quietly([comm.Isend([buf, MPI.BYTE], dest=1, tag=7)])
        wait_quietly([comm.Irecv([buf[:1], MPI.BYTE], source=1, tag=8)])
    elif comm.rank == 1:
        wait_quietly([comm.Irecv([buf, MPI.BYTE], source=0, tag=7)])
        wait_quietly([comm.Isend([buf[:1], MPI.BYTE], dest=0, tag=8)])
    seconds = time.perf_counter() - t0
    value = comm.bcast(num_bytes / seconds if comm.rank == 0 else None, root=0)
    return float(value)
