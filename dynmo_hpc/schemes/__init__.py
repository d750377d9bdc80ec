"""Dynamic schemes: the techniques that change each layer's work while training runs.

This package is the single seam between the schemes and the rest of the system:

* :func:`build_layer` builds global layer ``index`` with the job's schemes applied (a pure
  function of the config, the seed and the index, so any rank builds the same layer);
* :func:`activation_spec` names the tensors that travel between stages (schemes may add some);
* :class:`SchemeController` runs at the end of every optimizer step on every rank (and in the
  single-process reference) and may change owned layers in place (prune, freeze, ...). It talks
  to other ranks only through the ``allgather`` callable it is given, so the same code runs
  under MPI and in one process.

All scheme state lives inside the layer modules (buffers and attributes), so it travels with a
layer when the layer migrates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..config import JobConfig
from ..model import activation_spec as base_activation_spec
from ..model import build_layer as base_build_layer

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]
AllGather = Callable[[Any], list[Any]]


class Slot(Protocol):
    """What the controller may touch on an owned layer (see ``engine.LayerSlot``)."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer


def build_layer(cfg: JobConfig, index: int) -> nn.Module:
    """Global layer ``index`` with the configured schemes applied."""
    return base_build_layer(cfg.model, cfg.job.seed, index)


def activation_spec(cfg: JobConfig, micro_batch_size: int) -> Spec:
    """The inter-stage payload for this job."""
    return base_activation_spec(cfg.model, micro_batch_size)


class SchemeController:
    """Step-boundary decisions of the enabled schemes (none enabled: nothing to decide)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.frozen_prefix_end = 0
        """Layers ``0..frozen_prefix_end-1`` are all frozen: no backward runs through them."""

    def step_end(self, step: int, slots: Sequence[Slot], allgather: AllGather) -> list[dict[str, Any]]:
        """Apply the schemes' decisions after optimizer step ``step``; returns run-log events.

        Every rank calls this with the same ``step`` and must make the same collective calls.
        """
        return []
