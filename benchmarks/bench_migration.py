"""Migration throughput against a raw mpi4py send of the same bytes, side by side.

For a layer of a given width, rank 0 migrates it to rank 1 with dynmo_hpc.pipeline.migration.move
(pickle the module and its AdamW state with storages out of band, send every byte, hash both
sides, verify, rebuild) and, interleaved in the same run, sends the same number of bytes with a
bare ``comm.Send`` into the same kind of memory. Every migration is followed by its own bare
Send in the same direction; the table gives medians, and the median and range of the
per-migration ratio (raw time / migration time: 1.0 is wire speed).

Two kinds of migration alternate, each moving the layer one way and back:
- "migrate": the steady state of a rebalance that moves layers back and forth between
  neighbours. The receiver receives into memory recycled from the layer it gave away before
  (``dynmo_hpc.pipeline.migration.host_memory``), so it pays no page faults; its bare Send
  receives into a buffer the rank has used before, which pays none either.
- "first move": the receiver takes fresh memory, as for a layer's first move into a rank; its
  bare Send receives into a fresh buffer, with the same page faults.

Both bare Sends send from one buffer per rank, written once (real memory, not the kernel's
shared zero page that an untouched ``np.zeros`` buffer reads from).

    .venv/bin/python benchmarks/bench_migration.py [--reps 9] [--device cpu|cuda] [--json OUT]
        [--d-models 256,512,1024]
(re-launches itself under the venv's mpiexec with 2 ranks)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
D_MODELS = (256, 512, 1024)
"""Layer sizes with AdamW state: 9.5, 37.8 and 151 MB."""
WARMUP_ROUNDS = 6
"""Untimed rounds (both directions, migration and bare Send) before the timed ones. On the
project's VM the first writes to memory the host has taken back cost up to 0.5 s per 151 MB
(measured: a copy into fresh memory took 530 ms, then 15-19 ms once the process had recently
freed pages to reuse); both measurements receive into fresh buffers, and until the two ranks
have such pages the first rounds of either measure the host, not the transfer."""


_SEND_BUFFERS: dict[int, Any] = {}
"""Per size: the buffer this rank sends from and receives into, reused (written once)."""


def one_round(
    comm: Any, stage: Any, parts: list[list[int]], rep: int, fresh: bool = False
) -> tuple[float, float, int]:
    """One migration and one bare Send of as many bytes in the same direction: (migration s,
    Send s, bytes), each the slowest rank's. ``fresh``: the migration's and the Send's receiver
    take fresh memory; else both receive into memory used before."""
    import contextlib

    import numpy as np
    from mpi4py import MPI

    from dynmo_hpc.pipeline.migration.host_memory import POOL
    from dynmo_hpc.pipeline.migration.move import migrate

    comm.Barrier()
    with POOL.fresh() if fresh else contextlib.nullcontext():
        stats = migrate(stage, comm, parts[(rep + 1) % 2])
    total_bytes = comm.allreduce(stats.bytes_sent, op=MPI.SUM)
    ours_s = comm.allreduce(stats.seconds, op=MPI.MAX)
    src = 0 if rep % 2 == 0 else 1
    used = _SEND_BUFFERS.setdefault(total_bytes, np.ones(total_bytes, dtype=np.uint8))
    comm.Barrier()
    t0 = time.perf_counter()
    if comm.rank == src:
        comm.Send([used, MPI.BYTE], dest=1 - src, tag=3)
    else:
        into = np.empty(total_bytes, dtype=np.uint8) if fresh else used
        comm.Recv([into, MPI.BYTE], source=src, tag=3)
    raw_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return ours_s, raw_s, total_bytes


def rank_main(
    reps: int, device_name: str, json_path: str | None, d_models: tuple[int, ...] = D_MODELS
) -> None:
    import torch
    from mpi4py import MPI

    from dynmo_hpc import config as config_mod
    from dynmo_hpc.bench.scripts import write_json_out
    from dynmo_hpc.data.batches import TextDataset
    from dynmo_hpc.pipeline.comm import StageLink
    from dynmo_hpc.pipeline.device import pick_device
    from dynmo_hpc.pipeline.stage import PipelineStage

    comm = MPI.COMM_WORLD
    device = pick_device(device_name)
    rows = []
    for d_model in d_models:
        cfg = config_mod.from_dict(
            {
                "model": {"num_blocks": 2, "d_model": d_model, "num_heads": 8, "d_ff": 4 * d_model},
                "pipeline": {"num_stages": 2, "partition": [0, 2, 4]},
                "runtime": {"device": device_name},
            }
        )
        dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
        link = StageLink(comm, comm.rank, 2, device)
        stage = PipelineStage(cfg, comm.rank, [0, 2, 4], link, dataset, device)
        # Give the optimizer real state (moments) so its bytes travel too.
        for slot in stage.slots:
            for p in slot.module.parameters():
                p.grad = torch.zeros_like(p)
        stage.optimizer_step(cfg.train.lr, 1.0)
        parts = [[0, 2, 4], [0, 1, 4]]  # layer 1 goes 0 -> 1, then back
        for rep in range(WARMUP_ROUNDS):  # untimed: see WARMUP_ROUNDS
            one_round(comm, stage, parts, rep, fresh=rep >= WARMUP_ROUNDS // 2)
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(reps):
            for fresh in (False, True):  # each kind one way and back
                for direction in range(2):
                    ours_s, raw_s, total_bytes = one_round(comm, stage, parts, direction, fresh)
                    times[fresh].append((ours_s, raw_s))
        row: dict[str, Any] = {"d_model": d_model, "layer_bytes": total_bytes}
        for fresh, key in ((False, "migrate"), (True, "first_move")):
            ratios = [r / o for o, r in times[fresh]]
            row[f"{key}_raw_s"] = statistics.median(r for _, r in times[fresh])
            row[f"{key}_s"] = statistics.median(o for o, _ in times[fresh])
            row[f"{key}_ratio_median"] = statistics.median(ratios)
            row[f"{key}_ratio_min"] = min(ratios)
            row[f"{key}_ratio_max"] = max(ratios)
        rows.append(row)
    if comm.rank == 0:
        print(
            f"{'d_model':>8}{'layer MB':>10}{'Send GB/s':>11}{'migrate GB/s':>14}"
            f"{'ratio':>7}{'range':>11}{'Send fresh GB/s':>17}{'first move GB/s':>17}"
            f"{'ratio':>7}{'range':>11}"
        )
        for r in rows:
            nbytes = r["layer_bytes"]
            line = f"{r['d_model']:>8}{nbytes / 1e6:>10.1f}"
            for key, raw_width, ours_width in (("migrate", 11, 14), ("first_move", 17, 17)):
                line += (
                    f"{nbytes / r[f'{key}_raw_s'] / 1e9:>{raw_width}.2f}"
                    f"{nbytes / r[f'{key}_s'] / 1e9:>{ours_width}.2f}"
                    f"{r[f'{key}_ratio_median']:>7.2f}"
                    f"{r[f'{key}_ratio_min']:>6.2f}-{r[f'{key}_ratio_max']:.2f}"
                )
            print(line)
        print(
            f"({2 * reps} migrations of each kind on {device}, each beside its own bare Send; "
            "ratio = raw Send time / migration time, median and range. migrate = pickle module + "
            "AdamW state, send, hash both sides, verify, rebuild, into recycled memory, beside "
            "a Send into a buffer used before; first move = the same into fresh memory, beside "
            "a Send into a fresh buffer)"
        )
        if json_path:
            write_json_out(Path(json_path), {"device": str(device), "rows": rows}, newline=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    parser.add_argument(
        "--d-models",
        default=",".join(map(str, D_MODELS)),
        help="layer widths, comma-separated (default %(default)s: 9.5, 37.8 and 151 MB)",
    )
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps < 1:
        raise SystemExit(f"bench_migration: --reps must be >= 1 for a median, got {args.reps}")
    if args.rank:
        rank_main(
            args.reps, args.device, args.json, tuple(int(d) for d in args.d_models.split(","))
        )
        return
    from dynmo_hpc.bench.scripts import run_rank_program

    argv = ["--reps", str(args.reps), "--device", args.device, "--d-models", args.d_models]
    argv += ["--json", args.json] if args.json else []
    raise SystemExit(run_rank_program(__file__, argv))


if __name__ == "__main__":
    main()
