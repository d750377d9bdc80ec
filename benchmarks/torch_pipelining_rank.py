"""Rank program for the baseline: torch.distributed.pipelining's Schedule1F1B over gloo.

Same layers (built by dynmo_hpc.model.gpt with the same seed), same split, same microbatches as our
engine, so the only difference is the pipeline runtime. torch.distributed is bootstrapped from
MPI (rank 0 broadcasts a free port). Writes {"tokens_per_s": [...], "losses": [...]} to argv[2].

Run: mpiexec -n 2 python -m mpi4py benchmarks/torch_pipelining_rank.py CONFIG.yaml OUT.json
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from dynmo_hpc import config as config_mod
from dynmo_hpc.data.batches import TextDataset
from dynmo_hpc.model.gpt import MicrobatchContext, build_layer
from dynmo_hpc.model.optim import build_optimizer, lr_at, set_lr
from dynmo_hpc.train.trainer import initial_partition


class StageModule(nn.Module):
    """Our layers for one stage, as a tensor-in/tensor-out module (what pipelining expects)."""

    def __init__(self, layers: list[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = MicrobatchContext(tokens=x, targets=x) if self.first else None
        payload = None if self.first else {"h": x}
        for layer in self.layers:
            if self.last and layer is self.layers[-1]:
                head = layer
                return head.lm_head(head.ln_f(payload["h"]))  # (B, T, vocab) logits
            payload = layer(payload, ctx)
        return payload["h"]


def main() -> None:
    cfg = config_mod.load(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    torch.set_num_threads(cfg.runtime.threads_per_rank)
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(port, root=0))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    parts = initial_partition(cfg)
    layers = [build_layer(cfg.model, cfg.job.seed, i) for i in range(parts[rank], parts[rank + 1])]
    module = StageModule(layers, first=rank == 0, last=rank == size - 1)
    optimizers = [build_optimizer(layer, cfg.train) for layer in layers]
    stage = PipelineStage(module, rank, size, torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    schedule = Schedule1F1B(stage, cfg.train.num_microbatches, loss_fn=loss_fn)
    dataset = TextDataset.from_config(cfg.data, cfg.model.seq_len)
    tokens_per_s, losses = [], []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        batches = [
            dataset.batch(cfg.job.seed, step, m, cfg.train.micro_batch_size)
            for m in range(cfg.train.num_microbatches)
        ]
        tokens = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens)
        elif rank == size - 1:
            schedule.step(target=targets, losses=step_losses)
        else:
            schedule.step()
        for opt in optimizers:
            set_lr(opt, lr_at(step, cfg.train))
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = comm.bcast(
            float(torch.stack(step_losses).detach().mean()) if step_losses else None, root=size - 1
        )
        step_time_s = time.perf_counter() - t0
        tokens_per_s.append(cfg.tokens_per_step / step_time_s)
        losses.append(loss)
    if rank == 0:
        with open(sys.argv[2], "w") as handle:
            json.dump({"tokens_per_s": tokens_per_s, "losses": losses}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
