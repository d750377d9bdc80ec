"""Checkpoint lineage: which checkpoints belong to the run's current history, and which one a
restart resumes from.

A run's history can fork: resuming from ``step_4`` of a run that already wrote ``step_6`` starts
a new *branch* whose ``step_5``, ``step_6`` ... replace the old ones in meaning, not in name.
Ordering checkpoints by step number alone then mixes the two histories. So every checkpoint's
manifest carries a lineage record ::

    "lineage": {"branch": "<id>", "start": <key or null>, "parent": <key or null>}

where a *key* is ``{"branch": <id or null>, "step": <n>, "path": "step_<n>"}`` (``path``
relative to the checkpoint root). ``branch`` names the history the checkpoint belongs to,
``start`` the checkpoint that branch forked from (null: a fresh start) and ``parent`` the
checkpoint its launch resumed from or wrote last. The run's current branch is kept in
``checkpoint/lineage.json`` (:data:`HEAD`, same fields less ``parent``), written when a launch
starts a new branch (:func:`enter`, called by the supervisor).

The *lineage* of the current branch is its own checkpoints, newest first, then the ancestry of
its start: the start's branch's checkpoints up to the start, then that branch's start, and so
on. :func:`choice_order` is that list; a restart takes the first entry that passes the cheap
check (manifest and file sizes), and the loader verifies checksums once. A pure function of the
directory listing, the manifests and the head.

Invariants: a checkpoint outside the current lineage is never chosen and never pruned: when a
branch starts, the checkpoints outside the new lineage are moved under ``abandoned/<branch>/``
(logged), so ``checkpoint/`` holds only the current lineage; a branch's start stays until a
newer checkpoint of the branch is complete (pruning keeps the newest ``checkpoint.keep`` of the
lineage order, and the start is always after the branch's own checkpoints in it).

Torch-free, so the launchers can choose without importing torch.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dynmo_hpc.atomic_io import atomic_write_text, fsync_dir
from dynmo_hpc.checkpoint.manifest import LATEST, load_manifest, sizes_problem, step_of, verify

log = logging.getLogger(__name__)

HEAD = "lineage.json"
"""The current branch, in the checkpoint root."""
ABANDONED = "abandoned"
"""Where checkpoints outside the current lineage are moved when a branch starts."""
HEAD_FORMAT = 1


@dataclass(frozen=True)
class Key:
    """One checkpoint's place in the history: its branch (None: written before lineages
    existed) and step, and its path relative to the checkpoint root."""

    branch: str | None
    step: int
    path: str

    def to_json(self) -> dict[str, Any]:
        return {"branch": self.branch, "step": self.step, "path": self.path}

    @staticmethod
    def from_json(data: Any) -> Key | None:
        """The key a record holds, or None (null, or not a well-formed key)."""
        if not isinstance(data, dict):
            return None
        branch, step, path = data.get("branch"), data.get("step"), data.get("path")
        if branch is not None and not isinstance(branch, str):
            return None
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(path, str):
            return None
        return Key(branch, step, path)


@dataclass(frozen=True)
class Entry:
    """A checkpoint directory as the choice sees it (read cheaply, never its layer files)."""

    key: Key
    start: Key | None
    """Where the checkpoint's branch forked from (None: a fresh start, or unknown)."""
    problem: str | None
    """None if the cheap check passed (manifest valid, every file present at its size)."""


@dataclass(frozen=True)
class Head:
    """The current branch and the checkpoint it started from (None: a fresh start)."""

    branch: str
    start: Key | None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": HEAD_FORMAT,
            "branch": self.branch,
            "start": self.start.to_json() if self.start else None,
        }


# -- pure decisions ----------------------------------------------------------------------------


def _newest_first(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: e.key.step, reverse=True)


def ancestry(entries: list[Entry], start: Key | None) -> list[Entry]:
    """``start`` and the checkpoints it descends from, newest first.

    A branch is linear (steps only grow along it), so the ancestors of a checkpoint are its
    branch's checkpoints up to its step, then the ancestry of the branch's start. Pre-lineage
    checkpoints (branch None) form one such branch with no start.
    """
    found: list[Entry] = []
    seen: set[str | None] = set()
    while start is not None and start.branch not in seen:
        seen.add(start.branch)
        same = [
            e
            for e in entries
            if e.key.branch == start.branch and e.key.step <= start.step and e not in found
        ]
        if not any(e.key.path == start.path for e in same):
            same += [e for e in entries if e.key.path == start.path and e not in found]
        same = _newest_first(same)
        found += same
        starts = [e.start for e in same if e.start is not None and e.key.branch is not None]
        start = starts[-1] if starts else None
    return found


def choice_order(entries: list[Entry], head: Head | None) -> list[Entry]:
    """The current lineage, in the order a restart tries it: the branch's own checkpoints
    newest first, then its start's ancestry. A top-level directory with no readable manifest
    (a save that did not finish) has no branch; it is listed at its step, so it is reported as
    skipped and pruned as a crash leftover, never chosen. No head (a directory from before
    lineages): every checkpoint, newest first."""
    if head is None:
        return _newest_first(entries)
    own = [e for e in entries if e.key.branch == head.branch]
    own += [e for e in ancestry(entries, head.start) if e not in own]
    own += [e for e in entries if _unreadable(e) and e not in own]
    return sorted(own, key=lambda e: e.key.step, reverse=True)


def _unreadable(entry: Entry) -> bool:
    """No branch and not usable: its manifest is missing or damaged."""
    return entry.key.branch is None and entry.problem is not None and "/" not in entry.key.path


def outside(entries: list[Entry], head: Head | None) -> list[Entry]:
    """The top-level checkpoints that are not in the lineage of ``head`` (to set aside)."""
    inside = choice_order(entries, head)
    return [e for e in entries if e not in inside and "/" not in e.key.path]


def continues(entries: list[Entry], head: Head | None, resume: str | None, restart: bool) -> bool:
    """Whether a launch resuming from ``resume`` (a root-relative path, None: from the start)
    continues the current branch rather than starting a new one.

    It continues when it resumes from the newest checkpoint of the lineage that passes the cheap
    check (what a restart would take), or restarts with no checkpoint (``restart``) on a branch
    that has none. Anything else (an older checkpoint, a fresh run) starts a branch.
    """
    if head is None:
        return False
    order = choice_order(entries, head)
    usable = [e for e in order if e.problem is None]
    if resume is None:
        return restart and not usable
    return bool(usable) and usable[0].key.path == resume


def new_branch_id() -> str:
    """A fresh branch id (random: two launches never share one)."""
    return secrets.token_hex(6)


# -- the files ---------------------------------------------------------------------------------


def record_of(manifest: Any) -> tuple[str | None, Key | None, Key | None]:
    """(branch, start, parent) from a parsed manifest; (None, None, None) before lineages."""
    lineage = manifest.get("lineage") if isinstance(manifest, dict) else None
    if not isinstance(lineage, dict) or not isinstance(lineage.get("branch"), str):
        return None, None, None
    return (
        lineage["branch"],
        Key.from_json(lineage.get("start")),
        Key.from_json(lineage.get("parent")),
    )


def read_head(root: Path) -> Head | None:
    """The current branch, or None (no head yet, or one that is unreadable: then the
    directory is treated as from before lineages, newest step first)."""
    try:
        data = json.loads((root / HEAD).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("branch"), str):
        return None
    return Head(data["branch"], Key.from_json(data.get("start")))


def write_head(root: Path, head: Head) -> None:
    atomic_write_text(root / HEAD, json.dumps(head.to_json(), indent=1) + "\n")


def current_branch(root: Path, start: Key | None) -> Head:
    """The head, created (a new branch from ``start``) when the root has none: a trainer run
    outside the supervisor (tests) still writes lineage records."""
    head = read_head(root)
    if head is None:
        head = Head(new_branch_id(), start)
        write_head(root, head)
    return head


def set_aside(root: Path, entries: list[Entry]) -> list[Path]:
    """Move each entry under ``abandoned/<branch>/`` (never deleted); returns the new paths."""
    moved = []
    for entry in entries:
        target_dir = root / ABANDONED / (entry.key.branch or "before-lineage")
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / Path(entry.key.path).name
        suffix = 1
        while target.exists():
            target = target_dir / f"{Path(entry.key.path).name}.{suffix}"
            suffix += 1
        os.replace(root / entry.key.path, target)
        fsync_dir(target_dir)
        moved.append(target)
    if moved:
        fsync_dir(root)
    return moved


def point_latest(root: Path, order: list[Entry]) -> None:
    """``latest`` names the lineage's newest usable top-level checkpoint (removed if none)."""
    usable = [e for e in order if e.problem is None and "/" not in e.key.path]
    if usable:
        atomic_write_text(root / LATEST, usable[0].key.path + "\n")
    else:
        (root / LATEST).unlink(missing_ok=True)
        fsync_dir(root)


# -- the checkpoint root ------------------------------------------------------------------------


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]


def _relative(root: Path, directory: Path) -> str:
    """``directory``'s path relative to ``root`` (absolute when outside it)."""
    try:
        return str(directory.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(directory.resolve())


def entry_of(root: Path, directory: Path) -> Entry:
    """A checkpoint as the lineage choice sees it: its key, its branch's start and the cheap
    check's verdict (the manifest is the only file read)."""
    manifest, problem = load_manifest(directory)
    branch, start, _ = record_of(manifest)
    if problem is None:
        problem = sizes_problem(directory, manifest)
    return Entry(Key(branch, step_of(directory) or 0, _relative(root, directory)), start, problem)


def entries(root: Path) -> list[Entry]:
    """Every top-level checkpoint of ``root``, newest step first, cheaply checked."""
    dirs = sorted(_step_dirs(root), key=lambda p: step_of(p) or 0, reverse=True)
    return [entry_of(root, d) for d in dirs]


def lineage_entries(root: Path) -> list[Entry]:
    """The current lineage in the order a restart tries it (:func:`choice_order`);
    the head's start is listed even when it lies outside ``root``'s top level."""
    head = read_head(root)
    found = entries(root)
    if head is not None and head.start is not None:
        start_dir = root / head.start.path
        known = any(e.key.path == head.start.path for e in found)
        if not known and step_of(start_dir) is not None and start_dir.is_dir():
            found.append(entry_of(root, start_dir))
    return choice_order(found, head)


def _checked_before(root: Path, resume: str | None) -> list[Entry]:
    """The lineage order, with the checkpoints ahead of ``resume`` verified in full until one
    is intact: a launch that resumes from an older checkpoint because the newer ones are
    damaged (bit flips pass the cheap check) continues the branch instead of forking it. Only
    that case reads files; the usual restart from the newest reads none here."""
    order = lineage_entries(root)
    checked: list[Entry] = []
    for index, entry in enumerate(order):
        if entry.key.path == resume or resume is None:
            return checked + order[index:]
        if entry.problem is None:
            entry = replace(entry, problem=verify(root / entry.key.path))
            if entry.problem is None:
                return [*checked, entry, *order[index + 1 :]]
        checked.append(entry)
    return checked


def key_of(root: Path, directory: Path) -> Key:
    """The lineage key of a checkpoint directory (its manifest's branch; cheap)."""
    return entry_of(root, directory).key


def enter(root: Path, resume_from: Path | None, *, restart: bool) -> Head | None:
    """Start a launch on the run's lineage; returns the branch it writes to (None: a fresh
    start, whose first checkpoint creates the branch).

    A launch that resumes from the newest usable checkpoint of the current lineage (a restart,
    a requeue, ``--resume`` with no path) continues the current branch. Any other launch (a
    fresh run, a resume from an older checkpoint) starts a new branch from ``resume_from``:
    every top-level checkpoint outside the new lineage is moved under ``abandoned/<branch>/``
    (and logged), so it is never chosen or pruned, and ``latest`` names the new lineage's
    newest checkpoint. A fresh start writes nothing when there is nothing to set aside.
    """
    head = read_head(root)
    resume = _relative(root, resume_from) if resume_from is not None else None
    if head is not None and continues(_checked_before(root, resume), head, resume, restart):
        return head
    found = entries(root)
    start = entry_of(root, resume_from) if resume_from is not None else None
    if start is not None and start not in found:
        found.append(start)
    new = Head(new_branch_id(), start.key if start else None)
    moved = set_aside(root, outside(found, new))
    for path in moved:
        log.warning(
            "checkpoint %s is not in the lineage this launch continues (from %s): moved to %s; "
            "it is never resumed from or pruned automatically",
            path.name,
            resume_from or "the beginning",
            path,
        )
    if start is None:
        (root / HEAD).unlink(missing_ok=True)
        (root / LATEST).unlink(missing_ok=True)
        return None
    write_head(root, new)
    point_latest(root, lineage_entries(root))
    return new
