"""Reading a checkpoint's manifest: the cheap check a search uses and the full verification.

A checkpoint directory is complete exactly when its ``manifest.json`` (written last) exists and
every file matches it. Two levels of checking, so a restart's search stays cheap:

- :func:`quick_problem`: the manifest is valid and every file it lists is there at its size
  (reads the manifest only, ``stat`` for the rest). Used to order and pick candidates.
- :func:`verify`: that, plus each file read and checked against its CRC-32. Run once, for the
  checkpoint about to be used (:func:`dynmo_hpc.checkpoint.store.resolve`); the ranks check
  each layer file's CRC-32 on the bytes they load (:func:`check_entry`), never reading it twice.

Torch-free, so launchers can choose a checkpoint without importing torch.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
"""Bumped when the layout or the files' contents change incompatibly."""
MANIFEST_FORMAT = 2
"""A manifest with a lineage record (:mod:`.lineage`); format-1 manifests (written before
lineages) are still read. Layer files and run states stay at :data:`FORMAT_VERSION`."""
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
LATEST = "latest"


_LAYER_FILE = re.compile(r"layer_\d{4,}\.pt")
"""What :func:`layer_name` writes; a manifest naming anything else is damaged or forged."""


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_json(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None), or (None, why not): never raises for a damaged file."""
    try:
        return json.loads(path.read_bytes().decode()), None
    except OSError as exc:
        return None, f"{path.name} cannot be read ({exc.strerror or type(exc).__name__})"
    except UnicodeDecodeError:
        return None, f"{path.name} is not text (corrupt)"
    except (ValueError, RecursionError):
        return None, f"{path.name} is not valid JSON (corrupt)"


def manifest_problem(manifest: Any, directory: Path) -> str | None:
    """Why a parsed manifest cannot be trusted, or None: types, file names, the step."""
    if not isinstance(manifest, dict):
        return "manifest.json is not a JSON object (corrupt)"
    if manifest.get("format") not in (FORMAT_VERSION, MANIFEST_FORMAT):
        return (
            f"format {manifest.get('format')!r}, this version reads {FORMAT_VERSION} or "
            f"{MANIFEST_FORMAT}"
        )
    step = step_of(directory)
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
            or not is_int(entry.get("bytes"))
            or not is_int(entry.get("crc32"))
        ):
            return f"manifest.json has no integer bytes and crc32 for {name} (corrupt)"
    if RUN_STATE not in files:
        return "the manifest lists no run_state.json"
    layers = sorted(int(name[6:-3]) for name in files if name != RUN_STATE)
    if layers != list(range(len(layers))):
        return f"the manifest lists layers {layers}, not 0..{len(layers) - 1} (corrupt)"
    return _lineage_problem(manifest)


def lineage_crc(record: dict[str, Any]) -> int:
    """The CRC-32 of a lineage record (without its own ``crc32``), canonical JSON."""
    body = {k: v for k, v in record.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _lineage_problem(manifest: dict[str, Any]) -> str | None:
    """A format-2 manifest must carry an intact lineage record: the choice of a restart reads
    it, and a flipped byte in it must not move a checkpoint into another history."""
    if manifest.get("format") == FORMAT_VERSION:
        return None  # written before lineages
    record = manifest.get("lineage")
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("branch"), str)
        or record.get("crc32") != lineage_crc(record)
    ):
        return "manifest.json's lineage record is missing or fails its CRC-32 check (corrupt)"
    return None


def load_manifest(directory: Path) -> tuple[Any, str | None]:
    """(the checked manifest, None), or (None, why not)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest.json (the save did not finish)"
    manifest, problem = read_json(manifest_path)
    problem = problem or manifest_problem(manifest, directory)
    return (None, problem) if problem is not None else (manifest, None)


def sizes_problem(directory: Path, manifest: Any) -> str | None:
    """The first file that is missing or not at the manifest's size (``stat`` only)."""
    for name, entry in manifest["files"].items():
        path = directory / name
        try:
            size = path.stat().st_size if path.is_file() else -1
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
        if size < 0:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}"
    return None


def quick_problem(directory: Path) -> str | None:
    """The cheap check a checkpoint search uses: the manifest is valid and every file it lists
    is there at its size. Reads the manifest only (no layer file); :func:`verify` does the
    checksums once, for the checkpoint chosen."""
    manifest, problem = load_manifest(directory)
    return problem if problem is not None else sizes_problem(directory, manifest)


def read_file_bytes(path: Path) -> bytes:
    """A checkpoint file's contents (the one place they are read: tests count the reads)."""
    return path.read_bytes()


def check_entry(name: str, data: bytes, entry: dict[str, int]) -> str | None:
    """Why ``data`` does not match its manifest entry (size, then CRC-32), or None."""
    if len(data) != entry["bytes"]:
        return f"{name} has {len(data)} bytes, the manifest says {entry['bytes']}"
    if zlib.crc32(data) != entry["crc32"]:
        return f"{name} fails its CRC-32 check (corrupt)"
    return None


def verify(directory: Path, only: tuple[str, ...] | None = None) -> str | None:
    """None if ``directory`` is a complete, intact checkpoint; else the first problem found.

    Runs the cheap check, then reads every file (``only``: just those) and checks its CRC-32.
    Never raises for damaged contents: a manifest that is not JSON, of the wrong types, or that
    names files outside the checkpoint is a problem like a failed checksum, so a resume can skip
    the checkpoint and use an older one.
    """
    manifest, problem = load_manifest(directory)
    problem = problem or sizes_problem(directory, manifest)
    if problem is not None:
        return problem
    for name, entry in manifest["files"].items():
        if only is not None and name not in only:
            continue
        try:
            data = read_file_bytes(directory / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
        problem = check_entry(name, data, entry)
        if problem is not None:
            return problem
    return None


def manifest_files(directory: Path) -> dict[str, dict[str, int]]:
    """The manifest's file entries of a checkpoint (empty if it has no valid manifest)."""
    manifest, _ = load_manifest(directory)
    return dict(manifest["files"]) if manifest is not None else {}
