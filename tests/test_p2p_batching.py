"""torch.distributed point-to-point is deadlock-free for both schedules, and finds rank 0.

NCCL's sends of large messages complete only when the peer's receive is posted, and a rank's
operations run in order. The real ``TorchDistLink`` is driven here through every stage's schedule
with a recording stand-in for ``torch.distributed``; the batches it posts are then run through a
rendezvous model of NCCL (a batch starts when the rank's previous batch is done, and finishes
when every operation in it has met its partner in a started batch of the peer). The same model
shows that posting each operation on its own, as the link used to, deadlocks 1F1B.
Then a real 3-rank job over gloo with the batched path matches the single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from dynmo_hpc.pipeline.comm import TorchDistLink, rendezvous_address
from dynmo_hpc.pipeline.schedule import build_schedule
from dynmo_hpc.testing.reference import train_reference
from tests.helpers.jobs import assert_losses_close, run_job, tiny_config

SPEC = {"h": ((2, 3), torch.float32), "mask": ((2,), torch.int64)}


class _Work:
    def wait(self) -> None:
        return None


class _RecordingDist:
    """Stands in for torch.distributed: records each posted batch of (kind, peer, tag)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int, int]]] = []

    def isend(self, *args, **kwargs):  # identity only: the link compares ``op.op is isend``
        raise AssertionError("posted through batch_isend_irecv only")

    def irecv(self, *args, **kwargs):
        raise AssertionError("posted through batch_isend_irecv only")

    def P2POp(self, op, tensor, peer, tag=0):
        return type("Op", (), {"op": op, "tensor": tensor, "peer": peer, "tag": tag})()

    def batch_isend_irecv(self, ops):
        self.batches.append(
            [("send" if o.op == self.isend else "recv", o.peer, o.tag) for o in ops]
        )
        return [_Work() for _ in ops]


class _Comm:
    def Get_attr(self, key):
        return 2**31 - 1


def _batches(schedule: str, stage: int, num_stages: int, num_microbatches: int, batched: bool):
    """What one stage's link posts over one step, driven the way the stage runner drives it."""
    dist = _RecordingDist()
    link = TorchDistLink(_Comm(), stage, num_stages, torch.device("cpu"), transport=dist)
    payload = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in SPEC.items()}
    for action in build_schedule(schedule, stage, num_stages, num_microbatches):
        mb = action.microbatch
        if action.kind == "F":
            link.recv_forward(mb, SPEC)
            link.send_forward(mb, SPEC, payload)
        else:
            link.recv_backward(mb, SPEC)
            link.send_backward(mb, SPEC, payload)
        if not batched:  # post each send at once, before the next receive
            link.finish_sends()
    link.finish_sends()
    if not batched:  # one operation per batch, in the order posted
        return [[op] for batch in dist.batches for op in batch]
    return dist.batches


def _completes(per_rank: list[list[list[tuple[str, int, int]]]]) -> bool:
    """Rendezvous model: True if every batch of every rank finishes, False on a deadlock."""
    # Number each op by its order within its (src, dst) channel; partners share that number.
    keyed = []
    for rank, batches in enumerate(per_rank):
        seen: dict[tuple[str, int], int] = {}
        rank_batches = []
        for batch in batches:
            ops = []
            for kind, peer, tag in batch:
                n = seen.get((kind, peer), 0)
                seen[kind, peer] = n + 1
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                ops.append((src, dst, n, tag))
            rank_batches.append(ops)
        keyed.append(rank_batches)
    done = [0] * len(keyed)  # batches finished per rank
    while True:
        progressed = False
        for rank, batches in enumerate(keyed):
            if done[rank] == len(batches):
                continue
            ops = batches[done[rank]]

            # An op meets its partner: same channel and number, posted by the peer (the other
            # side of the same key), in the peer's current batch or already finished.
            def met(src, dst, n, tag, rank=rank):
                peer = dst if src == rank else src
                peer_ops = [
                    op for b in keyed[peer][: done[peer] + 1] for op in b if op[:3] == (src, dst, n)
                ]
                assert all(op[3] == tag for op in peer_ops), "partners disagree on the tag"
                return bool(peer_ops)

            if all(met(*op) for op in ops):
                done[rank] += 1
                progressed = True
        if all(d == len(b) for d, b in zip(done, keyed, strict=True)):
            return True
        if not progressed:
            return False


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8])
def test_batched_p2p_never_deadlocks(schedule, num_stages, num_microbatches):
    per_rank = [
        _batches(schedule, s, num_stages, num_microbatches, batched=True) for s in range(num_stages)
    ]
    assert _completes(per_rank)
    # Every message is posted exactly once.
    sends = sum(1 for b in per_rank for batch in b for op in batch if op[0] == "send")
    recvs = sum(1 for b in per_rank for batch in b for op in batch if op[0] == "recv")
    assert sends == recvs == 2 * (num_stages - 1) * num_microbatches * len(SPEC)


def test_unbatched_p2p_deadlocks_1f1b_in_the_model():
    """The model catches the bug the batching fixes (so the test above is not vacuous)."""
    per_rank = [_batches("1f1b", s, 2, 4, batched=False) for s in range(2)]
    assert not _completes(per_rank)


def test_rendezvous_address_uses_launcher_hosts_not_local_resolution():
    assert rendezvous_address(["n1", "n1", "n1"], {}) == "127.0.0.1"
    assert rendezvous_address(["node07", "node08"], {}) == "node07"
    assert rendezvous_address(["node07", "node08"], {"MASTER_ADDR": "10.0.0.5"}) == "10.0.0.5"
    assert rendezvous_address(["a"], {"MASTER_ADDR": "  "}) == "127.0.0.1"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_torch_p2p_pipeline_matches_reference(tmp_path, schedule):
    """The batched path on real ranks (gloo on CPU) computes what the single process does."""
    cfg = tiny_config(
        tmp_path,
        "pipeline.num_stages=3",
        "model.num_blocks=3",
        f"pipeline.schedule={schedule}",
        "runtime.p2p=torch",
        "train.steps=3",
        f"job.name=torch_p2p_{schedule}",
    )
    assert_losses_close(run_job(cfg)["losses"], train_reference(cfg).losses, rel=1e-5)


def test_each_replicas_rendezvous_is_on_its_own_rank_0s_host():
    """Issue 42, defect 2: with ``MASTER_ADDR`` exported (the job's first node), a replica
    whose pipeline group starts on another node must meet there, not at ``MASTER_ADDR``."""
    env = {"MASTER_ADDR": "node01"}
    assert rendezvous_address(["node01", "node02"], env, leads_job=True) == "node01"
    assert rendezvous_address(["node03", "node04"], env, leads_job=False) == "node03"
    assert rendezvous_address(["node03", "node03"], env, leads_job=False) == "127.0.0.1"
