"""The data-parallel gradient all-reduce between the R copies of one stage, once per step.

Why a SUM and no division: every replica scales each of its microbatches' losses by
``1 / train.num_microbatches`` (the *global* count, :class:`~dynmo_hpc.pipeline.stage.
PipelineStage`), so each replica's accumulated gradient is its share of the global mean and the
sum over replicas is exactly the gradient one replica would accumulate over the whole batch.
Where the reduction order is the same, it is the same bits: with two replicas of one microbatch
each, R = 1 computes ``g0 + g1`` and the all-reduce computes ``g0 + g1`` (a sum of two floats
does not depend on their order). Otherwise only the association differs
(``((g0 + g1) + g2) + g3`` against ``(g0 + g1) + (g2 + g3)``): float32 reassociation, a few ulps
of each gradient entry (docs/data_parallel.md states the bound the tests hold).

Buckets: a stage's layers in global order, whole layers per bucket, each bucket one flat buffer
of at most ``bucket_bytes`` (a layer larger than that is a bucket of its own), all buckets'
non-blocking all-reduces posted at once and waited on together without spinning
(:func:`~dynmo_hpc.pipeline.comm.wait_quietly`). The all-reduce runs after the schedule, not
overlapped with the backward.

A parameter without a gradient on one replica (an MoE expert no token of its microbatches
chose) but with one on another gets zeros on the first before the sum; a parameter without a
gradient on every replica keeps none, so the optimizer skips it exactly as R = 1 would.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI

from dynmo_hpc.pipeline.comm import wait_quietly

if TYPE_CHECKING:
    from dynmo_hpc.pipeline.stage import LayerSlot

BUCKET_BYTES = 25 << 20
"""Largest flat buffer one all-reduce carries (whole layers; a bigger layer goes alone)."""


def plan_buckets(layer_bytes: Sequence[int], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Group consecutive layers (positions into ``layer_bytes``) into buckets; pure.

    Example: ``plan_buckets([10, 10, 30, 5], 20) == [[0, 1], [2], [3]]``.
    """
    buckets: list[list[int]] = []
    size = 0
    for pos, num_bytes in enumerate(layer_bytes):
        if buckets and size + num_bytes <= bucket_bytes:
            buckets[-1].append(pos)
            size += num_bytes
        else:
            buckets.append([pos])
            size = num_bytes
    return buckets


def _trainable(slot: LayerSlot) -> list[torch.nn.Parameter]:
    return [p for p in slot.module.parameters() if p.requires_grad]


def _bucket_grads(slots: Sequence[LayerSlot], has_grad: np.ndarray) -> list[list[torch.Tensor]]:
    """Per layer: the gradients to reduce (zeros where this replica has none but another has)."""
    grads: list[list[torch.Tensor]] = []
    flat_index = 0
    for slot in slots:
        layer: list[torch.Tensor] = []
        for p in _trainable(slot):
            if has_grad[flat_index]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                layer.append(p.grad)
            flat_index += 1
        grads.append(layer)
    return grads


def _reduce_buckets(comm: MPI.Comm, grads: list[list[torch.Tensor]], bucket_bytes: int) -> None:
    """All-reduce (SUM) the gradients bucket by bucket, all buckets in flight at once."""
    sizes = [sum(g.numel() * g.element_size() for g in layer) for layer in grads]
    pending = []
    for bucket in plan_buckets(sizes, bucket_bytes):
        tensors = [g for pos in bucket for g in grads[pos]]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in tensors:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.detach().reshape(-1) for g in group]).cpu()
            pending.append((comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM), flat, group))
    wait_quietly([request for request, _, _ in pending])
    for _, flat, group in pending:
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_grads(
    comm: MPI.Comm, slots: Sequence[LayerSlot], bucket_bytes: int = BUCKET_BYTES
) -> float:
    """Sum this stage's gradients over ``comm`` (the data communicator); collective over it.

    Every replica holds the same layers in the same order (one partition), so the buffers line
    up. Returns the seconds it took (0 with one replica: nothing to do).
    """
    if comm.size == 1:
        return 0.0
    t0 = time.perf_counter()
    has_grad = np.array(
        [p.grad is not None for slot in slots for p in _trainable(slot)], dtype=np.uint8
    )
    comm.Allreduce(MPI.IN_PLACE, has_grad, op=MPI.MAX)
    _reduce_buckets(comm, _bucket_grads(slots, has_grad), bucket_bytes)
    return time.perf_counter() - t0


def layers_digest(slots: Sequence[LayerSlot]) -> str:
    """A digest of the stage's weights and optimizer moments, in layer order."""
    h = hashlib.blake2b(digest_size=16)
    for slot in slots:
        h.update(slot.index.to_bytes(4, "little"))
        tensors = [*slot.module.state_dict().values()]
        for state in slot.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_replicas_agree(comm: MPI.Comm, slots: Sequence[LayerSlot], stage: int) -> None:
    """Raise on every copy of the stage if the replicas' layers differ (they must be identical:
    same gradients, same optimizer step); collective over ``comm`` (the data communicator)."""
    if comm.size == 1:
        return
    digests = comm.allgather(layers_digest(slots))
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"stage {stage}: the replicas' layers differ (digests by replica {digests}); "
            "HINT: a bug in the gradient all-reduce or a scheme decided from one replica's "
            "data alone; report it with the run log"
        )
