"""Summing the two copies' gradients of a tied embedding weight (``model.tie_embeddings``).

The embedding (layer 0) is always on the first stage and the head (layer N+1) on the last, and
migration never moves them off (:mod:`dynmo_hpc.model.tied` says why they are two copies and
what keeps them equal). After a step's backward and its replica all-reduce, every rank calls
:func:`sum_tied_grads`:

- one stage: both copies are on this rank; they are summed locally;
- several stages: the first and the last stage of each replica all-reduce (SUM) the gradient
  over their two-rank communicator (``groups.tied``, made by
  :func:`~dynmo_hpc.pipeline.groups.make_groups`); the other stages return at once. The buffer
  carries one more entry, how many copies had a gradient, so that both ranks agree whether the
  weight is stepped. The sum is taken in float64 and rounded once to the weight's dtype, which
  gives the bits of a float32 sum (53 >= 2 * 24 + 2 bits: the double rounding is exact); a sum
  of two terms is the same in either order, so both copies get bitwise the same gradient,
  which is :func:`~dynmo_hpc.model.tied.summed_grad`'s.

It runs before the clipping norm (which counts the weight once) and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI

from dynmo_hpc.config import ModelSection
from dynmo_hpc.model.tied import sum_local_, tied_parameter
from dynmo_hpc.pipeline.groups import RankGroups
from dynmo_hpc.pipeline.stage import LayerSlot


def sum_tied_grads(cfg: ModelSection, groups: RankGroups, slots: Sequence[LayerSlot]) -> None:
    """Give both copies of the tied weight their summed gradient (a no-op when untied);
    collective over ``groups.tied`` on the first and last stage."""
    if not cfg.tie_embeddings:
        return
    params = [p for s in slots if (p := tied_parameter(cfg, s.index, s.module)) is not None]
    if groups.topology.num_stages == 1:
        embedding, head = params
        sum_local_(embedding, head)
        return
    if groups.tied is None:
        return
    if len(params) != 1:  # every stage has a layer, so layer 0 / N+1 is on stage 0 / P-1
        raise RuntimeError(
            f"stage {groups.topology.stage} holds {len(params)} copies of the tied weight, "
            "expected 1; HINT: the embedding and the head must stay on the first and last stage"
        )
    (param,) = params
    grad = param.grad
    buffer = torch.zeros(param.numel() + 1, dtype=torch.float64)
    if grad is not None:
        buffer[:-1] = grad.detach().reshape(-1).to("cpu", torch.float64)
        buffer[-1] = 1.0
    groups.tied.Allreduce(MPI.IN_PLACE, buffer.numpy(), op=MPI.SUM)
    if buffer[-1] == 0.0:
        return
    total = buffer[:-1].to(param.dtype).reshape(param.shape).to(param.device)
    param.grad = total
