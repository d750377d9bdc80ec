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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd
import yaml

from dynmo_hpc.errors import RunLogError
from dynmo_hpc.isolation import IsolatedCrash, IsolatedTimeout, call_isolated
from dynmo_hpc.runlog import precheck, schema
from dynmo_hpc.runlog.torn_chunk import is_checksum_failure, read_rows

log = logging.getLogger(__name__)

READ_BASE_TIMEOUT_S = 10.0
READ_BYTES_PER_S = 20e6
"""With READ_BASE_TIMEOUT_S: see :func:`read_timeout_s`."""
DAMAGED_HINT = "HINT: the file is damaged; restore it from a backup or rerun the job"
FOREIGN_HINT = "HINT: pass the run.h5 that `dynmo-hpc run` wrote (runs/<job>/run.h5)"


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
    """One row per (step, replica, stage): compute_s, idle_s, replica, allreduce_s."""
    layer_costs: pd.DataFrame
    """One row per (load report step, layer): forward_s, backward_s, num_params, *_bytes."""
    partitions: pd.DataFrame
    """One row per (load report step, stage): layers [start_layer, end_layer), peak_mem_bytes."""
    events: pd.DataFrame
    """One row per event: step, wall_s, kind (str), detail (dict)."""

    superseded: dict[str, pd.DataFrame]
    """Per step-keyed table, the rows of steps a later segment redid (empty if none were)."""
    layer_states: pd.DataFrame = field(default_factory=lambda: _empty(schema.LAYER_STATES.dtype))
    """One row per (load report step, layer): the schemes' state (``docs/runlog.md``); empty for
    a file written before the table existed."""
    expert_loads: pd.DataFrame = field(default_factory=lambda: _empty(schema.EXPERT_LOADS.dtype))
    """One row per (load report step, MoE layer, expert): the expert's share of the tokens."""
    eval: pd.DataFrame = field(default_factory=lambda: _empty(schema.EVAL.dtype))
    """One row per validation pass: step, loss (``train.eval_interval``); empty without one."""

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


def _empty(dtype: np.dtype) -> pd.DataFrame:
    """A table with ``dtype``'s columns and no rows (an optional table a file lacks)."""
    return pd.DataFrame(np.zeros(0, dtype=dtype))


def _py(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _events(f: h5py.File, path: Path) -> pd.DataFrame:
    rows = read_rows(f[schema.EVENTS.name])
    has_segment = schema.SEGMENT_COLUMN in (rows.dtype.names or ())
    blob = read_rows(f[schema.EVENT_DETAIL]).tobytes()
    records = []
    for row in rows:
        start, length = int(row["detail_offset"]), int(row["detail_len"])
        if start < 0 or length < 0 or start + length > len(blob):
            # a live file's event whose detail is not flushed yet (cannot happen with the
            # writer's ordering), or damaged offsets: the row is skipped, not trusted
            log.warning("event at step %d: detail not yet written, skipped", row["step"])
            continue
        try:
            kind = row["kind"].decode()
            detail = json.loads(blob[start : start + length])
        except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
            raise RunLogError(
                f"{path}: the event at step {int(row['step'])} has an unreadable kind or detail "
                f"({type(exc).__name__}); {DAMAGED_HINT}"
            ) from None
        if not isinstance(detail, dict):
            raise RunLogError(
                f"{path}: the event at step {int(row['step'])} has a detail that is not a JSON "
                f"object; {DAMAGED_HINT}"
            )
        records.append(
            {
                "step": int(row["step"]),
                "wall_s": float(row["wall_s"]),
                "kind": kind,
                "detail": detail,
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
    for column, default in schema.ADDED_COLUMNS.get(name, {}).items():
        if column not in table.columns:
            table[column] = default
    if name not in schema.STEP_KEYED_TABLES:
        return table, table.iloc[0:0]
    if schema.SUPERSEDED_COLUMN not in table.columns:
        table[schema.SUPERSEDED_COLUMN] = 0
    redone = table[schema.SUPERSEDED_COLUMN].astype(bool)
    superseded = table[redone].reset_index(drop=True)
    if include_superseded:
        return table, superseded
    return table[~redone].reset_index(drop=True), superseded


def load(
    path: str | Path, *, include_superseded: bool = False, timeout_s: float | None = None
) -> RunLog:
    """Read a run log (finished, live or crashed) into a :class:`RunLog`.

    ``include_superseded=True`` keeps the rows of redone steps in the tables too (their
    ``superseded`` column is 1); by default they are only in :attr:`RunLog.superseded`.

    Why so guarded: a damaged file can make the HDF5 library loop (see
    :mod:`~dynmo_hpc.runlog.precheck`), so the superblock is checked first and the file is read
    in a forked child that is killed after ``timeout_s`` (default: :func:`read_timeout_s`). A file
    this process itself is writing is read in-process: it is not foreign, and a forked child
    must not touch the writer's HDF5 state.

    Raises:
        FileNotFoundError: no file at ``path``.
        RunLogError: the file is damaged, not a run log, or of a newer schema.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run log; HINT: runs write runs/<job>/run.h5")
    superblock = precheck.check(path)
    swmr = superblock.open_for_write
    if _open_in_this_process(path):
        return _read(path, include_superseded, swmr)
    limit_s = read_timeout_s(superblock.eof_bytes) if timeout_s is None else timeout_s
    try:
        return call_isolated(_read, path, include_superseded, swmr, timeout_s=limit_s)
    except IsolatedTimeout:
        raise RunLogError(
            f"{path}: reading it took over {limit_s:g} s and was stopped (the HDF5 library loops "
            f"on damaged metadata); {DAMAGED_HINT}"
        ) from None
    except IsolatedCrash as exc:
        log.debug("reading %s failed in the child:\n%s", path, exc.child_traceback)
        raise RunLogError(f"{path} cannot be read ({exc}); {DAMAGED_HINT}") from None


def read_timeout_s(file_bytes: int) -> float:
    """How long reading a run log of ``file_bytes`` may take before it counts as hung.

    Reading runs at hundreds of MB/s; 10 s plus 1 s per 20 MB leaves a wide margin on a slow
    shared file system and still ends a hang quickly.
    """
    return READ_BASE_TIMEOUT_S + file_bytes / READ_BYTES_PER_S


def _open_in_this_process(path: Path) -> bool:
    """True when this process has ``path`` open through h5py (e.g. a writer in a test)."""
    target = os.path.realpath(path)
    for file_id in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
        name = file_id.name
        if os.path.realpath(name.decode() if isinstance(name, bytes) else name) == target:
            return True
    return False


def _open(path: Path, swmr: bool) -> h5py.File:
    """Open read-only; SWMR only for a file a writer holds (or held when it was killed)."""
    try:
        return h5py.File(path, "r", swmr=swmr, locking="best-effort")
    except OSError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not swmr and "open for write" in reason:  # a writer reopened it since the precheck
        return _open(path, swmr=True)
    raise RunLogError(f"{path}: HDF5 cannot open it ({reason}); {DAMAGED_HINT}")


def _check_is_run_log(path: Path, f: h5py.File, attrs: dict[str, Any]) -> None:
    """Refuse foreign HDF5 files and files of a newer schema, naming what is wrong."""
    if "schema_version" not in attrs:
        raise RunLogError(
            f"{path} is an HDF5 file but not a dynmo_hpc run log (no schema_version "
            f"attribute); {FOREIGN_HINT}"
        )
    try:
        version = int(attrs["schema_version"])
    except (TypeError, ValueError):
        version = -1
    if not 1 <= version <= schema.SCHEMA_VERSION:
        raise RunLogError(
            f"{path}: schema_version={attrs['schema_version']!r}, this dynmo_hpc reads "
            f"1..{schema.SCHEMA_VERSION}; HINT: read it with the dynmo_hpc version that "
            "wrote it (root attribute package_version)"
        )
    stored_crc = attrs.get(schema.ATTRS_CRC_ATTR)
    if stored_crc is not None and stored_crc != schema.attrs_crc32(attrs):
        raise RunLogError(
            f"{path}: its root attributes (config_yaml, versions, meta) fail their CRC-32 check "
            f"(corrupt bytes); {DAMAGED_HINT}"
        )
    linked = set(f.keys())  # link names only: opening each object is what can fail
    for spec in schema.TABLES:
        if spec.name in schema.OPTIONAL_TABLES and spec.name not in linked:
            continue  # written before the table existed
        ds = f.get(spec.name)
        if spec.name in linked and ds is None:  # h5py's get() hides why it could not open it
            raise RunLogError(
                f"{path}: its table /{spec.name} cannot be opened (damaged metadata); "
                f"{DAMAGED_HINT}"
            )
        fields = getattr(getattr(ds, "dtype", None), "names", None) or ()
        added = schema.ADDED_COLUMNS.get(spec.name, {})
        wanted = [
            n for n in spec.dtype.names or () if n not in schema.V2_COLUMNS and n not in added
        ]
        if not isinstance(ds, h5py.Dataset) or not set(wanted) <= set(fields):
            raise RunLogError(
                f"{path} is not a dynmo_hpc run log, or a damaged one: no table /{spec.name} "
                f"with columns {', '.join(wanted)}; {FOREIGN_HINT}"
            )
    if not isinstance(f.get(schema.EVENT_DETAIL), h5py.Dataset):
        raise RunLogError(
            f"{path} is not a dynmo_hpc run log, or a damaged one: no /{schema.EVENT_DETAIL}; "
            f"{FOREIGN_HINT}"
        )


def _parse_config(path: Path, text: Any) -> dict[str, Any]:
    """The job config from the ``config_yaml`` attribute: a mapping of sections, or empty."""
    if not isinstance(text, str):
        raise RunLogError(
            f"{path}: the config_yaml attribute is of type {type(text).__name__}, not text; "
            f"{DAMAGED_HINT}"
        )
    try:
        config = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RunLogError(
            f"{path}: the config_yaml attribute is not valid YAML ({first}); {DAMAGED_HINT}"
        ) from None
    if config is None:
        return {}
    bad = (
        "is not a mapping"
        if not isinstance(config, dict)
        else next(
            (
                f"has section {key!r} that is not a mapping"
                for key, value in config.items()
                if not isinstance(key, str) or not isinstance(value, dict | None)
            ),
            None,
        )
    )
    if bad is not None:
        raise RunLogError(
            f"{path}: the config_yaml attribute is not a job config (it {bad}); {DAMAGED_HINT}"
        )
    return config


def _read(path: Path, include_superseded: bool, swmr: bool) -> RunLog:
    """Open and read the file (in the isolated child, see :func:`load`); validates as it goes."""
    with _open(path, swmr) as f:
        try:
            attrs = {key: _py(value) for key, value in f.attrs.items()}
            _check_is_run_log(path, f, attrs)
            tables = {
                spec.name: pd.DataFrame(read_rows(f[spec.name]))
                if spec.name in f
                else _empty(spec.dtype)
                for spec in schema.TABLES
            }
            events = _events(f, path)
        except (OSError, KeyError, TypeError, RuntimeError, UnicodeDecodeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if is_checksum_failure(exc):  # the only filter is Fletcher-32
                reason = "a table's data fail their Fletcher-32 checksum: corrupt bytes"
            raise RunLogError(f"{path}: HDF5 cannot read it ({reason}); {DAMAGED_HINT}") from None
    superseded = {}
    for name in schema.STEP_KEYED_TABLES:
        tables[name], superseded[name] = _split_superseded(name, tables[name], include_superseded)
    return RunLog(
        path=path,
        attrs=attrs,
        config=_parse_config(path, attrs.get("config_yaml", "")),
        steps=tables[schema.STEPS.name],
        stage_times=tables[schema.STAGE_TIMES.name],
        layer_costs=tables[schema.LAYER_COSTS.name],
        partitions=tables[schema.PARTITIONS.name],
        events=events,
        superseded=superseded,
        layer_states=tables[schema.LAYER_STATES.name],
        expert_loads=tables[schema.EXPERT_LOADS.name],
        eval=tables[schema.EVAL.name],
    )
