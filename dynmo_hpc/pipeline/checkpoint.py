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
import itertools
import json
import logging
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynmo_hpc.atomic_io import atomic_write_bytes, atomic_write_text
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.schemes import take_counters

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


_LAYER_FILE = re.compile(r"layer_\d{4,}\.pt")
"""What :func:`layer_name` writes; a manifest naming anything else is damaged or forged."""


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None), or (None, why not): never raises for a damaged file."""
    try:
        return json.loads(path.read_bytes().decode()), None
    except OSError as exc:
        return None, f"{path.name} cannot be read ({exc.strerror or type(exc).__name__})"
    except UnicodeDecodeError:
        return None, f"{path.name} is not text (corrupt)"
    except (ValueError, RecursionError):
        return None, f"{path.name} is not valid JSON (corrupt)"


def _manifest_problem(manifest: Any, directory: Path) -> str | None:
    """Why a parsed manifest cannot be trusted, or None: types, file names, the step."""
    if not isinstance(manifest, dict):
        return "manifest.json is not a JSON object (corrupt)"
    if manifest.get("format") != FORMAT_VERSION:
        return f"format {manifest.get('format')!r}, this version reads {FORMAT_VERSION}"
    step = _step_of(directory)
    if "step" in manifest and step is not None and manifest["step"] != step:
        return f"manifest.json is for step {manifest['step']!r}, the directory is {directory.name}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "manifest.json has no 'files' object (corrupt)"
    for name, entry in files.items():
        if name != RUN_STATE and not _LAYER_FILE.fullmatch(name):
            return f"manifest.json lists {name!r}, which is no checkpoint file (corrupt)"
        if (
            not isinstance(entry, dict)
            or not _is_int(entry.get("bytes"))
            or not _is_int(entry.get("crc32"))
        ):
            return f"manifest.json has no integer bytes and crc32 for {name} (corrupt)"
    if RUN_STATE not in files:
        return "the manifest lists no run_state.json"
    layers = sorted(int(name[6:-3]) for name in files if name != RUN_STATE)
    if layers != list(range(len(layers))):
        return f"the manifest lists layers {layers}, not 0..{len(layers) - 1} (corrupt)"
    return None


def verify(directory: Path) -> str | None:
    """None if ``directory`` is a complete, intact checkpoint; else the first problem found.

    Never raises for damaged contents: a manifest that is not JSON, of the wrong types, or that
    names files outside the checkpoint is a problem like a failed checksum, so a resume can skip
    the checkpoint and use an older one.
    """
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    manifest, problem = _read_json(manifest_path)
    problem = problem or _manifest_problem(manifest, directory)
    if problem is not None:
        return problem
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        try:
            data = path.read_bytes()
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
        if len(data) != entry["bytes"]:
            return f"{name} has {len(data)} bytes, the manifest says {entry['bytes']}"
        if zlib.crc32(data) != entry["crc32"]:
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


def _latest_problem(root: Path) -> str | None:
    """Why ``root/latest`` is damaged or dangling, or None (absent is fine: old runs, crashes).

    ``latest`` is advisory: the newest intact checkpoint is found by scanning, because a crash
    between a manifest and the ``latest`` update leaves a newer complete checkpoint it does not
    name. A pointer that is unreadable or names nothing is still worth a warning.
    """
    latest = root / LATEST
    if not latest.exists():
        return None
    try:
        name = latest.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError):
        return "the latest pointer is unreadable (corrupt)"
    if _step_of(Path(name)) is None or "/" in name:
        return f"the latest pointer holds {name[:40]!r}, not a step_<n> name (corrupt)"
    if not (root / name).is_dir():
        return f"the latest pointer names {name}, which does not exist"
    return None


def resolve(path: Path) -> tuple[Candidate, list[Candidate]]:
    """The checkpoint to resume from, given a run directory, a checkpoint root or a step_<n>.

    For a run directory or a checkpoint root (or its ``latest`` file): the newest intact
    checkpoint, and what was skipped (each newer damaged checkpoint, and a damaged or dangling
    ``latest`` pointer, each with its problem). For a step directory: that one, if intact.

    Raises:
        CheckpointError: nothing intact to resume from (the message lists what was found).
    """
    if not path.exists():
        raise CheckpointError(
            f"no intact checkpoint: {path} does not exist; HINT: pass --resume a run directory, "
            "its checkpoint directory or a checkpoint/step_<n> directory (or no path: the job's "
            "run directory)"
        )
    if path.is_file() and path.name == LATEST:
        path = path.parent
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
    latest_problem = _latest_problem(root)
    if latest_problem is not None:
        skipped.append(Candidate(root / LATEST, -1, latest_problem))
    for candidate in candidates:
        if candidate.problem is None:
            return candidate, skipped
        skipped.append(candidate)
    found = "; ".join(f"{c.path.name}: {c.problem}" for c in skipped) or "none"
    raise CheckpointError(
        f"no intact checkpoint under {root} (found: {found}); HINT: run without --resume to "
        "start over (with --overwrite), or restore a checkpoint directory from a backup"
    )


def _run_state_problem(state: Any, directory: Path) -> str | None:
    """Why a parsed run state cannot be resumed from, or None (types of what a resume reads)."""
    if not isinstance(state, dict):
        return "it is not a JSON object"
    if state.get("format") != FORMAT_VERSION:
        return f"format {state.get('format')!r}, this version reads {FORMAT_VERSION}"
    step, parts = state.get("step"), state.get("parts")
    if not _is_int(step) or step < 0:
        return f"step is {step!r}, not a step count"
    if _step_of(directory) not in (None, step):
        return f"it is for step {step}, the directory is {directory.name}"
    if (
        not isinstance(parts, list)
        or len(parts) < 2
        or not all(_is_int(b) for b in parts)
        or parts[0] != 0
        or any(a > b for a, b in itertools.pairwise(parts))
    ):
        return f"parts is {str(parts)[:80]}, not a partition [0, ..., num_layers]"
    if not isinstance(state.get("identity"), dict):
        return "it has no identity object"
    for key in ("balancer", "history"):
        if not isinstance(state.get(key, {}), dict):
            return f"{key} is not an object"
    costs = state.get("balancer", {}).get("costs_s")
    if costs is not None and (
        not isinstance(costs, list) or not all(isinstance(c, int | float) for c in costs)
    ):
        return "balancer.costs_s is not a list of numbers"
    for key, values in state.get("history", {}).items():
        if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
            return f"history.{key} is not a list of numbers"
    return None


def read_run_state(directory: Path) -> dict[str, Any]:
    """The run state of a verified checkpoint, checked for the keys and types a resume reads.

    Raises:
        CheckpointError: the file is unreadable, not JSON, or lacks what a resume needs.
    """
    state, problem = _read_json(directory / RUN_STATE)
    if problem is None and (wrong := _run_state_problem(state, directory)) is not None:
        problem = f"{RUN_STATE}: {wrong}"
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {directory} cannot be resumed from: {problem}; HINT: resume from an "
            "earlier checkpoint (pass its checkpoint/step_<n> directory to --resume)"
        )
    checked: dict[str, Any] = state
    return checked


def load_layer(directory: Path, index: int) -> dict[str, Any]:
    """One layer's saved weights, optimizer state and counters (tensors on the CPU).

    Raises:
        CheckpointError: the file is missing, not a torch file, or not this layer's payload (a
            file that passed its CRC-32 yet fails here was written by something else).
    """
    path = directory / layer_name(index)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no file for layer {index} ({path.name}); "
            "HINT: the checkpoint is incomplete, resume from an earlier one"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged zip/pickle
        first = str(exc).split(". ")[0].splitlines()[0][:120] if str(exc) else ""
        raise CheckpointError(
            f"{path} cannot be read as a torch file ({type(exc).__name__}: {first}); HINT: "
            "resume from an earlier checkpoint"
        ) from None
    if (
        not isinstance(payload, dict)
        or payload.get("format") != FORMAT_VERSION
        or payload.get("index") != index
        or not isinstance(payload.get("module"), dict)
        or not isinstance(payload.get("optimizer"), dict)
        or not isinstance(payload.get("counters", {}), dict)
    ):
        raise CheckpointError(
            f"{path} is not layer {index}'s checkpoint payload (format {FORMAT_VERSION}: index, "
            "module, optimizer); HINT: resume from an earlier checkpoint"
        )
    checked: dict[str, Any] = payload
    return checked


# -- compatibility ----------------------------------------------------------------------------


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """``{"model": {"d_model": 128}}`` -> ``{"model.d_model": 128}`` (lists kept as values)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return {prefix: value}


# -- scheme counters ---------------------------------------------------------------------------


def scheme_counters(module: torch.nn.Module) -> dict[str, dict[str, float]]:
    """The counters of every submodule, by ``<path>:<attr>``, for every counter attribute a
    registered scheme declares (``Scheme.counter_attrs``)."""
    return take_counters(module, clear=False)


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
