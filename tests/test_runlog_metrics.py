"""Derived numbers of the report (pure functions of DataFrames): exact cases."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dynmo_hpc.runlog import metrics


def _steps(tokens_per_s: list[float], num_ranks: list[int] | None = None) -> pd.DataFrame:
    n = len(tokens_per_s)
    return pd.DataFrame(
        {
            "step": range(n),
            "wall_s": np.arange(n, dtype=float),
            "loss": np.linspace(5, 1, n),
            "tokens_per_s": tokens_per_s,
            "num_stages": 2,
            "num_ranks": num_ranks or [2] * n,
            "num_nodes": 1,
        }
    )


def test_last_logged_keeps_the_replayed_rows() -> None:
    df = pd.DataFrame({"step": [0, 1, 2, 1, 2, 3], "value": ["a", "b", "c", "B", "C", "D"]})
    assert metrics.last_logged(df)["value"].tolist() == ["a", "B", "C", "D"]
    stages = pd.DataFrame({"step": [0, 0, 1, 1, 1, 1], "stage": [0, 1, 0, 1, 0, 1]})
    stages["v"] = range(6)
    assert metrics.last_logged(stages)["v"].tolist() == [0, 1, 2, 3, 4, 5]  # one block per step


def test_imbalance_is_max_over_mean() -> None:
    st = pd.DataFrame(
        {
            "step": [0, 0, 0, 1, 1, 2, 2],
            "stage": [0, 1, 2, 0, 1, 0, 1],
            "compute_s": [1.0, 2.0, 3.0, 2.0, 2.0, 0.0, 0.0],
            "idle_s": 0.0,
        }
    )
    imb = metrics.imbalance(st)
    assert imb["imbalance"].iloc[:2].tolist() == [1.5, 1.0]
    assert np.isnan(imb["imbalance"].iloc[2])  # no work at all: undefined, not a division error
    assert imb["num_stages"].tolist() == [3, 2, 2]


def test_layer_stage_map_docstring_example() -> None:
    parts = pd.DataFrame(
        {
            "step": [0, 0, 10, 10],
            "stage": [0, 1, 0, 1],
            "start_layer": [0, 2, 0, 3],
            "end_layer": [2, 4, 3, 4],
            "peak_mem_bytes": -1,
        }
    )
    steps, owner = metrics.layer_stage_map(parts)
    assert steps.tolist() == [0, 10]
    assert owner.tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]


def test_event_effect_compares_windows_around_the_event() -> None:
    steps = _steps([100.0] * 10 + [150.0] * 10, num_ranks=[4] * 10 + [2] * 10)
    st = pd.DataFrame(
        {
            "step": np.repeat(np.arange(20), 2),
            "stage": np.tile([0, 1], 20),
            "compute_s": [3.0, 1.0] * 10 + [2.0, 2.0] * 10,
            "idle_s": 0.0,
        }
    )
    events = pd.DataFrame({"step": [9, 19], "kind": ["rebalance", "end"], "detail": [{}, {}]})
    effects = metrics.event_effects(steps, metrics.imbalance(st), events, window_steps=5)
    first = effects.iloc[0]
    assert (first.tokens_per_s_before, first.tokens_per_s_after) == (100.0, 150.0)
    assert (first.imbalance_before, first.imbalance_after) == (1.5, 1.0)
    assert (first.num_ranks_before, first.num_ranks_after) == (4.0, 2.0)
    assert np.isnan(effects.iloc[1].tokens_per_s_after)  # nothing after the last step


def test_throughput_windows_cover_every_step_once() -> None:
    steps = _steps([float(i) for i in range(25)])
    windows = metrics.throughput_windows(steps, metrics.imbalance(pd.DataFrame()), num_windows=4)
    assert windows["first_step"].tolist() == [0, 7, 13, 19]
    assert windows["last_step"].tolist() == [6, 12, 18, 24]
    assert windows["tokens_per_s"].tolist() == [3.0, 9.5, 15.5, 21.5]
    assert windows["imbalance"].isna().all()
