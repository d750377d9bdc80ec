"""Load a run log into pandas DataFrames, whether the run finished, is running, or was killed.

Why always ``swmr=True``: a file whose writer is still running, or was killed, keeps HDF5's
"open for write" flag; a plain read-only open refuses it ("may use <h5clear file>"), while a SWMR
reader opens it and sees every row up to the writer's last flush. Tables are read in one pass,
so on a live file they may end a flush apart (e.g. a step row whose stage times are not in yet).

A resumed run appends to its run log (schema 2): every row carries the ``segment`` (launch) that
wrote it, and rows of steps that a later segment redid are marked ``superseded``. :func:`load`
returns the authoritative rows only (one history, as if the run had never stopped) unless asked
for all of them; :attr:`RunLog.restarts` lists the restarts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd
import yaml

from dynmo_hpc.runlog import schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLog:
    """Everything one run log holds; tables are long (one row per step, stage or layer)."""

    path: Path
    """The file it was loaded from."""
    attrs: dict[str, Any]
    """Root attributes (schema and package version, start time, host, launcher meta, ...)."""
    config: dict[str, Any]
    """The resolved job config, parsed from the ``config_yaml`` attribute."""
    steps: pd.DataFrame
    """One row per step: step, wall_s, loss, step_time_s, tokens_per_s, lr, num_stages, ..."""
    stage_times: pd.DataFrame
    """One row per (step, stage): compute_s, idle_s."""
    layer_costs: pd.DataFrame
    """One row per (load report step, layer): forward_s, backward_s, num_params, *_bytes."""
    partitions: pd.DataFrame
    """One row per (load report step, stage): layers [start_layer, end_layer), peak_mem_bytes."""
    events: pd.DataFrame
    """One row per event: step, wall_s, kind (str), detail (dict)."""

    superseded: dict[str, pd.DataFrame]
    """Per step-keyed table, the rows of steps a later segment redid (empty if none were)."""

    @property
    def restarts(self) -> pd.DataFrame:
        """One row per resume: step (the last step kept), segment, checkpoint, restore_s, ..."""
        rows = self.events[self.events["kind"] == schema.RESTART_EVENT_KIND]
        records = []
        for _, row in rows.iterrows():
            detail = row["detail"]
            records.append(
                {
                    "step": int(row["step"]),
                    "wall_s": float(row["wall_s"]),
                    "segment": int(detail.get("segment", row.get("segment", 0))),
                    "checkpoint": detail.get("checkpoint"),
                    "checkpoint_step": detail.get("checkpoint_step"),
                    "restore_s": detail.get("restore_s"),
                    "superseded_rows": int(detail.get("superseded_rows", 0)),
                    "num_stages": len(detail["parts"]) - 1 if "parts" in detail else None,
                }
            )
        columns = [
            "step",
            "wall_s",
            "segment",
            "checkpoint",
            "checkpoint_step",
            "restore_s",
            "superseded_rows",
            "num_stages",
        ]
        return pd.DataFrame.from_records(records, columns=columns)

    @property
    def end_status(self) -> str | None:
        """The status ``close()`` recorded ("ok", "error"), or None if the writer never closed."""
        ends = self.events[self.events["kind"] == schema.END_EVENT_KIND]
        if ends.empty:
            return None
        return str(ends["detail"].iloc[-1].get("status", "ok"))

    def parts_at(self, step: int) -> list[int]:
        """Boundaries of the partition reported at ``step`` (``parts[0]=0 .. parts[P]=N``)."""
        rows = self.partitions[self.partitions["step"] == step].sort_values("stage")
        if rows.empty:
            raise KeyError(f"no load report at step {step}; reports at {self.report_steps()}")
        return [0, *rows["end_layer"].astype(int).tolist()]

    def report_steps(self) -> list[int]:
        """Steps at which a load report (layer costs + partition) was logged."""
        return sorted(int(s) for s in self.partitions["step"].unique())


def _py(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _events(f: h5py.File) -> pd.DataFrame:
    rows = f[schema.EVENTS.name][()]
    has_segment = schema.SEGMENT_COLUMN in (rows.dtype.names or ())
    blob = f[schema.EVENT_DETAIL][()].tobytes()
    records = []
    for row in rows:
        start, length = int(row["detail_offset"]), int(row["detail_len"])
        if start + length > len(blob):  # cannot happen with the writer's ordering; be safe
            log.warning("event at step %d: detail not yet written, skipped", row["step"])
            continue
        records.append(
            {
                "step": int(row["step"]),
                "wall_s": float(row["wall_s"]),
                "kind": row["kind"].decode(),
                "detail": json.loads(blob[start : start + length]),
                "segment": int(row[schema.SEGMENT_COLUMN]) if has_segment else 0,
            }
        )
    columns = ["step", "wall_s", "kind", "detail", "segment"]
    return pd.DataFrame.from_records(records, columns=columns)


def _split_superseded(
    name: str, table: pd.DataFrame, include_superseded: bool
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(authoritative rows, superseded rows) of one table; schema 1 files get the columns."""
    if schema.SEGMENT_COLUMN not in table.columns:
        table[schema.SEGMENT_COLUMN] = 0
    if name not in schema.STEP_KEYED_TABLES:
        return table, table.iloc[0:0]
    if schema.SUPERSEDED_COLUMN not in table.columns:
        table[schema.SUPERSEDED_COLUMN] = 0
    redone = table[schema.SUPERSEDED_COLUMN].astype(bool)
    superseded = table[redone].reset_index(drop=True)
    if include_superseded:
        return table, superseded
    return table[~redone].reset_index(drop=True), superseded


def load(path: str | Path, *, include_superseded: bool = False) -> RunLog:
    """Read a run log (finished, live or crashed) into a :class:`RunLog`.

    ``include_superseded=True`` keeps the rows of redone steps in the tables too (their
    ``superseded`` column is 1); by default they are only in :attr:`RunLog.superseded`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run log; HINT: runs write runs/<job>/run.h5")
    with h5py.File(path, "r", swmr=True, locking="best-effort") as f:
        attrs = {key: _py(value) for key, value in f.attrs.items()}
        version = int(attrs.get("schema_version", -1))
        if not 1 <= version <= schema.SCHEMA_VERSION:
            raise ValueError(
                f"{path}: schema_version={version}, this dynmo_hpc reads "
                f"1..{schema.SCHEMA_VERSION}; HINT: read it with the dynmo_hpc version that "
                "wrote it (root attribute package_version)"
            )
        tables = {spec.name: pd.DataFrame(f[spec.name][()]) for spec in schema.TABLES}
        events = _events(f)
    superseded = {}
    for name in schema.STEP_KEYED_TABLES:
        tables[name], superseded[name] = _split_superseded(name, tables[name], include_superseded)
    config = yaml.safe_load(attrs.get("config_yaml", "")) or {}
    if not isinstance(config, dict):
        log.warning("%s: config_yaml is not a mapping; config left empty", path)
        config = {}
    return RunLog(
        path=path,
        attrs=attrs,
        config=config,
        steps=tables[schema.STEPS.name],
        stage_times=tables[schema.STAGE_TIMES.name],
        layer_costs=tables[schema.LAYER_COSTS.name],
        partitions=tables[schema.PARTITIONS.name],
        events=events,
        superseded=superseded,
    )
