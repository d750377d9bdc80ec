"""Where a migration's time goes: the wire alone with and without hashing, and the Python parts.

Three parts, on the layers of ``bench_migration.py`` (d_model 512 and 1024: 37.8 and 151 MB
with AdamW state):

1. In one process, median milliseconds of the Python a migration runs on the critical path:
   walking the layer (``pack_layer``), pickling its object graph with its optimizer (``meta()``)
   and rebuilding the slot over the storages (``unpack_layer``), each with warm caches and
   right after a 64 MB copy has flushed them (as in a migration, where the bytes of the layer
   have just gone through the caches).
2. In one process, XXH3's speed on a 1 MiB chunk in cache, right after a copy into it, and
   read from memory (:func:`hash_speeds`).
3. On 2 ranks, interleaved, after warm-up rounds: a bare ``comm.Send`` of the layer's bytes into
   a buffer used before and into a fresh one; ``wire.exchange`` of the same storages (chunked,
   hashed on both sides, verified) into recycled memory and into fresh memory; and the
   exchange into recycled memory with the digest replaced by a constant (hashing off), and with
   only the sender or only the receiver hashing the chunks (which side's hashing costs time).

    .venv/bin/python benchmarks/profile_migration.py [--reps 12] [--d-models 512,1024]
(part 3 re-launches itself under the venv's mpiexec with 2 ranks)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
D_MODELS = (512, 1024)
WARMUP_ROUNDS = 4
SMALL_BYTES = 64 << 10
"""Below this a buffer is a header or meta (always hashed, or the exchange refuses it)."""


def _stage(d_model: int) -> Any:
    """A one-process stage owning layers 0-1 of a 2-stage job, with real AdamW state (its
    layers re-homed into host-memory arenas by the optimizer step, as in training)."""
    import torch
    from mpi4py import MPI

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.data.batches import TextDataset
    from dynmo_hpc.pipeline.comm import StageLink
    from dynmo_hpc.pipeline.stage import PipelineStage

    cfg = config_mod.from_dict(
        {
            "model": {"num_blocks": 2, "d_model": d_model, "num_heads": 8, "d_ff": 4 * d_model},
            "pipeline": {"num_stages": 2, "partition": [0, 2, 4]},
            "runtime": {"device": "cpu"},
        }
    )
    device = torch.device("cpu")
    link = StageLink(MPI.COMM_SELF, 0, 2, device)
    dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
    stage = PipelineStage(cfg, 0, [0, 2, 4], link, dataset, device)
    for slot in stage.slots:
        for p in slot.module.parameters():
            p.grad = torch.zeros_like(p)
    stage.optimizer_step(cfg.train.lr, 1.0)
    return stage


def _median_ms(fn: Callable[[], Any], flush: Callable[[], Any] | None, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _python_row(d_model: int, flush: Callable[[], Any] | None) -> str:
    from dynmo_hpc.pipeline.migration import move

    stage = _stage(d_model)
    slot = stage.slots[1]
    packed = move.pack_layer(slot)
    storages = [b.untyped_storage() for b in packed.buffers]
    meta = packed.meta()

    def unpack() -> Any:
        return move.unpack_layer(stage, meta, storages, slot.index)

    return (
        f"{d_model:>8}{'cold' if flush else 'warm':>7}"
        f"{_median_ms(lambda: move.pack_layer(slot), flush):>9.2f}"
        f"{_median_ms(packed.meta, flush):>11.2f}{_median_ms(unpack, flush):>11.2f}"
    )


def python_parts(d_models: tuple[int, ...]) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    source = np.ones(64 << 20, dtype=np.uint8)
    target = np.empty_like(source)

    def flush() -> None:
        target[:] = source

    print(f"{'d_model':>8}{'caches':>7}{'pack ms':>9}{'pickle ms':>11}{'unpack ms':>11}")
    for d_model in d_models:
        print(_python_row(d_model, None))
        print(_python_row(d_model, flush))


def hash_speeds(chunk_bytes: int = 1 << 20, total_bytes: int = 256 << 20) -> None:
    """XXH3 (the wire's digest) on one chunk: in cache, right after a user-space copy into it,
    and read from memory. The receiver's hash of a chunk MPI just copied in can be set against
    these (its time is the 'receiver hashes' column less 'hashing off')."""
    import numpy as np

    from dynmo_hpc.pipeline.migration.wire import digest

    chunk = np.ones(chunk_bytes, dtype=np.uint8)
    memory = np.ones(total_bytes, dtype=np.uint8)
    pieces = [memory[a : a + chunk_bytes] for a in range(0, total_bytes, chunk_bytes)]
    seconds = {"in cache": 0.0, "after a copy": 0.0, "from memory": 0.0}
    for piece in pieces:
        t0 = time.perf_counter()
        digest(chunk)
        t1 = time.perf_counter()
        np.copyto(chunk, piece)
        t2 = time.perf_counter()
        digest(chunk)
        t3 = time.perf_counter()
        seconds["in cache"] += t1 - t0
        seconds["after a copy"] += t3 - t2
    for piece in pieces:  # each read once, long after it was written
        t0 = time.perf_counter()
        digest(piece)
        seconds["from memory"] += time.perf_counter() - t0
    rates = ", ".join(f"{k} {total_bytes / v / 1e9:.1f} GB/s" for k, v in seconds.items())
    print(f"\nXXH3 on {chunk_bytes >> 10} KiB chunks: {rates}")


def _wire_row(comm: Any, d_model: int, reps: int) -> dict[str, float]:
    """Median ms of a bare Send (into used and into fresh memory), an exchange (into recycled
    and into fresh memory), and exchanges with hashing off and with only one side hashing
    (slowest rank)."""
    import contextlib

    import numpy as np
    from mpi4py import MPI

    from dynmo_hpc.pipeline.migration import move, wire
    from dynmo_hpc.pipeline.migration.host_memory import POOL

    real_digest = wire.digest
    buffers = move.pack_layer(_stage(d_model).slots[1]).buffers
    total = sum(int(b.numel()) for b in buffers)
    big = np.ones(total, dtype=np.uint8)
    used = np.ones(total, dtype=np.uint8)
    times: dict[str, list[float]] = {
        "send": [],
        "send_fresh": [],
        "exchange": [],
        "fresh": [],
        "nohash": [],
        "sender_hashes": [],
        "receiver_hashes": [],
    }

    def chunks_unhashed(data: Any) -> int:
        """The digest with chunks (but not the small header and meta) left unhashed."""
        return 0 if data.nbytes >= SMALL_BYTES else real_digest(data)

    def one(kind: str, src: int) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        if kind.startswith("send"):
            if comm.rank == src:
                comm.Send([big, MPI.BYTE], dest=1 - src, tag=9)
            else:
                into = np.empty(total, dtype=np.uint8) if kind == "send_fresh" else used
                comm.Recv([into, MPI.BYTE], source=src, tag=9)
        else:
            sending = comm.rank == src
            hashing = {"nohash": False, "sender_hashes": sending, "receiver_hashes": not sending}
            wire.digest = real_digest if hashing.get(kind, True) else chunks_unhashed
            memory = POOL.fresh() if kind == "fresh" else contextlib.nullcontext()
            try:
                if comm.rank == src:
                    wire.exchange(comm, [wire.Outgoing(1 - src, 0, b"meta", buffers)], [])
                else:
                    incoming = wire.Incoming(src, 0)
                    with memory:
                        wire.exchange(comm, [], [incoming])
                    if incoming.error and kind not in ("sender_hashes", "receiver_hashes"):
                        raise RuntimeError(incoming.error)  # one side unhashed: mismatches
            finally:
                wire.digest = real_digest
        return float(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))

    for rep in range(WARMUP_ROUNDS + reps):
        for kind, values in times.items():
            elapsed_s = one(kind, rep % 2)
            if rep >= WARMUP_ROUNDS:
                values.append(elapsed_s * 1e3)
    return {"mb": total / 1e6, **{k: statistics.median(v) for k, v in times.items()}}


def rank_main(reps: int, d_models: tuple[int, ...]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = {d_model: _wire_row(comm, d_model, reps) for d_model in d_models}
    if comm.rank == 0:
        print(
            f"\n{'d_model':>8}{'MB':>8}{'Send ms':>9}{'exchange ms':>13}{'hashing off ms':>16}",
            end="",
        )
        print(f"{'sender hashes':>15}{'receiver hashes':>17}", end="")
        print(f"{'Send fresh ms':>15}{'exchange fresh ms':>19}")
        for d_model, r in rows.items():
            print(
                f"{d_model:>8}{r['mb']:>8.1f}{r['send']:>9.2f}{r['exchange']:>13.2f}"
                f"{r['nohash']:>16.2f}{r['sender_hashes']:>15.2f}{r['receiver_hashes']:>17.2f}"
                f"{r['send_fresh']:>15.2f}{r['fresh']:>19.2f}"
            )
        print(
            f"(medians of {reps} each, interleaved, directions alternating. Send, exchange and "
            "hashing off receive into memory used before (the exchange into memory recycled "
            "from a layer the rank gave away, as a migration does then); 'sender hashes' and "
            "'receiver hashes' hash the chunks on that side only; the fresh columns into fresh "
            "memory)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument(
        "--d-models",
        default=",".join(map(str, D_MODELS)),
        help="layer widths, comma-separated (default %(default)s)",
    )
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1:
        raise SystemExit(f"profile_migration: --reps must be >= 1 for a median, got {args.reps}")
    d_models = tuple(int(d) for d in args.d_models.split(","))
    if args.rank:
        rank_main(args.reps, d_models)
        return
    python_parts(d_models)
    hash_speeds()
    from dynmo_hpc.bench.scripts import run_rank_program

    argv = ["--reps", str(args.reps), "--d-models", args.d_models]
    raise SystemExit(run_rank_program(__file__, argv, env={"PYTHONPATH": str(ROOT)}))


if __name__ == "__main__":
    main()
