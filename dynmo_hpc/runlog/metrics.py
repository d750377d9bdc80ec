"""Numbers derived from a run log: imbalance, the layer-to-stage map, event effects, throughput.

Pure functions of DataFrames, shared by the text summary and the plots so the two always agree,
and testable without a file.

Replayed steps (a run resumed from a checkpoint older than its crash logs some steps twice) are
resolved by keeping each step's last logged rows: the final history is what the run kept.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def last_logged(df: pd.DataFrame) -> pd.DataFrame:
    """Keep, for every step, only the rows of its last contiguous block; sort by step.

    Example: steps logged 0 1 2 1 2 3 (a replay after a restart) -> the rows of the second 1 and 2.
    """
    if df.empty:
        return df
    block = (df["step"] != df["step"].shift()).cumsum()
    keep = block == block.groupby(df["step"]).transform("max")
    return df[keep].sort_values("step", kind="stable").reset_index(drop=True)


def per_stage(stage_times: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, stage) of already resolved rows (:func:`last_logged`): with
    data-parallel replicas, the stage's slowest copy (largest compute and idle seconds), since
    the replicas wait for each other at the gradient all-reduce; unchanged with one replica.

    Example: replicas computing stage 0 in 1.0 s and 1.2 s at step 3 give one row, 1.2 s.
    """
    if stage_times.empty or "replica" not in stage_times or not stage_times["replica"].any():
        return stage_times
    return stage_times.groupby(["step", "stage"], as_index=False).agg(
        compute_s=("compute_s", "max"), idle_s=("idle_s", "max")
    )


def imbalance(stage_times: pd.DataFrame) -> pd.DataFrame:
    """Per step: max and mean stage compute time and their ratio (1.0 = perfectly balanced);
    a stage's time is its slowest replica's (:func:`per_stage`).

    Why max/mean: the slowest stage sets the pipeline's pace, so this is the slowdown against a
    perfect split of the same work over the same stages.
    """
    columns = ["step", "num_stages", "max_compute_s", "mean_compute_s", "imbalance"]
    if stage_times.empty:
        return pd.DataFrame(columns=columns)
    grouped = per_stage(last_logged(stage_times)).groupby("step")["compute_s"]
    out = pd.DataFrame(
        {
            "num_stages": grouped.size(),
            "max_compute_s": grouped.max(),
            "mean_compute_s": grouped.mean(),
        }
    ).reset_index()
    mean = out["mean_compute_s"].where(out["mean_compute_s"] > 0)
    out["imbalance"] = out["max_compute_s"] / mean
    return out[columns]


def layer_stage_map(partitions: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The stage owning each layer at each load report.

    Returns ``(report_steps, owner)`` with ``owner[layer, i]`` the stage holding ``layer`` at
    ``report_steps[i]`` (NaN where a report covers fewer layers).

    Example: reports at steps 0 and 10 with parts [0,2,4] then [0,3,4] give
    owner = [[0,0],[0,0],[1,0],[1,1]].
    """
    parts = last_logged(partitions)
    report_steps = np.array(sorted(parts["step"].unique()), dtype=np.int64)
    num_layers = int(parts["end_layer"].max()) if not parts.empty else 0
    owner = np.full((num_layers, len(report_steps)), np.nan)
    column = {int(step): i for i, step in enumerate(report_steps)}
    for row in parts.itertuples(index=False):
        owner[int(row.start_layer) : int(row.end_layer), column[int(row.step)]] = row.stage
    return report_steps, owner


def _median(values: pd.Series) -> float:
    return float(values.median()) if len(values) else float("nan")


def event_effects(
    steps: pd.DataFrame,
    imbalance_per_step: pd.DataFrame,
    events: pd.DataFrame,
    *,
    window_steps: int = 20,
) -> pd.DataFrame:
    """For every event: medians over the ``window_steps`` steps up to it and the ones after it.

    An event logged at step ``s`` is taken to act from step ``s + 1``: "before" is steps
    ``<= s``, "after" is steps ``> s``. NaN where a window holds no steps.
    """
    steps = last_logged(steps)
    imb = imbalance_per_step.set_index("step")["imbalance"] if len(imbalance_per_step) else None
    records = []
    for event in events.itertuples(index=False):
        before = steps[steps["step"] <= event.step].tail(window_steps)
        after = steps[steps["step"] > event.step].head(window_steps)
        record: dict[str, object] = {"step": int(event.step), "kind": event.kind}
        for name, window in (("before", before), ("after", after)):
            record[f"tokens_per_s_{name}"] = _median(window["tokens_per_s"])
            record[f"num_ranks_{name}"] = _median(window["num_ranks"])
            record[f"num_nodes_{name}"] = _median(window["num_nodes"])
            values = imb.reindex(window["step"]).dropna() if imb is not None else pd.Series()
            record[f"imbalance_{name}"] = _median(values)
        record["detail"] = event.detail
        records.append(record)
    return pd.DataFrame.from_records(records)


def throughput_windows(
    steps: pd.DataFrame, imbalance_per_step: pd.DataFrame, *, num_windows: int = 10
) -> pd.DataFrame:
    """The run cut into up to ``num_windows`` equal runs of steps, with medians of each.

    Why: a table short enough to read, long enough to show throughput drifting over the run.
    """
    steps = last_logged(steps)
    if steps.empty:
        return pd.DataFrame()
    imb = imbalance_per_step.set_index("step")["imbalance"] if len(imbalance_per_step) else None
    records = []
    for chunk in np.array_split(np.arange(len(steps)), min(num_windows, len(steps))):
        window = steps.iloc[chunk]
        values = imb.reindex(window["step"]).dropna() if imb is not None else pd.Series()
        records.append(
            {
                "first_step": int(window["step"].iloc[0]),
                "last_step": int(window["step"].iloc[-1]),
                "wall_s": float(window["wall_s"].iloc[-1]),
                "tokens_per_s": _median(window["tokens_per_s"]),
                "imbalance": _median(values),
                "loss": float(window["loss"].mean()),
                "num_stages": int(window["num_stages"].iloc[-1]),
                "num_ranks": int(window["num_ranks"].iloc[-1]),
                "num_nodes": int(window["num_nodes"].iloc[-1]),
            }
        )
    return pd.DataFrame.from_records(records)


def resource_hours(steps: pd.DataFrame) -> dict[str, float]:
    """Node-hours and rank-hours the run held, against holding its first allocation throughout.

    Each step row holds its ``num_nodes`` and ``num_ranks`` from the previous row's ``wall_s``
    to its own (the first from 0), so the time between launches (a resize, a restart) is
    charged at what the next launch held. Pass the authoritative rows (one per step).
    """
    if steps.empty:
        return {
            k: 0.0
            for k in ("wall_h", "node_hours", "rank_hours", "first_node_hours", "first_rank_hours")
        }
    ordered = steps.sort_values("wall_s", kind="stable")
    wall = ordered["wall_s"].to_numpy(dtype=float)
    held_s = np.diff(np.concatenate([[0.0], wall]))
    hours = float(wall[-1]) / 3600.0
    return {
        "wall_h": hours,
        "node_hours": float((held_s * ordered["num_nodes"].to_numpy()).sum()) / 3600.0,
        "rank_hours": float((held_s * ordered["num_ranks"].to_numpy()).sum()) / 3600.0,
        "first_node_hours": hours * float(ordered["num_nodes"].iloc[0]),
        "first_rank_hours": hours * float(ordered["num_ranks"].iloc[0]),
    }
