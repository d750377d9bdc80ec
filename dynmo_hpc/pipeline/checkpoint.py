"""Checkpoints keyed by global layer: complete, periodic, atomic, verified before use.

Layout (``<run dir>/checkpoint/``)::

    step_<n>/layer_0000.pt ...   one file per global layer: weights, AdamW state, scheme counters
    step_<n>/run_state.json      step, partition, balancer state, loss history, config identity
    step_<n>/manifest.json       every file with its size and CRC-32: written last
    latest                       "step_<n>": the newest complete checkpoint (atomically replaced)

Why per layer: nothing in a checkpoint depends on the rank layout, so it restores onto any
partition and any number of stages. Why a manifest written last: a checkpoint directory is
complete exactly when its manifest exists and every file matches it; a crash while saving (or
a disk that flipped a bit later) leaves a directory that :func:`verify` rejects, and the resume
falls back to the previous complete checkpoint. Every file goes to a temporary name, is fsynced
and renamed (:mod:`dynmo_hpc.atomic_io`). Old checkpoints are pruned only after a newer one is
complete.

The functions here touch files only; the trainer decides when to save and what goes in.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynmo_hpc.atomic_io import atomic_write_bytes, atomic_write_text
from dynmo_hpc.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bumped when the layout or the files' contents change incompatibly."""
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
LATEST = "latest"


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return run_dir / "checkpoint"


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` completed steps."""
    return root / f"step_{step}"


def layer_name(index: int) -> str:
    return f"layer_{index:04d}.pt"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


# -- writing ----------------------------------------------------------------------------------


def layer_bytes(index: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    """One layer's checkpoint file contents: weights, AdamW state and the scheme counters.

    The module's state dict carries every scheme's persistent state (pruned shapes, routers,
    frozen flags, sparse-attention density, exit heads); the counters (tokens seen, blocks kept
    since the last report) are plain attributes and are saved beside it so reports continue.
    """
    payload = {
        "format": FORMAT_VERSION,
        "index": index,
        "module": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "optimizer": _to_cpu(optimizer.state_dict()),
        "counters": scheme_counters(module),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def write_file(directory: Path, name: str, data: bytes) -> dict[str, int]:
    """Write ``data`` atomically; returns its manifest entry (bytes and CRC-32)."""
    atomic_write_bytes(directory / name, data)
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def write_run_state(directory: Path, state: dict[str, Any]) -> dict[str, int]:
    """Write ``run_state.json``; returns its manifest entry."""
    data = json.dumps({"format": FORMAT_VERSION, **state}, indent=1, sort_keys=True).encode()
    return write_file(directory, RUN_STATE, data)


def commit(root: Path, step: int, files: dict[str, dict[str, int]], keep: int) -> Path:
    """Complete checkpoint ``step``: write its manifest, point ``latest`` at it, prune old ones.

    Called once (rank 0) after every rank has written its files. Returns the checkpoint path.
    """
    directory = step_dir(root, step)
    manifest = {"format": FORMAT_VERSION, "step": step, "files": dict(sorted(files.items()))}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    atomic_write_text(root / LATEST, directory.name + "\n")
    prune(root, keep)
    return directory


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than
    the newest complete one (crash leftovers); returns what was deleted."""
    complete, removed = [], []
    for directory in sorted(_step_dirs(root), key=lambda p: _step_of(p) or 0, reverse=True):
        if (directory / MANIFEST).is_file():
            complete.append(directory)
            if len(complete) > keep:
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        elif complete:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A checkpoint directory and whether it can be resumed from."""

    path: Path
    step: int
    problem: str | None
    """None: complete and intact. Else why not (missing manifest, a file's size or checksum)."""


def verify(directory: Path) -> str | None:
    """None if ``directory`` is a complete, intact checkpoint; else the first problem found."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION:
            return f"format {manifest.get('format')!r}, this version reads {FORMAT_VERSION}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"manifest.json is unreadable ({type(exc).__name__})"
    if RUN_STATE not in files:
        return "the manifest lists no run_state.json"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        data = path.read_bytes()
        if len(data) != entry.get("bytes"):
            return f"{name} has {len(data)} bytes, the manifest says {entry.get('bytes')}"
        if zlib.crc32(data) != entry.get("crc32"):
            return f"{name} fails its CRC-32 check (corrupt)"
    return None


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]


def scan(root: Path) -> list[Candidate]:
    """Every checkpoint under ``root``, newest first, each verified."""
    dirs = sorted(_step_dirs(root), key=lambda p: _step_of(p) or 0, reverse=True)
    return [Candidate(d, _step_of(d) or 0, verify(d)) for d in dirs]


def resolve(path: Path) -> tuple[Candidate, list[Candidate]]:
    """The checkpoint to resume from, given a run directory, a checkpoint root or a step_<n>.

    For a run directory or a checkpoint root: the newest intact checkpoint, and the newer ones
    that were skipped (each with its problem). For a step directory: that one, if intact.

    Raises:
        CheckpointError: nothing intact to resume from (the message lists what was found).
    """
    if _step_of(path) is not None:
        candidate = Candidate(path, _step_of(path) or 0, verify(path))
        if candidate.problem is not None:
            raise CheckpointError(
                f"checkpoint {path} cannot be resumed from: {candidate.problem}; HINT: pass its "
                "run directory to --resume to use the newest intact checkpoint instead"
            )
        return candidate, []
    root = path if (path / LATEST).exists() or path.name == "checkpoint" else checkpoint_root(path)
    candidates = scan(root)
    skipped = []
    for candidate in candidates:
        if candidate.problem is None:
            return candidate, skipped
        skipped.append(candidate)
    found = "; ".join(f"{c.path.name}: {c.problem}" for c in skipped) or "none"
    raise CheckpointError(
        f"no intact checkpoint under {root} (found: {found}); HINT: run without --resume to "
        "start over (with --overwrite), or restore a checkpoint directory from a backup"
    )


def read_run_state(directory: Path) -> dict[str, Any]:
    """The run state of a verified checkpoint."""
    try:
        state: dict[str, Any] = json.loads((directory / RUN_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{directory / RUN_STATE} is unreadable ({exc}); HINT: resume from an earlier "
            "checkpoint"
        ) from None
    return state


def load_layer(directory: Path, index: int) -> dict[str, Any]:
    """One layer's saved weights, optimizer state and counters (tensors on the CPU)."""
    path = directory / layer_name(index)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no file for layer {index} ({path.name}); "
            "HINT: the checkpoint is incomplete, resume from an earlier one"
        )
    try:
        payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged zip/pickle
        raise CheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}); HINT: resume from "
            "an earlier checkpoint"
        ) from None
    return payload


# -- compatibility ----------------------------------------------------------------------------


def incompatible_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two ``identity`` dicts (see the trainer)."""
    keys = sorted(set(saved) | set(current))
    return [k for k in keys if saved.get(k) != current.get(k)]


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """``{"model": {"d_model": 128}}`` -> ``{"model.d_model": 128}`` (lists kept as values)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return {prefix: value}


# -- scheme counters ---------------------------------------------------------------------------


_COUNTER_ATTRS = ("stats", "token_stats")
"""Plain-dict attributes the schemes count into between load reports."""


def scheme_counters(module: torch.nn.Module) -> dict[str, dict[str, float]]:
    """The counters of every submodule, by ``<path>:<attr>``."""
    out = {}
    for path, sub in module.named_modules():
        for attr in _COUNTER_ATTRS:
            counters = getattr(sub, attr, None)
            if isinstance(counters, dict):
                out[f"{path}:{attr}"] = {str(k): float(v) for k, v in counters.items()}
    return out


def restore_counters(module: torch.nn.Module, counters: dict[str, dict[str, float]]) -> None:
    """Put saved counters back (the inverse of :func:`scheme_counters`)."""
    subs = dict(module.named_modules())
    for key, values in counters.items():
        path, _, attr = key.rpartition(":")
        sub = subs.get(path)
        if sub is not None and isinstance(getattr(sub, attr, None), dict):
            setattr(sub, attr, dict(values))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
