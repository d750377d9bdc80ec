"""Score a model on a token file: the mean next-token cross-entropy over fixed windows, fp32.

Why fixed windows: the number must be comparable across tools. Window ``i`` is tokens
``i*(L+1) .. i*(L+1)+L`` of the file (``L+1`` tokens, no overlap); its first ``L`` tokens are
the inputs and its last ``L`` the targets, so transformers' own loss on the same inputs with
``labels=inputs`` (it shifts by one inside) covers exactly the same predictions. The loss is
the mean over all ``N*L`` predictions (every window has the same length, so that is also the
mean of the per-window losses).

Everything runs in one process on the CPU, layer after layer, as the single-process reference
does; no scheme state is needed beyond what the layers hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dynmo_hpc.errors import ConfigError
from dynmo_hpc.model.gpt import MicrobatchContext


def windows(tokens: np.ndarray, seq_len: int, num_windows: int) -> torch.Tensor:
    """The first ``num_windows`` windows of ``seq_len + 1`` tokens, (N, L+1) int64.

    Raises:
        ConfigError: the file holds fewer than ``num_windows * (seq_len + 1)`` tokens.
    """
    if seq_len < 1 or num_windows < 1:
        raise ConfigError(f"--seq-len {seq_len} and --windows {num_windows} must be >= 1")
    need = num_windows * (seq_len + 1)
    if len(tokens) < need:
        raise ConfigError(
            f"the token file holds {len(tokens)} tokens, {num_windows} windows of "
            f"{seq_len} + 1 need {need}; HINT: lower --windows or --seq-len"
        )
    data = np.asarray(tokens[:need], dtype=np.int64).reshape(num_windows, seq_len + 1)
    return torch.from_numpy(data)


@torch.no_grad()
def mean_loss(layers: Sequence[nn.Module], batch: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy of the layer stack over ``batch`` (N, L+1), in fp32."""
    total = 0.0
    count = 0
    for module in layers:
        module.eval()
    for start in range(0, len(batch), batch_size):
        chunk = batch[start : start + batch_size]
        ctx = MicrobatchContext(
            tokens=chunk[:, :-1].contiguous(), targets=chunk[:, 1:].contiguous()
        )
        x = None
        for module in layers:
            x = module(x, ctx)
        assert ctx.loss is not None, "the last layer must be the head"
        total += float(ctx.loss) * chunk.shape[0]
        count += chunk.shape[0]
    return total / count
