"""Checkpoints keyed by global layer: complete, periodic, atomic, verified before use.

Layout (``<run dir>/checkpoint/``)::

    step_<n>/layer_0000.pt ...   one file per global layer: weights, AdamW state, scheme counters
    step_<n>/run_state.json      step, partition, balancer state, loss history, config identity
    step_<n>/manifest.json       every file with its size and CRC-32, and the lineage record:
                                 written last
    latest                       "step_<n>": the newest complete checkpoint of the current
                                 lineage (atomically replaced)
    lineage.json                 the current branch and where it started (:mod:`.lineage`)
    abandoned/<branch>/step_<n>  checkpoints of a history a resume left behind (kept, unused)

Why per layer: nothing in a checkpoint depends on the rank layout, so it restores onto any
partition and any number of stages. Why a manifest written last: a checkpoint directory is
complete exactly when its manifest exists and every file matches it; a crash while saving (or
a disk that flipped a bit later) leaves a directory that :func:`verify` rejects, and the resume
falls back to the previous complete checkpoint. Every file goes to a temporary name, is fsynced
and renamed, and its directory fsynced (:mod:`dynmo_hpc.atomic_io`). Old checkpoints are pruned
only after a newer one of the same lineage is complete, and only within the lineage.

The functions here touch files only; the trainer decides when to save and what goes in.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynmo_hpc.atomic_io import atomic_write_bytes, atomic_write_text, fsync_dir
from dynmo_hpc.checkpoint import lineage
from dynmo_hpc.checkpoint.lineage import Entry, Key, entries, lineage_entries
from dynmo_hpc.checkpoint.lineage import enter as enter
from dynmo_hpc.checkpoint.lineage import key_of as key_of
from dynmo_hpc.checkpoint.manifest import FORMAT_VERSION as FORMAT_VERSION
from dynmo_hpc.checkpoint.manifest import LATEST as LATEST
from dynmo_hpc.checkpoint.manifest import MANIFEST as MANIFEST
from dynmo_hpc.checkpoint.manifest import (
    MANIFEST_FORMAT,
    check_entry,
    is_int,
    lineage_crc,
    read_file_bytes,
    read_json,
    verify,
)
from dynmo_hpc.checkpoint.manifest import RUN_STATE as RUN_STATE
from dynmo_hpc.checkpoint.manifest import manifest_files as manifest_files
from dynmo_hpc.checkpoint.manifest import quick_problem as quick_problem
from dynmo_hpc.checkpoint.manifest import step_of as _step_of
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.schemes import take_counters

log = logging.getLogger(__name__)


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return run_dir / "checkpoint"


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` completed steps."""
    return root / f"step_{step}"


def layer_name(index: int) -> str:
    return f"layer_{index:04d}.pt"


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


def commit(
    root: Path, step: int, files: dict[str, dict[str, int]], keep: int, parent: Key | None = None
) -> Path:
    """Complete checkpoint ``step``: write its manifest, point ``latest`` at it, prune old ones.

    Called once (rank 0) after every rank has written its files. ``parent``: the checkpoint
    this launch resumed from or wrote last (the lineage record, :mod:`.lineage`); the branch
    comes from the root's head. The root's entries are fsynced before anything is pruned, so
    a crash cannot leave ``latest`` or the lineage pointing at a removed checkpoint while the
    new one's name is still not on disk. Returns the checkpoint path.
    """
    directory = step_dir(root, step)
    head = lineage.current_branch(root, parent)
    record: dict[str, Any] = {
        "branch": head.branch,
        "start": head.start.to_json() if head.start else None,
        "parent": parent.to_json() if parent else None,
    }
    record["crc32"] = lineage_crc(record)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "files": dict(sorted(files.items())),
        "lineage": record,
    }
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    fsync_dir(root)  # the step directory's own entry
    atomic_write_text(root / LATEST, directory.name + "\n")
    prune(root, keep)
    return directory


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` usable checkpoints of the current lineage, and
    incomplete or damaged ones older than its newest usable one (crash leftovers); returns
    what was deleted.

    Usable: passes the cheap check (:func:`quick_problem`). The lineage order
    (:func:`.lineage.choice_order`) puts a branch's start after all of the branch's own
    checkpoints, so the checkpoint a run resumed from goes only once ``keep`` newer usable ones
    of its branch are complete. Checkpoints outside the lineage are never deleted here.
    """
    found = entries(root)
    order = [e for e in lineage.choice_order(found, lineage.read_head(root)) if _top(e)]
    usable = [e for e in order if e.problem is None]
    doomed = usable[keep:]
    if usable:
        newest = usable[0].key.step
        leftovers = [e for e in order if e.problem is not None] + [
            e for e in found if _top(e) and _incomplete(e) and e not in order
        ]
        doomed += [e for e in leftovers if e.key.step < newest]
    removed = []
    for entry in doomed:
        shutil.rmtree(root / entry.key.path, ignore_errors=True)
        removed.append(root / entry.key.path)
    if removed:
        fsync_dir(root)
    return removed


def _top(entry: Entry) -> bool:
    return "/" not in entry.key.path


def _incomplete(entry: Entry) -> bool:
    return entry.problem is not None and entry.problem.startswith("no manifest")


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A checkpoint directory and whether it can be resumed from."""

    path: Path
    step: int
    problem: str | None
    """None: complete and intact. Else why not (missing manifest, a file's size or checksum)."""


def scan(root: Path) -> list[Candidate]:
    """Every checkpoint under ``root``, newest first, each cheaply checked (manifest and file
    sizes: :func:`quick_problem`; no checkpoint file is read)."""
    return [Candidate(root / e.key.path, e.key.step, e.problem) for e in entries(root)]


def skipped_before(chosen: Path) -> list[Candidate]:
    """The checkpoints of the lineage that a resume from ``chosen`` passed over, each with why:
    those ahead of it in the lineage order (:func:`.lineage.choice_order`) that fail the cheap
    check or, passing it, their checksums. Reads files only for such newer checkpoints: none on
    the usual resume from the newest."""
    order = lineage_entries(chosen.parent)
    names = [e.key.path for e in order]
    ahead = order[: names.index(chosen.name)] if chosen.name in names else []
    found = []
    for entry in ahead:
        path = chosen.parent / entry.key.path
        problem = entry.problem or verify(path)
        if problem is not None:
            found.append(Candidate(path, entry.key.step, problem))
    return found


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
    checkpoint of the run's current lineage (:mod:`.lineage`; checkpoints of abandoned branches
    are never candidates), and what was skipped (each newer damaged checkpoint, and a damaged
    or dangling ``latest`` pointer, each with its problem). For a step directory: that one, if
    intact. Every candidate gets the cheap check (manifest and sizes); only the one about to be
    chosen is read in full (checksums), so a search over N kept checkpoints reads one.

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
    skipped = []
    latest_problem = _latest_problem(root)
    if latest_problem is not None:
        skipped.append(Candidate(root / LATEST, -1, latest_problem))
    for entry in lineage_entries(root):
        # cheap check for every candidate, checksums only for the one about to be chosen
        candidate = Candidate(root / entry.key.path, entry.key.step, entry.problem)
        if candidate.problem is None:
            candidate = Candidate(candidate.path, candidate.step, verify(candidate.path))
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
    if not is_int(step) or step < 0:
        return f"step is {step!r}, not a step count"
    if _step_of(directory) not in (None, step):
        return f"it is for step {step}, the directory is {directory.name}"
    if (
        not isinstance(parts, list)
        or len(parts) < 2
        or not all(is_int(b) for b in parts)
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
    state, problem = read_json(directory / RUN_STATE)
    if problem is None and (wrong := _run_state_problem(state, directory)) is not None:
        problem = f"{RUN_STATE}: {wrong}"
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {directory} cannot be resumed from: {problem}; HINT: resume from an "
            "earlier checkpoint (pass its checkpoint/step_<n> directory to --resume)"
        )
    checked: dict[str, Any] = state
    return checked


def load_layer(
    directory: Path, index: int, expected: dict[str, int] | None = None
) -> dict[str, Any]:
    """One layer's saved weights, optimizer state and counters (tensors on the CPU).

    ``expected``: the file's manifest entry; the bytes read for loading are then checked
    against its size and CRC-32 (no second read), so a file damaged after the checkpoint was
    chosen is still refused.

    Raises:
        CheckpointError: the file is missing, fails its check, is not a torch file, or not this
            layer's payload (a file that passed its CRC-32 yet fails here was written by
            something else).
    """
    path = directory / layer_name(index)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} has no file for layer {index} ({path.name}); "
            "HINT: the checkpoint is incomplete, resume from an earlier one"
        )
    data = read_file_bytes(path)
    problem = check_entry(path.name, data, expected) if expected is not None else None
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {directory} cannot be resumed from: {problem}; HINT: resume from an "
            "earlier checkpoint (pass its checkpoint/step_<n> directory to --resume)"
        )
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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
