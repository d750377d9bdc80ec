"""Point-to-point transport between neighbouring pipeline stages, and the waits that don't spin.

Why a separate module: the schedule runner should read like the schedule (recv, compute, send);
everything about tags, buffers, non-blocking requests and how to wait lives here. Edge stages get
``None`` from the receives and no-ops from the sends, so the runner has no first/last branches.

Transport: on CPU, mpi4py buffer calls on torch tensors (DLPack, no pickling). On CUDA, NCCL
through ``torch.distributed`` when available (bootstrapped from MPI), else host staging over MPI.

Waiting: an MPI rank blocked in ``Recv`` may busy-poll and steal a core from a rank that is
computing when there are fewer cores than ranks, so every wait here is a ``Test`` loop with a
short, growing sleep (:class:`Backoff`); where each rank has a core of its own, the stage's waits
yield the core for their first milliseconds instead (:mod:`dynmo_hpc.pipeline.waiting`). The
time spent waiting is the stage's idle time.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from mpi4py import MPI

from dynmo_hpc.config.sections import RuntimeSection
from dynmo_hpc.model.gpt import Payload, Spec
from dynmo_hpc.pipeline.groups import RankGroups
from dynmo_hpc.pipeline.waiting import pipeline_wait_yield_s

log = logging.getLogger(__name__)

_MAX_KEYS = 8  # payload tensors per message; part of the tag layout


WAIT_MAX_SLEEP_S = 1e-3
"""The longest sleep of a waiting rank's back-off (the simulator models the late wake-up it
causes: :func:`dynmo_hpc.sim.step.noticed_s`)."""


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def _prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()


@contextmanager
def fine_timer_slack(slack_ns: int = 1000) -> Iterator[None]:
    """Within the block, the calling thread's sleeps end within ``slack_ns`` of their deadline.

    Why: Linux lets a sleep overrun by the thread's timer slack (50 us by default) so that it
    can batch wake-ups. A migration's waits are a few tens of microseconds each, so that overrun
    is a large part of each of them. Where ``prctl`` is missing (not Linux) this does nothing.
    """
    if _PRCTL is None:
        yield
        return
    old_ns = _PRCTL(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _PRCTL(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0)
    try:
        yield
    finally:
        if old_ns > 0:
            _PRCTL(_PR_SET_TIMERSLACK, old_ns, 0, 0, 0)


MIGRATION_YIELD_S = 2e-3
"""How long a migration's waits poll with ``sched_yield`` before they start to sleep (see
:class:`Backoff`)."""


class Backoff:
    """What a waiting loop does after a round that made no progress: yield the core, then sleep.

    For the first ``yield_s`` of a wait it calls ``sched_yield``: the core goes to any thread
    that is ready to run, and the wait notices its event within microseconds. After that it
    sleeps, 20 us growing to ``max_sleep_s``. Why both: a sleep ends late (the kernel wakes the
    thread after its deadline, so a rank polling with sleeps notices a message later than one
    polling with ``sched_yield``), which is what a migration's short waits cannot afford; but a
    long wait must not hold a core that a computing rank could use. The
    pipeline's waits use ``yield_s=0``: their late wake-up is what the simulator models.
    """

    def __init__(self, max_sleep_s: float = WAIT_MAX_SLEEP_S, yield_s: float = 0.0) -> None:
        self.max_sleep_s = max_sleep_s
        self.yield_s = yield_s
        self.sleep_s = 0.0
        self.idle_since: float | None = None

    def round(self, progressed: bool, urgent: bool = True) -> None:
        """After one round of polls: nothing if it ``progressed``, else yield or sleep (sleep
        at once when the caller says the wait is not ``urgent``)."""
        if progressed:
            self.sleep_s, self.idle_since = 0.0, None
            return
        now = time.perf_counter()
        if self.idle_since is None:
            self.idle_since = now
        if urgent and now - self.idle_since < self.yield_s:
            os.sched_yield()
            return
        self.sleep_s = min(self.max_sleep_s, max(2e-5, self.sleep_s * 2))
        time.sleep(self.sleep_s)


def poll_quietly(
    done: Callable[[], bool], max_sleep_s: float = WAIT_MAX_SLEEP_S, yield_s: float = 0.0
) -> float:
    """Poll ``done()`` until it is true, with a :class:`Backoff` between polls; returns the
    seconds waited. The one waiting loop: a blocking MPI wait may busy-poll, which on a machine
    with fewer cores than ranks steals the compute ranks' CPU."""
    t0 = time.perf_counter()
    backoff = Backoff(max_sleep_s, yield_s)
    while not done():
        backoff.round(False)
    return time.perf_counter() - t0


def wait_quietly(
    requests: Sequence[Any], max_sleep_s: float = WAIT_MAX_SLEEP_S, yield_s: float = 0.0
) -> float:
    """Wait for MPI requests without spinning; returns the seconds waited."""
    pending = [r for r in requests if r is not None]
    if not pending:
        return 0.0
    return poll_quietly(lambda: bool(MPI.Request.Testall(pending)), max_sleep_s, yield_s)


class StageLink:
    """Activation and gradient exchange for one stage with its pipeline neighbours.

    ``comm`` is the stage's replica's pipeline communicator
    (:class:`~dynmo_hpc.pipeline.groups.RankGroups`), in which rank = stage, so the neighbours
    are ranks ``stage - 1`` and ``stage + 1`` there.

    Tags: ``(microbatch * 2 + direction) * _MAX_KEYS + key_index``; messages between a pair of
    ranks are matched by tag, so out-of-order microbatches (1F1B) never mix.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        stage: int,
        num_stages: int,
        device: torch.device,
        wait_yield_s: float = 0.0,
    ) -> None:
        self.comm = comm
        self.wait_yield_s = wait_yield_s
        """Seconds a wait yields its core before it sleeps
        (:func:`dynmo_hpc.pipeline.waiting.pipeline_wait_yield_s`)."""
        self.stage = stage
        self.num_stages = num_stages
        self.device = device
        self.prev_rank = stage - 1 if stage > 0 else None
        self.next_rank = stage + 1 if stage < num_stages - 1 else None
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self.idle_s = 0.0
        tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767  # MPI_TAG_UB; the standard's minimum
        self.max_microbatches = int(tag_ub) // (2 * _MAX_KEYS)

    def _tag(self, microbatch: int, direction: int, key_index: int) -> int:
        if microbatch >= self.max_microbatches:
            raise ValueError(
                f"microbatch {microbatch} exceeds this MPI's tag space "
                f"({self.max_microbatches} microbatches); lower train.num_microbatches"
            )
        return (microbatch * 2 + direction) * _MAX_KEYS + key_index

    # Transport hooks: the MPI buffers here, torch.distributed in TorchDistLink.
    buffer_on_device = False
    """Whether receive buffers live on the compute device (else on the host, then copied)."""

    def _post_recv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        return self.comm.Irecv(buf, source=src, tag=tag)

    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        return self.comm.Isend(tensor, dest=dst, tag=tag)

    def _wait(self, requests: Sequence[Any]) -> float:
        return wait_quietly(requests, yield_s=self.wait_yield_s)

    def _recv(self, src: int | None, microbatch: int, direction: int, spec: Spec) -> Payload | None:
        if src is None:
            return None
        device = self.device if self.buffer_on_device else torch.device("cpu")
        buffers: Payload = {}
        requests = []
        for i, (name, (shape, dtype)) in enumerate(spec.items()):
            buf = torch.empty(shape, dtype=dtype, device=device)
            requests.append(self._post_recv(buf, src, self._tag(microbatch, direction, i)))
            buffers[name] = buf
        self.idle_s += self._wait(requests)
        if device != self.device:
            return {k: v.to(self.device, non_blocking=True) for k, v in buffers.items()}
        return buffers

    def _send(
        self, dst: int | None, microbatch: int, direction: int, spec: Spec, payload: Payload
    ) -> None:
        if dst is None:
            return
        for i, name in enumerate(spec):
            tensor = payload[name].detach()
            if not self.buffer_on_device:
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            request = self._post_send(tensor, dst, self._tag(microbatch, direction, i))
            self._sends.append((request, tensor))  # keep the buffer alive until it is sent

    def recv_forward(self, microbatch: int, spec: Spec) -> Payload | None:
        """Activations from the previous stage; ``None`` on the first stage."""
        return self._recv(self.prev_rank, microbatch, 0, spec)

    def send_forward(self, microbatch: int, spec: Spec, payload: Payload) -> None:
        self._send(self.next_rank, microbatch, 0, spec, payload)

    def recv_backward(self, microbatch: int, spec: Spec) -> Payload | None:
        """Gradients w.r.t. this stage's outputs from the next stage; ``None`` on the last."""
        return self._recv(self.next_rank, microbatch, 1, spec)

    def send_backward(self, microbatch: int, spec: Spec, grads: Payload) -> None:
        self._send(self.prev_rank, microbatch, 1, spec, grads)

    def finish_sends(self) -> None:
        """Complete every outstanding send (end of step: nothing may stay pending)."""
        self.idle_s += self._wait([r for r, _ in self._sends])
        self._sends.clear()

    def reap_sends(self) -> None:
        """Release buffers of sends that already completed (keeps memory flat in long steps)."""
        if self._sends:
            self._sends = [(r, t) for r, t in self._sends if not r.Test()]

    @property
    def num_pending_sends(self) -> int:
        return len(self._sends)


def rendezvous_address(
    hosts: Sequence[str], env: Mapping[str, str], *, leads_job: bool = True
) -> str:
    """Where the ranks of one process group reach its rank 0's TCP store; pure. ``hosts``:
    every rank's host name as MPI or SLURM knows it (``SLURMD_NODENAME``, else
    ``MPI_Get_processor_name``), in the group's rank order. ``leads_job``: the group's rank 0 is
    the job's rank 0 (false for the pipeline group of every replica but the first).

    ``MASTER_ADDR`` if the user set one and the group's rank 0 is the job's rank 0 (the
    variable names that rank's host: a SLURM script commonly exports the first node); else
    ``127.0.0.1`` when all the group's ranks share a host; else the group's rank 0's node name,
    which the other nodes resolve through the cluster's own name service. So each replica's
    group meets on its own rank 0's node, never on another replica's host where no store
    listens. Never the local resolution of our own host name: on many Linux hosts
    ``gethostbyname(gethostname())`` is 127.0.1.1 (a Debian /etc/hosts convention),
    unreachable from any other node. (The store listens on all of rank 0's interfaces, so rank
    0's own ranks reach it whatever the name resolves to locally.)
    """
    explicit = env.get("MASTER_ADDR", "").strip()
    if explicit and leads_job:
        return explicit
    if len(set(hosts)) <= 1:
        return "127.0.0.1"
    return hosts[0]


def host_name() -> str:
    """This rank's node as the launcher knows it: SLURM's node name, else MPI's."""
    return os.environ.get("SLURMD_NODENAME") or MPI.Get_processor_name()


def init_torch_distributed(comm: MPI.Comm, backend: str) -> None:
    """Bootstrap ``torch.distributed`` from MPI: rank 0 picks a free port and shares its address.

    No launcher-specific variables (torchrun's) are needed, so the same code serves local
    ``mpiexec`` and ``srun`` steps; the address comes from :func:`rendezvous_address`. Process
    groups are passed explicitly, never global singletons beyond torch's own default group.
    """
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    hosts = comm.allgather(host_name())
    leads_job = bool(comm.bcast(MPI.COMM_WORLD.Get_rank() == 0, root=0))
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    address = rendezvous_address(hosts, os.environ, leads_job=leads_job)
    port = comm.bcast(port, root=0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )


class TorchDistLink(StageLink):
    """The same exchange over ``torch.distributed`` point-to-point: NCCL on GPUs, gloo on CPUs.

    On CUDA this keeps activations on the device (no host staging). Messages between a pair of
    ranks in one direction are posted and matched in the same order on both sides (microbatch
    order, then payload key order), which is all NCCL's untagged point-to-point needs.

    Why sends are deferred and batched: an NCCL send of a large message does not complete until
    the peer posts the matching receive, and one rank's operations run in order on its stream. In
    1F1B, stage s sends activations to s+1 and then waits for gradients from s+1 while s+1 sends
    gradients to s and then waits for activations from s: posted one by one, each send waits on
    a receive queued behind the other side's send, a deadlock once messages exceed NCCL's
    buffers. So a send is queued and posted together with this rank's next receive in one
    ``batch_isend_irecv`` (one NCCL group: both progress together), which gives exactly the
    combined send-forward/recv-backward and send-backward/recv-forward exchanges of Megatron's
    schedules; queued sends with no receive to pair with (an edge stage, the end of a step) are
    posted as their own batch at once. Every send is thus posted before its rank blocks, in
    program order, for GPipe and 1F1B alike; ``tests/test_p2p_batching.py`` checks both schedules
    against a rendezvous model of NCCL.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        stage: int,
        num_stages: int,
        device: torch.device,
        *,
        transport: Any | None = None,
    ) -> None:
        """``transport``: an initialised stand-in for ``torch.distributed`` (its ``P2POp``,
        ``isend``, ``irecv`` and ``batch_isend_irecv``), e.g. a recorder in a test; None
        initialises ``torch.distributed`` over ``comm``'s ranks (NCCL on CUDA, else gloo)."""
        super().__init__(comm, stage, num_stages, device)
        if transport is None:
            import torch.distributed as dist

            backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
            init_torch_distributed(comm, backend)
            transport = dist
        else:
            backend = "given"
        self.dist = transport
        self.backend = backend
        self._queued: list[Any] = []  # P2POps of sends not yet posted

    buffer_on_device = True

    def _send(
        self, dst: int | None, microbatch: int, direction: int, spec: Spec, payload: Payload
    ) -> None:
        if dst is None:
            return
        for i, name in enumerate(spec):
            tensor = payload[name].detach().contiguous()
            tag = self._tag(microbatch, direction, i)
            self._queued.append(self.dist.P2POp(self.dist.isend, tensor, dst, tag=tag))

    def _flush(self, recvs: list[Any]) -> list[Any]:
        """Post the queued sends with ``recvs`` as one batch; returns the works to wait on now."""
        ops, self._queued = [*self._queued, *recvs], []
        if not ops:
            return []
        works = self.dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one work for the whole group (NCCL coalescing)
            for op in ops:
                if op.op is self.dist.isend:
                    self._sends.append((works[-1], op.tensor))
            return list(works) if recvs else []
        for op, work in zip(ops, works, strict=True):
            if op.op is self.dist.isend:
                self._sends.append((work, op.tensor))  # keep the tensor alive until sent
        return [w for op, w in zip(ops, works, strict=True) if op.op is not self.dist.isend]

    def _recv(self, src: int | None, microbatch: int, direction: int, spec: Spec) -> Payload | None:
        if src is None:
            self._flush([])  # nothing to pair the queued sends with: post them now
            return None
        buffers: Payload = {}
        recvs = []
        for i, (name, (shape, dtype)) in enumerate(spec.items()):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            tag = self._tag(microbatch, direction, i)
            recvs.append(self.dist.P2POp(self.dist.irecv, buf, src, tag=tag))
            buffers[name] = buf
        self.idle_s += self._wait(self._flush(recvs))
        return buffers

    def finish_sends(self) -> None:
        self._flush([])
        super().finish_sends()

    @property
    def num_pending_sends(self) -> int:
        return len(self._sends) + len(self._queued)

    def _wait(self, requests: Sequence[Any]) -> float:
        """``wait()`` on each request. Gloo's requests never report completion until waited on
        (``is_completed()`` stays False until then), and gloo blocks in the kernel, not in a spin;
        NCCL's ``wait()`` only orders the current CUDA stream after the transfer."""
        t0 = time.perf_counter()
        for request in requests:
            request.wait()
        return time.perf_counter() - t0

    def reap_sends(self) -> None:
        """Sends are completed at the end of the step (gloo cannot be polled)."""


def link_wait_yield_s(setting: str, ranks_on_host: int) -> float:
    """This rank's pipeline-wait yield window for ``runtime.wait_mode = setting``, from its
    affinity mask and the host's cores (:mod:`dynmo_hpc.pipeline.waiting`)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    host_cores = os.cpu_count() or 1
    return pipeline_wait_yield_s(setting, ranks_on_host, affinity or host_cores, host_cores)


def make_link(runtime: RuntimeSection, groups: RankGroups, device: torch.device) -> StageLink:
    """This rank's link over its replica's pipeline communicator. ``runtime.p2p``: ``mpi``,
    ``torch`` (NCCL on GPU, gloo on CPU), or ``auto`` (torch on CUDA, mpi on CPU). The MPI
    link's waits yield for :func:`link_wait_yield_s` before they sleep (torch's requests block
    in ``wait()``)."""
    kind = runtime.p2p
    if kind == "auto":
        kind = "torch" if device.type == "cuda" else "mpi"
    comm, topo = groups.pipeline, groups.topology
    if kind == "torch":
        return TorchDistLink(comm, topo.stage, topo.num_stages, device)
    wait_yield_s = link_wait_yield_s(runtime.wait_mode, groups.ranks_on_host)
    if groups.world.rank == 0:
        log.info(
            "pipeline waits: %s (runtime.wait_mode=%s, %d ranks on this host)",
            f"yield the core for {wait_yield_s * 1e3:g} ms, then sleep"
            if wait_yield_s
            else "sleep between polls",
            runtime.wait_mode,
            groups.ranks_on_host,
        )
    return StageLink(comm, topo.stage, topo.num_stages, device, wait_yield_s)
