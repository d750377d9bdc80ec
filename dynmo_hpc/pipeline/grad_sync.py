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
(per dtype) of at most ``bucket_bytes`` of its trainable parameters (a layer larger than that is
a bucket of its own), planned before the step from the parameter sizes.

Overlap with the backward (:class:`GradReducer`): a layer's gradient is final once its backward
of the stage's *last* microbatch has run (the runner cuts autograd at every layer boundary, so
no later backward touches it), and that backward runs the stage's layers from last to first. So
the stage calls :meth:`GradReducer.layer_final` after each layer of that microbatch, and a
bucket whose layers are all final starts its non-blocking all-reduce at once, while the earlier
layers' backward still runs; the buckets of the layers the backward does not reach (below
``no_grad_below``) start after the schedule. Every copy of a stage has the same layers, the same
buckets and the same schedule, so all replicas start the same buckets in the same order (the
order MPI's non-blocking collectives must be called in). Without an asynchronous progress thread
an MPI library advances a non-blocking collective only inside MPI calls, so ``layer_final``
also tests the requests (``MPI.Request.Testall``) between layers. :meth:`GradReducer.finish`,
after the schedule, starts what is left and waits without spinning
(:func:`~dynmo_hpc.pipeline.comm.wait_quietly`); the seconds it takes are the all-reduce time
the backward did not hide (``allreduce_s`` in the run log). The sums are those of an all-reduce
after the schedule: same buffers, same elementwise sum.

A parameter without a gradient on one replica (an MoE expert no token of its microbatches
chose) but with one on another gets zeros on the first before the sum; a parameter without a
gradient on every replica keeps none, so the optimizer skips it exactly as R = 1 would. Which
parameters have a gradient somewhere travels with each bucket (a MAX all-reduce of a byte per
parameter, started with the bucket's sum): a bucket needs no agreement before it starts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


def ready_buckets(buckets: Sequence[Sequence[int]], final: set[int]) -> list[int]:
    """The buckets (indices into ``buckets``) whose layers' gradients are all final; pure.

    Example: the backward runs positions 3, 2, 1, 0; after position 2,
    ``ready_buckets([[0, 1], [2, 3]], {3, 2}) == [1]``.
    """
    return [b for b, bucket in enumerate(buckets) if all(pos in final for pos in bucket)]


def _trainable(slot: LayerSlot) -> list[torch.nn.Parameter]:
    return [p for p in slot.module.parameters() if p.requires_grad]


@dataclass
class _Bucket:
    """One bucket in flight: its parameters, which of them have a gradient on this replica
    (MAX-reduced in place to "on some replica"), one flat buffer per dtype, the requests."""

    params: list[torch.nn.Parameter]
    has_grad: np.ndarray
    flats: list[tuple[list[int], torch.Tensor]]
    requests: list[MPI.Request] = field(default_factory=list)


def _pack(params: list[torch.nn.Parameter]) -> _Bucket:
    """Copy the gradients into flat buffers, zeros where this replica has none."""
    has_grad = np.array([p.grad is not None for p in params], dtype=np.uint8)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    flats = []
    for positions in by_dtype.values():
        parts = []
        for i in positions:
            g = params[i].grad
            parts.append((torch.zeros_like(params[i]) if g is None else g.detach()).reshape(-1))
        flats.append((positions, torch.cat(parts).cpu()))
    return _Bucket(params, has_grad, flats)


def _unpack(bucket: _Bucket) -> None:
    """Write the sums back: a parameter with a gradient on some replica gets the sum (into a
    new zero gradient where it had none here); one with none anywhere keeps None."""
    for positions, flat in bucket.flats:
        offset = 0
        for i in positions:
            p = bucket.params[i]
            if bucket.has_grad[i]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


@dataclass(frozen=True)
class SyncStats:
    """One step's gradient all-reduce on one rank."""

    exposed_s: float = 0.0
    """Seconds after the schedule until every bucket's sum was back (what the backward did not
    hide): starting the buckets left, waiting, copying back."""
    total_s: float = 0.0
    """Seconds from the first bucket's start to the end of :meth:`GradReducer.finish`."""
    num_buckets: int = 0
    started_in_backward: int = 0
    """Buckets whose all-reduce started during the last microbatch's backward."""

    def row(self) -> tuple[float, float, int, int]:
        """What the trainer gathers: (exposed_s, total_s, started_in_backward, num_buckets)."""
        return (self.exposed_s, self.total_s, self.started_in_backward, self.num_buckets)


class GradReducer:
    """One step's bucketed all-reduce (SUM) of a stage's gradients over ``comm`` (the data
    communicator), started bucket by bucket as the last backward finalises them; collective
    over ``comm``. Use: pass :meth:`layer_final` to the stage's runner, then :meth:`finish`."""

    def __init__(
        self, comm: MPI.Comm, slots: Sequence[LayerSlot], bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        self.comm = comm
        self.params = [_trainable(slot) for slot in slots]
        sizes = [sum(p.numel() * p.element_size() for p in layer) for layer in self.params]
        self.buckets = plan_buckets(sizes, bucket_bytes)
        self.final: set[int] = set()
        self.posted: dict[int, _Bucket] = {}
        self.started_in_backward = 0
        self.first_start_s: float | None = None
        self.active = comm.size > 1
        """With one replica there is nothing to sum: every call returns at once."""

    def _start(self, b: int) -> None:
        bucket = _pack([p for pos in self.buckets[b] for p in self.params[pos]])
        bucket.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, bucket.has_grad, op=MPI.MAX))
        for _, flat in bucket.flats:
            bucket.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM))
        self.posted[b] = bucket
        if self.first_start_s is None:
            self.first_start_s = time.perf_counter()

    def _requests(self) -> list[MPI.Request]:
        return [r for bucket in self.posted.values() for r in bucket.requests]

    def layer_final(self, pos: int) -> None:
        """Layer ``pos`` (position in the stage's slots) has its final gradient: start every
        bucket that became complete, then drive the ones in flight (a test, never a wait)."""
        if not self.active:
            return
        self.final.add(pos)
        for b in ready_buckets(self.buckets, self.final):
            if b not in self.posted:
                self._start(b)
                self.started_in_backward += 1
        requests = self._requests()
        if requests:
            MPI.Request.Testall(requests)

    def finish(self) -> SyncStats:
        """Start the buckets not yet started, wait for all without spinning, write the sums
        back into ``.grad``."""
        if not self.active:
            return SyncStats()
        t0 = time.perf_counter()
        for b in range(len(self.buckets)):
            if b not in self.posted:
                self._start(b)
        wait_quietly(self._requests())
        for bucket in self.posted.values():
            _unpack(bucket)
        end_s = time.perf_counter()
        return SyncStats(
            exposed_s=end_s - t0,
            total_s=end_s - (t0 if self.first_start_s is None else self.first_start_s),
            num_buckets=len(self.buckets),
            started_in_backward=self.started_in_backward,
        )


OVERLAP_EVENT = "allreduce_overlap"
"""Run-log event kind, at each load report with replicas: :func:`overlap_detail`'s detail."""


def overlap_detail(gathered: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """The run-log detail of one step's all-reduce overlap, per world rank; ``gathered``: per
    rank, the trainer's row whose entries 5..8 are :meth:`SyncStats.row`."""
    return {
        "exposed_s": [float(g[5]) for g in gathered],
        "total_s": [float(g[6]) for g in gathered],
        "buckets_started_in_backward": [int(g[7]) for g in gathered],
        "buckets": [int(g[8]) for g in gathered],
    }


def log_overlap(writer: Any, step: int, gathered: Sequence[Sequence[float]]) -> None:
    """Rank 0, at a load report with replicas: the step's :data:`OVERLAP_EVENT` in the run log
    (``writer``: its :class:`~dynmo_hpc.runlog.writer.RunLogWriter`)."""
    writer.log_event(step=step, kind=OVERLAP_EVENT, detail=overlap_detail(gathered))


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


def layers_fingerprint(slots: Sequence[LayerSlot]) -> list[tuple[int, float]]:
    """Per layer of the stage: its index and the float64 sum of its weights, computed where the
    weights are (one number per layer leaves the device). Cheap enough for every load report;
    replicas that agree hold bitwise-equal weights, so their sums are equal too."""
    out = []
    for slot in slots:
        sums = [p.detach().double().sum() for p in slot.module.parameters()]
        out.append((slot.index, float(torch.stack(sums).sum()) if sums else 0.0))
    return out


def check_replicas_agree(
    comm: MPI.Comm, slots: Sequence[LayerSlot], stage: int, *, full: bool = True
) -> None:
    """Raise on every copy of the stage if the replicas' layers differ (they must be identical:
    same gradients, same optimizer step); collective over ``comm`` (the data communicator).

    ``full``: compare a digest of every weight and optimizer moment (:func:`layers_digest`, at
    checkpoints); else the per-layer weight sums (:func:`layers_fingerprint`, at every load
    report, so that a divergence is caught within ``balance.interval`` steps even in a run
    with no periodic checkpoints)."""
    if comm.size == 1:
        return
    mine: Any = layers_digest(slots) if full else layers_fingerprint(slots)
    digests = comm.allgather(mine)
    if any(d != digests[0] for d in digests):
        shown = digests if full else [[f"{i}:{v!r}" for i, v in d] for d in digests]
        raise RuntimeError(
            f"stage {stage}: the replicas' layers differ ({'digests' if full else 'weight sums'} "
            f"by replica {shown}); HINT: a bug in the gradient all-reduce or a scheme decided "
            "from one replica's data alone; report it with the run log"
        )
