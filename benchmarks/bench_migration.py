"""Migration throughput against a raw mpi4py send of the same bytes, side by side.

For a layer of a given width, rank 0 migrates it to rank 1 with dynmo_hpc.pipeline.migration
(serialise the module and its AdamW state, checksum, send, rebuild, verify) and, in the same run,
sends the same number of bytes with a bare ``comm.Send``. Prints medians over repetitions and
the ratio.

    .venv/bin/python benchmarks/bench_migration.py [--reps 5]
(re-launches itself under the venv's mpiexec with 2 ranks)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rank_main(reps: int) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.pipeline.comm import StageLink
    from dynmo_hpc.pipeline.data import TextDataset
    from dynmo_hpc.pipeline.migration import migrate
    from dynmo_hpc.pipeline.stage import PipelineStage

    comm = MPI.COMM_WORLD
    rows = []
    for d_model in (256, 512, 1024):
        cfg = config_mod.from_dict(
            {
                "model": {"num_blocks": 2, "d_model": d_model, "num_heads": 8, "d_ff": 4 * d_model},
                "pipeline": {"num_stages": 2, "partition": [0, 2, 4]},
            }
        )
        dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
        link = StageLink(comm, comm.rank, 2, torch.device("cpu"))
        stage = PipelineStage(cfg, comm.rank, [0, 2, 4], link, dataset, torch.device("cpu"))
        # Give the optimizer real state (moments) so its bytes travel too.
        for slot in stage.slots:
            for p in slot.module.parameters():
                p.grad = torch.zeros_like(p)
            slot.optimizer.step()
        ours, raw = [], []
        parts = [[0, 2, 4], [0, 1, 4]]  # layer 1 goes 0 -> 1, then back
        for rep in range(reps):
            comm.Barrier()
            stats = migrate(stage, comm, parts[(rep + 1) % 2])
            total_bytes = comm.allreduce(stats.bytes_sent, op=MPI.SUM)
            seconds = comm.allreduce(stats.seconds, op=MPI.MAX)
            ours.append((total_bytes, seconds))
            buf = np.zeros(total_bytes, dtype=np.uint8)
            src = 0 if rep % 2 == 0 else 1
            comm.Barrier()
            t0 = time.perf_counter()
            if comm.rank == src:
                comm.Send([buf, MPI.BYTE], dest=1 - src, tag=3)
            else:
                comm.Recv([buf, MPI.BYTE], source=src, tag=3)
            raw.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        size_bytes = statistics.median(b for b, _ in ours)
        rows.append(
            (d_model, size_bytes, statistics.median(s for _, s in ours), statistics.median(raw))
        )
    if comm.rank == 0:
        print(
            f"{'d_model':>8}{'layer MB':>10}{'migrate GB/s':>14}{'raw Send GB/s':>15}{'ratio':>8}"
        )
        for d_model, nbytes, ours_s, raw_s in rows:
            print(
                f"{d_model:>8}{nbytes / 1e6:>10.1f}{nbytes / ours_s / 1e9:>14.2f}"
                f"{nbytes / raw_s / 1e9:>15.2f}{raw_s / ours_s:>8.2f}"
            )
        print("(migrate = serialise module + AdamW state, checksum, send, rebuild, verify)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.reps)
        return
    from dynmo_hpc.launch.local import LaunchSpec, LocalMpiLauncher, openmpi_env

    launcher = LocalMpiLauncher()
    cmd = launcher.command(
        LaunchSpec(
            2, [sys.executable, "-m", "mpi4py", __file__, "--rank", "--reps", str(args.reps)]
        )
    )
    env = {**os.environ, **openmpi_env(), "DYNMO_LOG_LEVEL": "WARNING"}
    raise SystemExit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
