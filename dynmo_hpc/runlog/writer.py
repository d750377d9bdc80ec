"""Rank 0's writer of the HDF5 run log: buffered appends, SWMR, atomic creation.

Why this shape:

- **Cheap per step.** ``log_*`` calls only append tuples to in-memory lists; rows reach the file on
  :meth:`RunLogWriter.flush`, which the trainer calls at every load report, and automatically every
  ``flush_every_rows`` buffered rows or ``flush_every_s`` seconds, whichever comes first.
- **Readable while running, and after SIGKILL.** The file is in SWMR mode (HDF5 1.10 format,
  :data:`LIBVER`, ``swmr_mode = True``): a reader opening it with ``swmr=True`` sees every
  flushed row, and a killed writer leaves a file that such a reader opens with everything up to
  the last flush.
  (A plain ``h5py.File(path, 'r')`` refuses a killed writer's file until ``h5clear -s`` is run;
  :func:`dynmo_hpc.runlog.load` always opens with ``swmr=True``.)
- **Never half-created.** The file is built under a temporary name (attributes, every dataset,
  SWMR switched on) and renamed into place, so ``run.h5`` either does not exist or is complete.
- **Only rank 0 writes.** Other ranks send their numbers to rank 0 over MPI; this module never
  touches MPI, so it is tested in one process.

The layout (datasets, columns, units) is in :mod:`dynmo_hpc.runlog.schema` and ``docs/runlog.md``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import os
import platform
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from dynmo_hpc.errors import RunLogError
from dynmo_hpc.runlog import precheck, schema
from dynmo_hpc.runlog.torn_chunk import read_rows
from dynmo_hpc.runlog.trajectory import LayerState
from dynmo_hpc.version import __version__

log = logging.getLogger(__name__)

LIBVER = ("v110", "v110")
"""The HDF5 file format written: 1.10's, the oldest that supports SWMR, so every HDF5 reader
from 1.10 on (Debian's h5dump, MATLAB, older h5py builds, clusters' HDF5 modules) opens it.
``libver="latest"`` with h5py's bundled HDF5 2.0 writes a format those tools cannot read."""

MetaValue = str | int | float

_RESUME_HINT = (
    "HINT: move it aside (the resumed run then starts a new run log) or restore it from a backup"
)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _json_default(obj: Any) -> Any:
    """Let numpy scalars/arrays and paths into event details; anything else is a caller bug."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(
        f"event detail value {obj!r} of type {type(obj).__name__} is not JSON-serialisable; "
        "HINT: pass str, int, float, bool, None, lists and dicts (numpy values are converted)"
    )


def _check_same_length(what: str, **seqs: Sequence[Any]) -> int:
    lengths = {name: len(seq) for name, seq in seqs.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{what}: all sequences must have one entry each; got lengths {lengths}")
    return next(iter(lengths.values()))


def _check_parts(parts: Sequence[int], num_layers: int) -> None:
    ok = (
        len(parts) >= 2
        and parts[0] == 0
        and parts[-1] == num_layers
        and all(a <= b for a, b in itertools.pairwise(parts))
    )
    if not ok:
        raise ValueError(
            f"parts={list(parts)} is not a partition of {num_layers} layers; expected "
            f"non-decreasing boundaries with parts[0]=0 and parts[-1]={num_layers} (len = stages+1)"
        )


def _create_tables(f: h5py.File) -> None:
    for spec in schema.TABLES:
        f.create_dataset(
            spec.name,
            shape=(0,),
            maxshape=(None,),
            chunks=(spec.chunk_rows,),
            dtype=spec.dtype,
            fletcher32=True,
        )
    f.create_dataset(
        schema.EVENT_DETAIL,
        shape=(0,),
        maxshape=(None,),
        chunks=(schema.EVENT_DETAIL_CHUNK_BYTES,),
        dtype=np.uint8,
        fletcher32=True,
    )


def _append(ds: h5py.Dataset, values: np.ndarray) -> None:
    start = ds.shape[0]
    ds.resize((start + len(values),))
    ds[start:] = values


class RunLogWriter:
    """Append-only writer of ``run.h5``; use on rank 0 only, as a context manager or with close().

    Example::

        meta = {"launcher": "mpiexec"}
        with RunLogWriter(run_dir / "run.h5", config_yaml=cfg.to_yaml(), meta=meta) as log:
            log.log_step(step=0, loss=5.5, step_time_s=0.8, tokens_per_s=8192.0, lr=1e-3,
                         num_stages=2, num_ranks=2, num_nodes=1)
            log.log_stage_times(step=0, compute_s=[0.5, 0.7], idle_s=[0.3, 0.1])
            log.flush()

    ``overwrite=True`` replaces an existing file; ``resume=True`` carries an existing file's rows
    and root attributes into the new one (e.g. after a requeue) and logs a ``restart`` event.
    ``redo_from_step=k`` (with ``resume``) says the resumed run continues from a checkpoint taken
    after ``k`` steps: the copied rows of steps ``>= k`` are marked ``superseded``, so each step
    keeps one authoritative row set. New rows carry the next ``segment`` number.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        config_yaml: str,
        meta: dict[str, MetaValue],
        flush_every_rows: int = 4096,
        flush_every_s: float = 10.0,
        overwrite: bool = False,
        resume: bool = False,
        redo_from_step: int | None = None,
        restart_detail: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.flush_every_rows = flush_every_rows
        self.flush_every_s = flush_every_s
        for key, value in meta.items():
            if key in schema.ROOT_ATTRS:
                raise ValueError(
                    f"meta key {key!r} collides with a root attribute the writer sets; "
                    f"reserved: {', '.join(schema.ROOT_ATTRS)}. HINT: rename the key"
                )
            if not isinstance(value, str | int | float):
                raise TypeError(
                    f"meta[{key!r}]={value!r} has type {type(value).__name__}; "
                    "expected str, int or float"
                )
        exists = self.path.exists()
        if exists and not (overwrite or resume):
            raise FileExistsError(
                f"{self.path} already exists; HINT: pick a new job name, delete the file, "
                "or pass overwrite=True (replace) or resume=True (append to it)"
            )
        self._buffers: dict[str, list[tuple[Any, ...]]] = {t.name: [] for t in schema.TABLES}
        self._detail_buffer = bytearray()
        self._detail_len_bytes = 0
        self._num_buffered_rows = 0
        self._last_step = -1
        self._segment = 0
        self._num_superseded_rows = 0
        self._closed = False
        attrs = self._root_attrs(config_yaml, meta)
        self._file = self._create(
            attrs,
            resume_from=self.path if exists and resume else None,
            redo_from_step=redo_from_step,
        )
        self._datasets = {name: self._file[name] for name in (*self._buffers, schema.EVENT_DETAIL)}
        self._start_unix_s = float(self._file.attrs["start_time_unix_s"])
        self._last_flush_monotonic = time.monotonic()
        log.info("run log: %s (schema %d)", self.path, schema.SCHEMA_VERSION)
        if resume and (exists or restart_detail is not None):
            self.log_event(
                step=self._last_step,
                kind=schema.RESTART_EVENT_KIND,
                detail={
                    "resumed_after_step": self._last_step,
                    "segment": self._segment,
                    "superseded_rows": self._num_superseded_rows,
                    "hostname": attrs["hostname"],
                    "pid": attrs["pid"],
                    "config_changed": config_yaml != self._file.attrs["config_yaml"],
                    "config_yaml": config_yaml,
                    "meta": meta,
                    **(restart_detail or {}),
                },
            )
            self.flush()

    @staticmethod
    def _root_attrs(config_yaml: str, meta: dict[str, MetaValue]) -> dict[str, MetaValue]:
        now = dt.datetime.now(dt.timezone.utc)
        attrs: dict[str, MetaValue] = {
            "schema_version": schema.SCHEMA_VERSION,
            "package_version": __version__,
            "config_yaml": config_yaml,
            "start_time_utc": now.isoformat(timespec="seconds"),
            "start_time_unix_s": now.timestamp(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "python_version": platform.python_version(),
            "h5py_version": h5py.version.version,
            "hdf5_version": h5py.version.hdf5_version,
        }
        attrs.update(meta)
        return attrs

    def _create(
        self, attrs: dict[str, MetaValue], resume_from: Path | None, redo_from_step: int | None
    ) -> h5py.File:
        """Build the complete file under a temporary name, switch SWMR on, then rename it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        f = h5py.File(tmp, "w", libver=LIBVER, locking="best-effort")
        try:
            if resume_from is not None:
                # the original run's attributes
                attrs = self._copy_rows(resume_from, f, redo_from_step)
            else:
                _create_tables(f)
            for key, value in attrs.items():
                f.attrs[key] = value
            f.attrs[schema.ATTRS_CRC_ATTR] = schema.attrs_crc32(attrs)
            f.swmr_mode = True
            os.replace(tmp, self.path)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        return f

    def _copy_rows(
        self, src_path: Path, dst: h5py.File, redo_from_step: int | None
    ) -> dict[str, MetaValue]:
        """Copy a previous run log's tables into ``dst``; return its root attributes.

        Rows of steps ``>= redo_from_step`` (steps this resumed run will run again) are marked
        superseded; the new rows get the next segment number.
        """
        # The precheck catches truncation in microseconds; without it a truncated file makes an
        # SWMR open loop for an hour on rank 0 (see dynmo_hpc.runlog.precheck). A cleanly closed
        # file is opened without SWMR: HDF5 then fails at once on a bad metadata checksum
        # instead of retrying.
        superblock = precheck.check(src_path)
        try:
            src = h5py.File(src_path, "r", swmr=superblock.open_for_write, locking="best-effort")
        except OSError as exc:
            raise RunLogError(
                f"{src_path}: HDF5 cannot open it ({_first_line(exc)}); {_RESUME_HINT}"
            ) from None
        try:
            with src:
                return self._copy_tables(src_path, src, dst, redo_from_step)
        except RunLogError:
            raise
        except (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
            raise RunLogError(
                f"{src_path}: cannot append to it, it is damaged ({_first_line(exc)}); "
                f"{_RESUME_HINT}"
            ) from None

    def _copy_tables(
        self, src_path: Path, src: h5py.File, dst: h5py.File, redo_from_step: int | None
    ) -> dict[str, MetaValue]:
        """The copy itself, from an open source file (see :meth:`_copy_rows`)."""
        if "schema_version" not in src.attrs:
            raise RunLogError(
                f"{src_path} is an HDF5 file but not a dynmo_hpc run log (no schema_version "
                f"attribute); {_RESUME_HINT}"
            )
        version = int(src.attrs["schema_version"])
        if version != schema.SCHEMA_VERSION:
            raise RunLogError(
                f"{src_path}: schema_version={version}, this writer appends to "
                f"{schema.SCHEMA_VERSION} only; HINT: start a new run log (overwrite=True)"
            )
        _create_tables(dst)
        segments = [-1]
        for spec in schema.TABLES:
            if spec.name in schema.OPTIONAL_TABLES and spec.name not in src:
                continue  # written before the table existed: nothing to copy
            rows = schema.with_added_columns(spec.name, read_rows(src[spec.name]), spec.dtype)
            if len(rows):
                segments.append(int(rows[schema.SEGMENT_COLUMN].max()))
            if redo_from_step is not None and spec.name in schema.STEP_KEYED_TABLES:
                redone = (rows["step"] >= redo_from_step) & (rows[schema.SUPERSEDED_COLUMN] == 0)
                rows[schema.SUPERSEDED_COLUMN][redone] = 1
                if spec is schema.STEPS:
                    self._num_superseded_rows = int(redone.sum())
            _append(dst[spec.name], rows)
        detail = read_rows(src[schema.EVENT_DETAIL])
        _append(dst[schema.EVENT_DETAIL], detail)
        self._detail_len_bytes = len(detail)
        self._segment = max(segments) + 1
        steps = dst[schema.STEPS.name][()]
        kept = steps["step"][steps[schema.SUPERSEDED_COLUMN] == 0]
        self._last_step = int(kept.max()) if len(kept) else -1
        return {key: value for key, value in src.attrs.items()}

    # -- logging API: append to buffers only ----------------------------------------------------

    def log_step(
        self,
        *,
        step: int,
        loss: float,
        step_time_s: float,
        tokens_per_s: float,
        lr: float,
        num_stages: int,
        num_ranks: int,
        num_nodes: int,
        ab_arm: int = -1,
        wall_s_per_cpu_s: float = float("nan"),
    ) -> None:
        """One row per optimizer step; ``num_ranks``/``num_nodes`` are what the job holds now;
        ``ab_arm`` and ``wall_s_per_cpu_s``: see :data:`dynmo_hpc.runlog.schema.ADDED_COLUMNS`."""
        self._check_open()
        self._last_step = max(self._last_step, int(step))
        self._buffers[schema.STEPS.name].append(
            (
                int(step),
                self._wall_s(),
                float(loss),
                float(step_time_s),
                float(tokens_per_s),
                float(lr),
                int(num_stages),
                int(num_ranks),
                int(num_nodes),
                self._segment,
                0,
                int(ab_arm),
                float(wall_s_per_cpu_s),
            )
        )
        self._rows_added(1)

    def log_stage_times(
        self,
        *,
        step: int,
        compute_s: Sequence[float],
        idle_s: Sequence[float],
        num_replicas: int = 1,
        allreduce_s: Sequence[float] | None = None,
    ) -> None:
        """Per rank: seconds computing and seconds waiting in this step (stage count may vary).

        Entries are in world rank order, ``num_replicas`` blocks of one replica's stages each
        (rank ``r * P + s`` is stage ``s`` of replica ``r``); ``allreduce_s``: per rank, the
        seconds of the gradient all-reduce (None: not measured)."""
        self._check_open()
        num_ranks = _check_same_length("log_stage_times", compute_s=compute_s, idle_s=idle_s)
        if num_replicas < 1 or num_ranks % num_replicas:
            raise ValueError(
                f"log_stage_times: {num_ranks} ranks do not split into {num_replicas} replicas"
            )
        num_stages = num_ranks // num_replicas
        rows = self._buffers[schema.STAGE_TIMES.name]
        for rank in range(num_ranks):
            reduce_s = float("nan") if allreduce_s is None else float(allreduce_s[rank])
            replica, stage = divmod(rank, num_stages)
            compute, idle = float(compute_s[rank]), float(idle_s[rank])
            rows.append((int(step), stage, compute, idle, self._segment, 0, replica, reduce_s))
        self._rows_added(num_ranks)

    def log_layer_report(
        self,
        *,
        step: int,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        num_params: Sequence[int],
        param_bytes: Sequence[int],
        grad_bytes: Sequence[int],
        optim_bytes: Sequence[int],
        parts: Sequence[int],
        peak_mem_bytes: Sequence[int] | None = None,
    ) -> None:
        """A load report: per global layer its costs and bytes; per stage the partition in force.

        ``parts`` are the stage boundaries (``parts[0]=0 .. parts[P]=num_layers``);
        ``peak_mem_bytes`` has one entry per stage, or is None when not measured.
        """
        self._check_open()
        num_layers = _check_same_length(
            "log_layer_report",
            forward_s=forward_s,
            backward_s=backward_s,
            num_params=num_params,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optim_bytes=optim_bytes,
        )
        _check_parts(parts, num_layers)
        num_stages = len(parts) - 1
        if peak_mem_bytes is None:
            peak_mem_bytes = [schema.UNKNOWN_INT] * num_stages
        elif len(peak_mem_bytes) != num_stages:
            raise ValueError(
                f"peak_mem_bytes has {len(peak_mem_bytes)} entries; expected one per stage "
                f"({num_stages}, from parts={list(parts)}) or None"
            )
        layer_rows = self._buffers[schema.LAYER_COSTS.name]
        for layer in range(num_layers):
            layer_rows.append(
                (
                    int(step),
                    layer,
                    float(forward_s[layer]),
                    float(backward_s[layer]),
                    int(num_params[layer]),
                    int(param_bytes[layer]),
                    int(grad_bytes[layer]),
                    int(optim_bytes[layer]),
                    self._segment,
                    0,
                )
            )
        part_rows = self._buffers[schema.PARTITIONS.name]
        for stage in range(num_stages):
            part_rows.append(
                (
                    int(step),
                    stage,
                    int(parts[stage]),
                    int(parts[stage + 1]),
                    int(peak_mem_bytes[stage]),
                    self._segment,
                    0,
                )
            )
        self._rows_added(num_layers + num_stages)

    def log_layer_states(self, *, step: int, states: Sequence[LayerState]) -> None:
        """A load report's scheme state per layer (:mod:`dynmo_hpc.runlog.trajectory`): one
        ``layer_states`` row per layer, one ``expert_loads`` row per expert of an MoE layer."""
        self._check_open()
        rows = self._buffers[schema.LAYER_STATES.name]
        loads = self._buffers[schema.EXPERT_LOADS.name]
        for s in states:
            flags = (int(s.frozen), int(s.frozen_prefix), int(s.exit_head))
            fractions = (s.neurons_kept, s.heads_kept, s.tokens_kept, s.kv_tokens_kept)
            density = float(s.attention_density)
            rows.append(
                (int(step), int(s.layer), *map(float, fractions), density, *flags, self._segment, 0)
            )
            for e, load in enumerate(s.expert_loads):
                loads.append((int(step), int(s.layer), e, float(load), self._segment, 0))
        self._rows_added(len(states) + sum(len(s.expert_loads) for s in states))

    def log_eval(self, *, step: int, loss: float) -> None:
        """A validation pass after ``step``: one ``eval`` row."""
        self._check_open()
        self._buffers[schema.EVAL.name].append((int(step), float(loss), self._segment, 0))
        self._rows_added(1)

    def log_event(self, *, step: int, kind: str, detail: dict[str, Any]) -> None:
        """Something that happened (rebalance, migrate, pack, shrink, checkpoint, ...).

        New kinds need no schema change: ``kind`` is free text (at most 32 UTF-8 bytes) and
        ``detail`` any JSON-serialisable dict, stored as UTF-8 JSON in ``/event_detail``.
        """
        self._check_open()
        kind_bytes = kind.encode()
        if not 0 < len(kind_bytes) <= schema.KIND_MAX_BYTES:
            raise ValueError(
                f"event kind {kind!r} is {len(kind_bytes)} UTF-8 bytes; "
                f"expected 1..{schema.KIND_MAX_BYTES}"
            )
        payload = json.dumps(detail, default=_json_default, sort_keys=True).encode()
        offset = self._detail_len_bytes + len(self._detail_buffer)
        self._detail_buffer += payload
        self._buffers[schema.EVENTS.name].append(
            (int(step), self._wall_s(), kind_bytes, offset, len(payload), self._segment)
        )
        log.debug("event at step %d: %s %s", step, kind, payload[:200])
        self._rows_added(1)

    # -- persistence ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Append every buffered row and make it visible to SWMR readers.

        Event bytes are written before the event rows that point into them, so a reader (or a
        file left by SIGKILL) never holds an event whose detail is missing.
        """
        self._check_open()
        for spec in schema.TABLES:
            if spec is schema.EVENTS and self._detail_buffer:
                detail = self._datasets[schema.EVENT_DETAIL]
                _append(detail, np.frombuffer(bytes(self._detail_buffer), dtype=np.uint8))
                detail.flush()  # on disk before any event row that points into it
                self._detail_len_bytes += len(self._detail_buffer)
                self._detail_buffer.clear()
            rows = self._buffers[spec.name]
            if rows:
                _append(self._datasets[spec.name], np.array(rows, dtype=spec.dtype))
                rows.clear()
        self._file.flush()
        self._num_buffered_rows = 0
        self._last_flush_monotonic = time.monotonic()

    def close(self, *, status: str = "ok") -> None:
        """Write the ``end`` event (its absence marks a crashed run), flush, close. Idempotent."""
        if self._closed:
            return
        try:
            self.log_event(
                step=self._last_step, kind=schema.END_EVENT_KIND, detail={"status": status}
            )
            self.flush()
        finally:
            self._file.close()
            self._closed = True

    def __enter__(self) -> RunLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None or self._closed:
            self.close()
            return
        self.log_event(
            step=self._last_step,
            kind=schema.ERROR_EVENT_KIND,
            detail={"type": exc_type.__name__, "message": str(exc)},
        )
        self.close(status="error")

    # -- internals -----------------------------------------------------------------------------

    def _wall_s(self) -> float:
        """Seconds since the run started (wall clock, so it stays monotone across a resume)."""
        return time.time() - self._start_unix_s

    def _rows_added(self, num_rows: int) -> None:
        self._num_buffered_rows += num_rows
        if (
            self._num_buffered_rows >= self.flush_every_rows
            or time.monotonic() - self._last_flush_monotonic >= self.flush_every_s
        ):
            self.flush()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"run log {self.path} is closed; HINT: log before close()")
