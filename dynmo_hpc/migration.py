"""Live layer migration: move layers between ranks with everything they carry.

The published DynMo code rebuilt a migrated layer on the receiver from scratch (re-initialised
biases and LayerNorm weights), moved no optimizer state, and appended the layer to the end of the
receiver's list. Here a move ships the whole layer module (its parameters, buffers and any scheme
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

import hashlib
import io
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from .balance import plan_moves
from .comm import wait_quietly

if TYPE_CHECKING:
    from .engine import LayerSlot, PipelineStage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationStats:
    """What one migration did, as seen by this rank."""

    num_moves: int
    bytes_sent: int
    bytes_received: int
    seconds: float


def tensor_checksums(module: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of every parameter, buffer and optimizer-state tensor, by name."""
    sums = {}
    for name, tensor in module.state_dict().items():
        sums[f"module.{name}"] = _digest(tensor)
    for pid, state in optimizer_state.get("state", {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                sums[f"optimizer.{pid}.{key}"] = _digest(value)
    return sums


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return hashlib.sha256(str(data.dtype).encode() + raw).hexdigest()


def pack_layer(slot: LayerSlot) -> bytes:
    """Serialise a layer: the module object (all scheme state) and its optimizer state."""
    module = slot.module
    state = slot.optimizer.state_dict()
    payload = {
        "index": slot.index,
        "module": module.to("cpu"),
        "optimizer": state,
        "checksums": tensor_checksums(module, state),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def unpack_layer(stage: PipelineStage, data: bytes, index: int) -> LayerSlot:
    """Rebuild a layer slot on the receiver and verify every tensor's checksum."""
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if payload["index"] != index:
        raise RuntimeError(f"migration: expected layer {index}, received layer {payload['index']}")
    module, state = payload["module"], payload["optimizer"]
    received = tensor_checksums(module, state)
    if received != payload["checksums"]:
        bad = sorted(k for k in payload["checksums"] if received.get(k) != payload["checksums"][k])
        raise RuntimeError(f"migration of layer {index}: checksum mismatch in {bad[:5]}")
    slot = stage.make_slot(index, module)
    slot.optimizer.load_state_dict(state)
    return slot


def migrate(stage: PipelineStage, comm: MPI.Comm, new_parts: list[int]) -> MigrationStats:
    """Move layers so this rank owns ``new_parts[rank]..new_parts[rank+1]-1``; collective.

    Every rank must call it with the same ``new_parts``. Sends are posted before receives are
    waited on, so any pattern of moves completes.
    """
    t0 = time.perf_counter()
    old_parts = stage.parts
    moves = plan_moves(old_parts, new_parts)
    rank = comm.rank
    outgoing = [m for m in moves if m.src == rank]
    incoming = [m for m in moves if m.dst == rank]
    by_index = {slot.index: slot for slot in stage.slots}

    # Post sends: a size header, then the bytes. Tags are the layer index (unique per move).
    send_requests: list[Any] = []
    keep_alive: list[np.ndarray] = []
    bytes_sent = 0
    for move in outgoing:
        data = np.frombuffer(pack_layer(by_index[move.layer]), dtype=np.uint8)
        size = np.array([data.size], dtype=np.int64)
        keep_alive += [data, size]
        send_requests.append(comm.Isend(size, dest=move.dst, tag=2 * move.layer))
        send_requests.append(comm.Isend([data, MPI.BYTE], dest=move.dst, tag=2 * move.layer + 1))
        bytes_sent += data.size

    # Receive sizes, then bodies.
    sizes = {m.layer: np.zeros(1, dtype=np.int64) for m in incoming}
    wait_quietly([comm.Irecv(sizes[m.layer], source=m.src, tag=2 * m.layer) for m in incoming])
    bodies = {m.layer: np.empty(int(sizes[m.layer][0]), dtype=np.uint8) for m in incoming}
    wait_quietly(
        [
            comm.Irecv([bodies[m.layer], MPI.BYTE], source=m.src, tag=2 * m.layer + 1)
            for m in incoming
        ]
    )
    arrived = [unpack_layer(stage, bodies[m.layer].tobytes(), m.layer) for m in incoming]
    wait_quietly(send_requests)
    del keep_alive

    leaving = {m.layer for m in outgoing}
    slots = [slot for slot in stage.slots if slot.index not in leaving] + arrived
    stage.slots = sorted(slots, key=lambda slot: slot.index)
    stage.parts = list(new_parts)
    stage.check_invariants()
    counts = comm.allgather(len(stage.slots))
    if sum(counts) != new_parts[-1]:
        raise RuntimeError(
            f"after migration ranks own {counts} layers (sum {sum(counts)}), "
            f"expected {new_parts[-1]} in total"
        )
    bytes_received = sum(int(b.size) for b in bodies.values())
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
