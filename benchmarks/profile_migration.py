"""Where a migration's time goes: the wire alone with and without hashing, and the Python parts.

Two parts, both on the layers of ``bench_migration.py`` (d_model 512 and 1024: 37.8 and 151 MB
with AdamW state):

1. In one process, median milliseconds of the Python a migration runs on the critical path:
   walking the layer (``pack_layer``), pickling its object graph (``meta()``), unpickling it over
   the storages, and building and loading the optimizer (``unpack_layer``'s last steps).
2. On 2 ranks, interleaved, after warm-up rounds: a bare ``comm.Send`` of the layer's bytes into
   a fresh buffer; ``wire.exchange`` of the same storages (chunked, hashed on both sides,
   verified); and the same exchange with the digest replaced by a constant (hashing off).

    .venv/bin/python benchmarks/profile_migration.py [--reps 12]
(part 2 re-launches itself under the venv's mpiexec with 2 ranks)
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
D_MODELS = (512, 1024)
WARMUP_ROUNDS = 4


def _layer(d_model: int) -> Any:
    """A block with real AdamW state, as a LayerSlot-like object."""
    import torch

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.model.optim import build_optimizer
    from dynmo_hpc.model.schemes import build_layer

    cfg = config_mod.from_dict(
        {
            "model": {"num_blocks": 2, "d_model": d_model, "num_heads": 8, "d_ff": 4 * d_model},
            "runtime": {"device": "cpu"},
        }
    )
    module = build_layer(cfg, 1)
    optimizer = build_optimizer(module, cfg.train)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()

    class Slot:
        index = 1

    slot = Slot()
    slot.module, slot.optimizer = module, optimizer  # type: ignore[attr-defined]
    return cfg, slot


def _median_ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _python_row(d_model: int) -> str:
    import torch

    from dynmo_hpc.model.optim import build_optimizer
    from dynmo_hpc.pipeline import migration

    cfg, slot = _layer(d_model)
    packed = migration.pack_layer(slot)
    storages = [b.untyped_storage() for b in packed.buffers]
    outer = pickle.loads(packed.meta())

    def unpickle() -> Any:
        inline = [
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).untyped_storage()
            if raw
            else torch.empty(0, dtype=torch.uint8).untyped_storage()
            for raw in outer["inline"]
        ]
        graph = io.BytesIO(outer["graph"])
        return migration._StorageUnpickler(graph, storages, inline).load()

    payload = unpickle()

    def optimizer() -> None:
        build_optimizer(payload["module"], cfg.train).load_state_dict(payload["optimizer"])

    return (
        f"{d_model:>8}{_median_ms(lambda: migration.pack_layer(slot)):>9.2f}"
        f"{_median_ms(packed.meta):>11.2f}{_median_ms(unpickle):>13.2f}"
        f"{_median_ms(optimizer):>14.2f}"
    )


def python_parts() -> None:
    import torch

    torch.set_num_threads(1)
    print(f"{'d_model':>8}{'pack ms':>9}{'pickle ms':>11}{'unpickle ms':>13}{'optimizer ms':>14}")
    for d_model in D_MODELS:
        print(_python_row(d_model))


def _wire_row(comm: Any, d_model: int, reps: int) -> dict[str, float]:
    """Median ms of a bare Send, an exchange and an exchange with hashing off (slowest rank)."""
    import numpy as np
    from mpi4py import MPI

    from dynmo_hpc.pipeline import migration, wire

    real_digest = wire.digest
    _, slot = _layer(d_model)
    buffers = migration.pack_layer(slot).buffers
    total = sum(int(b.numel()) for b in buffers)
    big = np.ones(total, dtype=np.uint8)
    times: dict[str, list[float]] = {"send": [], "exchange": [], "nohash": []}

    def one(kind: str, src: int) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        if kind == "send":
            if comm.rank == src:
                comm.Send([big, MPI.BYTE], dest=1 - src, tag=9)
            else:
                into = np.empty(total, dtype=np.uint8)
                comm.Recv([into, MPI.BYTE], source=src, tag=9)
        else:
            wire.digest = real_digest if kind == "exchange" else (lambda data: 0)
            try:
                if comm.rank == src:
                    wire.exchange(comm, [wire.Outgoing(1 - src, 0, b"meta", buffers)], [])
                else:
                    incoming = wire.Incoming(src, 0)
                    wire.exchange(comm, [], [incoming])
                    if incoming.error:
                        raise RuntimeError(incoming.error)
            finally:
                wire.digest = real_digest
        return float(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))

    for rep in range(WARMUP_ROUNDS + reps):
        for kind, values in times.items():
            elapsed_s = one(kind, rep % 2)
            if rep >= WARMUP_ROUNDS:
                values.append(elapsed_s * 1e3)
    return {"mb": total / 1e6, **{k: statistics.median(v) for k, v in times.items()}}


def rank_main(reps: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = {d_model: _wire_row(comm, d_model, reps) for d_model in D_MODELS}
    if comm.rank == 0:
        print(f"\n{'d_model':>8}{'MB':>8}{'bare Send ms':>14}{'exchange ms':>13}", end="")
        print(f"{'hashing off ms':>16}")
        for d_model, r in rows.items():
            print(
                f"{d_model:>8}{r['mb']:>8.1f}{r['send']:>14.2f}{r['exchange']:>13.2f}"
                f"{r['nohash']:>16.2f}"
            )
        print(f"(medians of {reps} each, interleaved, directions alternating)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.reps)
        return
    python_parts()
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    argv = [sys.executable, "-m", "mpi4py", __file__, "--rank", "--reps", str(args.reps)]
    cmd = LocalMpiLauncher().command(LaunchSpec(2, argv))
    env = {**os.environ, **openmpi_env(), "DYNMO_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    raise SystemExit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
