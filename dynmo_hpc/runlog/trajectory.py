"""A scheme's state per layer at a load report, from the scheme controller's ``scheme_stats``.

Why: the ``scheme_stats`` event (:class:`dynmo_hpc.model.schemes.SchemeController`) already
gathers every layer's scheme counters to rank 0 at each load report, but as free-form counters
(``mlp.expert_3``, ``depth_router.processed``, ...). The run log's ``layer_states`` and
``expert_loads`` tables hold the same facts as fractions with fixed meanings, the inputs of the
per-layer cost model (:class:`dynmo_hpc.sim.cost_model.SchemeState`), so that a run's scheme
trajectory can be replayed on another model without knowing each scheme's counter names.

Pure: dicts in, dataclasses out. What each scheme's counters become:

- pruning: ``neurons_kept = 1 - sparsity.neuron``, ``heads_kept = 1 - sparsity.head``;
- MoD: ``tokens_kept = depth_router.processed / depth_router.tokens`` (keys and values of the
  kept tokens only);
- early exit: ``tokens_kept = processed / tokens`` of each block (its active tokens), every
  token's keys and values still attended (``kv_tokens_kept = 1``), ``exit_head`` where the block
  has one; the head runs on the tokens still active after the last block;
- sparse attention: ``attention_density = attn.kept_blocks / attn.causal_blocks`` (the causal
  block pairs computed), else the configured ``attn.density``;
- freezing: ``frozen`` from the layer's flag, ``frozen_prefix`` for layers below the event's
  ``no_grad_below`` (their backward is skipped altogether);
- MoE: per expert, ``mlp.expert_<e> / (mlp.assignments / top_k)``: its tokens as a fraction of
  the tokens that reached the layer (each makes ``top_k`` assignments, the job's
  ``schemes.moe.top_k``).

A layer a scheme did not touch reads 1.0 everywhere (and not frozen).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynmo_hpc.config import JobConfig

SCHEME_STATS = "scheme_stats"
"""The event kind whose detail :func:`layer_states` reads."""
NO_KV = math.nan
"""``kv_tokens_kept`` stored when keys and values follow ``tokens_kept`` (MoD, no scheme)."""

_EXPERT = re.compile(r"^(?P<path>.*?)\.?expert_(?P<e>\d+)$")


@dataclass(frozen=True, kw_only=True)
class LayerState:
    """One layer's scheme state over one load report's interval (a ``layer_states`` row)."""

    layer: int
    neurons_kept: float = 1.0
    heads_kept: float = 1.0
    tokens_kept: float = 1.0
    kv_tokens_kept: float = NO_KV
    """NaN: the same as ``tokens_kept``."""
    attention_density: float = 1.0
    frozen: bool = False
    frozen_prefix: bool = False
    exit_head: bool = False
    expert_loads: tuple[float, ...] = field(default=())
    """Per expert, its tokens / the layer's tokens; empty for a dense feed-forward."""


def _ratio(stats: Mapping[str, float], num: str, den: str) -> float | None:
    if num in stats and stats.get(den, 0.0) > 0:
        return min(1.0, max(0.0, float(stats[num]) / float(stats[den])))
    return None


def _expert_loads(stats: Mapping[str, float], top_k: int) -> tuple[float, ...]:
    """Each expert's share of the layer's tokens; () without MoE counters."""
    counts: dict[int, float] = {}
    prefix = ""
    for key, value in stats.items():
        match = _EXPERT.match(key)
        if match:
            counts[int(match["e"])] = float(value)
            prefix = f"{match['path']}." if match["path"] else ""
    assignments = float(stats.get(f"{prefix}assignments", 0.0))
    if not counts or assignments <= 0:
        return ()
    # Every token that reaches the layer makes top_k assignments (a dropped one included).
    tokens = assignments / top_k
    return tuple(counts[e] / tokens for e in sorted(counts))


def block_state(
    layer: int, stats: Mapping[str, float], no_grad_below: int, top_k: int = 1
) -> LayerState:
    """Layer ``layer``'s state from its ``scheme_stats`` counters (see the module docstring)."""
    tokens = _ratio(stats, "depth_router.processed", "depth_router.tokens")
    kv = NO_KV
    active = _ratio(stats, "processed", "tokens")
    if active is not None:
        tokens, kv = active, 1.0
    density = _ratio(stats, "attn.kept_blocks", "attn.causal_blocks")
    if density is None:
        density = float(stats.get("attn.density", 1.0))
    prefix = layer < no_grad_below
    return LayerState(
        layer=layer,
        neurons_kept=1.0 - float(stats.get("sparsity.neuron", 0.0)),
        heads_kept=1.0 - float(stats.get("sparsity.head", 0.0)),
        tokens_kept=1.0 if tokens is None else tokens,
        kv_tokens_kept=kv,
        attention_density=density,
        frozen=prefix or bool(stats.get("frozen", 0.0)),
        frozen_prefix=prefix,
        exit_head="exit_head.reached" in stats,
        expert_loads=_expert_loads(stats, top_k),
    )


def layer_states(detail: Mapping[str, Any], num_layers: int, top_k: int = 1) -> list[LayerState]:
    """Every layer's state (embedding, blocks, head) from one ``scheme_stats`` event detail.

    ``num_layers`` is the model's placed layer count, ``top_k`` MoE's experts per token; a
    layer missing from ``detail["layers"]`` (it has no counters) reads as untouched. The head of
    an early-exit model runs on the tokens still active after the last block: that block's
    processed tokens less those that exited there.
    """
    per_layer: Mapping[str, Mapping[str, float]] = detail.get("layers") or {}
    no_grad_below = int(detail.get("no_grad_below", 0) or 0)
    out = [
        block_state(i, per_layer.get(str(i)) or {}, no_grad_below, top_k) for i in range(num_layers)
    ]
    last = per_layer.get(str(num_layers - 2)) or {}
    if num_layers >= 2 and last.get("tokens", 0.0) > 0 and "processed" in last:
        left = float(last["processed"]) - float(last.get("exit_head.exited", 0.0))
        head = out[-1]
        out[-1] = LayerState(
            layer=head.layer,
            tokens_kept=min(1.0, max(0.0, left / float(last["tokens"]))),
            frozen=head.frozen,
            frozen_prefix=head.frozen_prefix,
        )
    return out


def job_layer_states(cfg: JobConfig, detail: Mapping[str, Any]) -> list[LayerState]:
    """:func:`layer_states` for a job: its placed layers and its MoE ``top_k`` (1 without)."""
    moe = cfg.schemes.moe
    return layer_states(detail, cfg.model.num_layers, moe.top_k if moe is not None else 1)
