"""The run log's fixed layout: which datasets exist, their columns, dtypes, units and chunking.

Why a fixed set of tables: HDF5's single-writer/multiple-reader (SWMR) mode forbids creating
objects once it is switched on, so every dataset a run will ever append to is created up front.
Why long ("tidy") tables: the number of stages, and even of layers, changes over a run (rebalance,
pack, shrink), so per-stage and per-layer values are rows keyed by ``(step, stage)`` or
``(step, layer)`` rather than columns. Each table is one 1-D resizable chunked dataset with a
compound dtype, so a row is appended in one resize and a reader never sees half a row.

Why JSON details live in a ``uint8`` blob: variable-length strings sit in HDF5's global heap, which
is not SWMR-safe. A concurrent reader of a vlen-string dataset fails with "address of object past
end of allocation" (checked with h5py 3.16 / HDF5 2.0). Event rows therefore hold an
``(offset, length)`` into ``/event_detail``, a plain byte dataset written before the rows that
point into it.

Every table, column and attribute here is documented with its unit in ``docs/runlog.md``; a test
checks that the two agree. Bump :data:`SCHEMA_VERSION` on any incompatible change.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 2
"""Layout version stored in the root attribute ``schema_version``; readers refuse newer files.

Version 2 added ``segment`` (every table) and ``superseded`` (the step-keyed tables), which mark
the rows of steps that a resumed run redid; version 1 files are still read."""

KIND_MAX_BYTES = 32
"""Longest event kind in bytes (UTF-8); kinds are short identifiers such as ``rebalance``."""

UNKNOWN_INT = -1
"""Stored where an integer is not known (e.g. ``peak_mem_bytes`` when not measured)."""

END_EVENT_KIND = "end"
"""Kind of the event :meth:`RunLogWriter.close` writes; its absence means the run did not close."""

ERROR_EVENT_KIND = "error"
"""Kind of the event the writer's context manager records when the ``with`` body raises."""

RESTART_EVENT_KIND = "restart"
"""Kind of the event written when a writer resumes an existing run log."""

SEGMENT_COLUMN = "segment"
"""Which launch of the run wrote a row: 0 for the first, +1 at every resume (every table)."""

SUPERSEDED_COLUMN = "superseded"
"""1 on a row of a step that a later segment redid (it resumed from a checkpoint taken before
that step); 0 on the authoritative rows. Only the step-keyed tables carry it; events are history
and are never superseded."""

V2_COLUMNS = (SEGMENT_COLUMN, SUPERSEDED_COLUMN)
"""Columns that schema version 1 files lack (readers add them as zeros)."""
AB_ARM_COLUMN = "ab_arm"
"""``steps``: the step's arm in an A/B run (0 static split, 1 the balancer's plan; -1 not an
A/B run). See :mod:`dynmo_hpc.train.ab_arms`."""
WALL_CPU_COLUMN = "wall_s_per_cpu_s"
"""``steps``: the step's layers' wall seconds over their thread CPU seconds, largest over the
ranks (:func:`dynmo_hpc.train.ab_arms.wall_s_per_cpu_s`); NaN where not measured."""
REPLICA_COLUMN = "replica"
"""``stage_times``: the data-parallel replica of the row's stage (0 with one replica)."""
ALLREDUCE_COLUMN = "allreduce_s"
"""``stage_times``: seconds the stage spent in the step's gradient all-reduce between replicas
(0 with one replica; NaN where not measured)."""
ADDED_COLUMNS: dict[str, dict[str, float]] = {
    "steps": {AB_ARM_COLUMN: -1, WALL_CPU_COLUMN: float("nan")},
    "stage_times": {REPLICA_COLUMN: 0, ALLREDUCE_COLUMN: float("nan")},
}
"""Columns added within schema version 2, per table, with the value a file written before
them reads as (readers fill it in; a resumed run's copy of the old rows gets it too). Old
readers ignore the extra columns, so the version is unchanged."""
STEP_KEYED_TABLES = (
    "steps",
    "stage_times",
    "layer_costs",
    "partitions",
    "layer_states",
    "expert_loads",
    "eval",
)
"""Tables whose rows belong to one step and so can be superseded by a redo of that step."""


@dataclass(frozen=True)
class TableSpec:
    """One appendable table: a 1-D resizable chunked dataset of compound rows."""

    name: str
    """Dataset name under the file root."""
    dtype: np.dtype
    """Compound row type; field names carry units (``_s``, ``_bytes``) or are counts/indices."""
    chunk_rows: int
    """Rows per chunk: about 16-256 KiB, so each flush touches few chunks and reads stay fast."""


STEPS = TableSpec(
    name="steps",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("wall_s", "<f8"),
            ("loss", "<f8"),
            ("step_time_s", "<f8"),
            ("tokens_per_s", "<f8"),
            ("lr", "<f8"),
            ("num_stages", "<i4"),
            ("num_ranks", "<i4"),
            ("num_nodes", "<i4"),
            ("segment", "<i4"),
            ("superseded", "u1"),
            ("ab_arm", "i1"),
            ("wall_s_per_cpu_s", "<f8"),
        ]
    ),
    chunk_rows=1024,
)

STAGE_TIMES = TableSpec(
    name="stage_times",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("stage", "<i4"),
            ("compute_s", "<f8"),
            ("idle_s", "<f8"),
            ("segment", "<i4"),
            ("superseded", "u1"),
            ("replica", "<i4"),
            ("allreduce_s", "<f8"),
        ]
    ),
    chunk_rows=4096,
)

LAYER_COSTS = TableSpec(
    name="layer_costs",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("layer", "<i4"),
            ("forward_s", "<f8"),
            ("backward_s", "<f8"),
            ("num_params", "<i8"),
            ("param_bytes", "<i8"),
            ("grad_bytes", "<i8"),
            ("optim_bytes", "<i8"),
            ("segment", "<i4"),
            ("superseded", "u1"),
        ]
    ),
    chunk_rows=4096,
)

PARTITIONS = TableSpec(
    name="partitions",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("stage", "<i4"),
            ("start_layer", "<i4"),
            ("end_layer", "<i4"),
            ("peak_mem_bytes", "<i8"),
            ("segment", "<i4"),
            ("superseded", "u1"),
        ]
    ),
    chunk_rows=2048,
)

EVENTS = TableSpec(
    name="events",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("wall_s", "<f8"),
            ("kind", f"S{KIND_MAX_BYTES}"),
            ("detail_offset", "<i8"),
            ("detail_len", "<i8"),
            ("segment", "<i4"),
        ]
    ),
    chunk_rows=512,
)

LAYER_STATES = TableSpec(
    name="layer_states",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("layer", "<i4"),
            ("neurons_kept", "<f8"),
            ("heads_kept", "<f8"),
            ("tokens_kept", "<f8"),
            ("kv_tokens_kept", "<f8"),
            ("attention_density", "<f8"),
            ("frozen", "u1"),
            ("frozen_prefix", "u1"),
            ("exit_head", "u1"),
            ("segment", "<i4"),
            ("superseded", "u1"),
        ]
    ),
    chunk_rows=4096,
)
"""Per (load report, layer): what the dynamic schemes had done to the layer over the report's
interval (:mod:`dynmo_hpc.runlog.trajectory`), so the run's scheme trajectory can drive the
cost model of another model (``dynmo-hpc simulate --model``)."""

EXPERT_LOADS = TableSpec(
    name="expert_loads",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("layer", "<i4"),
            ("expert", "<i4"),
            ("load", "<f8"),
            ("segment", "<i4"),
            ("superseded", "u1"),
        ]
    ),
    chunk_rows=4096,
)
"""Per (load report, MoE layer, expert): the expert's routed tokens over the report's interval
as a fraction of the tokens that reached the layer."""

EVAL = TableSpec(
    name="eval",
    dtype=np.dtype(
        [
            ("step", "<i8"),
            ("loss", "<f8"),
            ("segment", "<i4"),
            ("superseded", "u1"),
        ]
    ),
    chunk_rows=1024,
)
"""Per validation pass (``train.eval_interval``): the mean LM loss over the fixed validation
windows after the step's update."""

OPTIONAL_TABLES = (LAYER_STATES.name, EXPERT_LOADS.name, EVAL.name)
"""Tables added within schema version 2: a file written before them lacks them, and readers
(and a resumed writer) treat them as empty."""

EVENT_DETAIL = "event_detail"
"""Dataset of ``uint8``: the UTF-8 JSON details of all events, concatenated."""

EVENT_DETAIL_CHUNK_BYTES = 64 * 1024
"""Chunk size of ``/event_detail``."""

TABLES: tuple[TableSpec, ...] = (
    STEPS,
    STAGE_TIMES,
    LAYER_COSTS,
    PARTITIONS,
    LAYER_STATES,
    EXPERT_LOADS,
    EVAL,
    EVENTS,
)
"""Every compound table, in the order the writer flushes them (events last, after their bytes)."""

ATTRS_CRC_ATTR = "attrs_crc32"
"""Root attribute holding :func:`attrs_crc32` of all the others. Why: HDF5 checksums its own
metadata and (with Fletcher-32) every table chunk, but not attribute values kept in its heaps,
so a flipped bit in ``config_yaml`` would otherwise go unseen. Files without it are not checked."""

ROOT_ATTRS: tuple[str, ...] = (
    "schema_version",
    "package_version",
    "config_yaml",
    "start_time_utc",
    "start_time_unix_s",
    "hostname",
    "pid",
    "python_version",
    "h5py_version",
    "hdf5_version",
    ATTRS_CRC_ATTR,
)
"""Root attributes the writer always sets; caller ``meta`` keys may not reuse these names."""


def attrs_crc32(attrs: dict[str, Any]) -> int:
    """CRC-32 of the root attributes except :data:`ATTRS_CRC_ATTR`, in a canonical JSON form."""
    plain = {}
    for key, value in attrs.items():
        if key == ATTRS_CRC_ATTR:
            continue
        if isinstance(value, np.generic):
            value = value.item()
        plain[key] = value.decode() if isinstance(value, bytes) else value
    return zlib.crc32(json.dumps(plain, sort_keys=True).encode())


def with_added_columns(name: str, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``rows`` of table ``name`` in ``dtype``: columns it lacks from :data:`ADDED_COLUMNS`
    get their defaults (a file written before they existed); other columns are copied."""
    names = rows.dtype.names or ()
    if names == dtype.names:
        return rows
    out = np.zeros(len(rows), dtype=dtype)
    for column in dtype.names or ():
        if column in names:
            out[column] = rows[column]
        else:
            out[column] = ADDED_COLUMNS.get(name, {}).get(column, 0)
    return out
