"""A run log's scheme trajectory (:class:`~dynmo_hpc.sim.scale.Trajectory`): the edge between
the run log's tables and :mod:`dynmo_hpc.sim.scale`.

Read from the ``layer_states`` and ``expert_loads`` tables; a run log written before they
existed falls back to its ``scheme_stats`` events (the same numbers, converted with
:func:`dynmo_hpc.runlog.trajectory.layer_states`); a run with no scheme has untouched layers at
each load report.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from dynmo_hpc.runlog import RunLog
from dynmo_hpc.runlog.trajectory import SCHEME_STATS, LayerState, layer_states
from dynmo_hpc.sim.cost_model import SchemeState
from dynmo_hpc.sim.scale import Trajectory


def scheme_state(row: LayerState, sparse_block_size: int = 16) -> SchemeState:
    """The cost model's view of one logged layer state (``sparse_block_size``: the run's
    ``schemes.sparse_attention.block_size``)."""
    kv = None if math.isnan(row.kv_tokens_kept) else row.kv_tokens_kept
    return SchemeState(
        neurons_kept=row.neurons_kept,
        heads_kept=row.heads_kept,
        tokens_kept=row.tokens_kept,
        kv_tokens_kept=kv,
        attention_density=row.attention_density,
        frozen=row.frozen or row.frozen_prefix,
        frozen_prefix=row.frozen_prefix,
        expert_loads=tuple(row.expert_loads) if row.expert_loads else None,
        exit_head=row.exit_head,
        sparse_block_size=sparse_block_size,
    )


def _from_tables(states: pd.DataFrame, loads: pd.DataFrame) -> dict[int, list[LayerState]]:
    out: dict[int, list[LayerState]] = {}
    for step, rows in states.groupby("step", sort=True):
        step_loads = loads[loads["step"] == step]
        layers = []
        for row in rows.sort_values("layer").itertuples(index=False):
            mine = step_loads[step_loads["layer"] == row.layer].sort_values("expert")
            layers.append(
                LayerState(
                    layer=int(row.layer),
                    neurons_kept=float(row.neurons_kept),
                    heads_kept=float(row.heads_kept),
                    tokens_kept=float(row.tokens_kept),
                    kv_tokens_kept=float(row.kv_tokens_kept),
                    attention_density=float(row.attention_density),
                    frozen=bool(row.frozen),
                    frozen_prefix=bool(row.frozen_prefix),
                    exit_head=bool(row.exit_head),
                    expert_loads=tuple(float(x) for x in mine["load"]),
                )
            )
        out[int(step)] = layers
    return out


def _from_events(run: RunLog, num_layers: int) -> dict[int, list[LayerState]]:
    moe: dict[str, Any] = (run.config.get("schemes") or {}).get("moe") or {}
    top_k = int(moe.get("top_k", 1))
    rows = run.events[run.events["kind"] == SCHEME_STATS]
    return {
        int(r["step"]): layer_states(r["detail"], num_layers, top_k) for _, r in rows.iterrows()
    }


def trajectory_from_runlog(run: RunLog) -> Trajectory:
    """The run's per-report scheme state per layer; ValueError when it has no load report."""
    num_layers = int((run.config.get("model") or {}).get("num_blocks", 0)) + 2
    by_step = _from_tables(run.layer_states, run.expert_loads)
    if not by_step:
        by_step = _from_events(run, num_layers)
    if not by_step:
        by_step = {
            step: [LayerState(layer=i) for i in range(num_layers)] for step in run.report_steps()
        }
    if not by_step:
        raise ValueError(
            f"{run.path}: no load report and no scheme state to replay; HINT: run at least "
            "balance.interval steps"
        )
    sparse = (run.config.get("schemes") or {}).get("sparse_attention") or {}
    block = int(sparse.get("block_size", 16))
    steps = sorted(by_step)
    return Trajectory(
        steps=steps, states=[[scheme_state(s, block) for s in by_step[step]] for step in steps]
    )
