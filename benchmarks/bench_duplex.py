"""Is a rank's migration traffic full duplex? One transfer, one each way, two from one sender.

The decision rule prices a migration by the busiest rank's bytes sent *plus* received
(``dynmo_hpc.balance.decision``). This measures why, with 2 ranks and ``wire.exchange`` (the
transfer loop ``migrate`` uses: chunked, hashed on both sides, verified), for one buffer size:

- ``one-way``: rank 0 sends one buffer to rank 1 (the unit ``measure_bandwidth`` times);
- ``both-ways``: each rank sends one buffer to the other at once (full duplex would make it
  as fast as one-way; sent + received predicts twice);
- ``one-way x2``: rank 0 sends two buffers to rank 1 (both models predict twice).

Medians of ``--reps`` repetitions; the times are the slower rank's, between two barriers.

    .venv/bin/python benchmarks/bench_duplex.py [--mib 128] [--reps 9]
(re-launches itself under the venv's mpiexec with 2 ranks)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def rank_main(mib: int, reps: int) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    from dynmo_hpc.pipeline.comm import wait_quietly
    from dynmo_hpc.pipeline.migration.wire import Incoming, Outgoing, exchange

    comm = MPI.COMM_WORLD
    rank, peer = comm.rank, 1 - comm.rank
    rng = np.random.default_rng(rank)
    buf = torch.from_numpy(rng.integers(0, 255, mib << 20, dtype=np.uint8))

    def timed(outgoing: list[Outgoing], incoming: list[Incoming]) -> float:
        wait_quietly([comm.Ibarrier()])
        t0 = time.perf_counter()
        exchange(comm, outgoing, incoming)
        elapsed_s = time.perf_counter() - t0
        wait_quietly([comm.Ibarrier()])
        return float(comm.allreduce(elapsed_s, op=MPI.MAX))

    times: dict[str, list[float]] = {"one-way": [], "both-ways": [], "one-way x2": []}
    for _ in range(reps):
        sends = [Outgoing(1, 0, b"m", [buf])] if rank == 0 else []
        times["one-way"].append(timed(sends, [Incoming(0, 0)] if rank == 1 else []))
        times["both-ways"].append(timed([Outgoing(peer, 0, b"m", [buf])], [Incoming(peer, 0)]))
        sends = [Outgoing(1, 0, b"m", [buf]), Outgoing(1, 2, b"m", [buf])] if rank == 0 else []
        receives = [Incoming(0, 0), Incoming(0, 2)] if rank == 1 else []
        times["one-way x2"].append(timed(sends, receives))
    if rank == 0:
        base = statistics.median(times["one-way"])
        print(f"{mib} MiB per buffer, {reps} repetitions, {os.cpu_count()} cores")
        print(f"{'case':12s} {'median ms':>10s} {'x one-way':>10s}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:12s} {median * 1e3:10.1f} {median / base:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1 or args.mib < 1:
        raise SystemExit(
            f"bench_duplex: --reps and --mib must be >= 1, got --reps {args.reps} --mib {args.mib}"
        )
    if args.rank:
        rank_main(args.mib, args.reps)
        return
    from dynmo_hpc.bench.scripts import run_rank_program

    argv = ["--mib", str(args.mib), "--reps", str(args.reps)]
    raise SystemExit(run_rank_program(__file__, argv))


if __name__ == "__main__":
    main()
