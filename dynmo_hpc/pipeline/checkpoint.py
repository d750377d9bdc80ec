"""Checkpoints keyed by global layer: weights plus optimizer state, written atomically.

Why per layer: a checkpoint that knows nothing about stages can be restored onto any partition
and any number of ranks, which is what shrinking a job onto fewer nodes needs. Each rank writes the
layers it owns; rank 0 writes ``meta.json`` last, after a barrier, so a checkpoint directory with
a ``meta.json`` is complete. Every file goes to a temporary name, is fsynced, then renamed, so a
crash never leaves a half-written file under a real name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dynmo_hpc.atomic_io import atomic_write_bytes, atomic_write_text


def layer_path(directory: Path, index: int) -> Path:
    return directory / f"layer_{index:04d}.pt"


def save_layer(directory: Path, index: int, module: torch.nn.Module, optimizer: Any) -> None:
    """Write one layer's weights and optimizer state (on CPU) atomically."""
    import io

    payload = {
        "index": index,
        "module": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "optimizer": _to_cpu(optimizer.state_dict()),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    atomic_write_bytes(layer_path(directory, index), buffer.getvalue())


def load_layer(directory: Path, index: int) -> dict[str, Any]:
    path = layer_path(directory, index)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {directory} has no file for layer {index} ({path.name}); "
            "HINT: the checkpoint is incomplete, restore from an earlier one"
        )
    payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return payload


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    atomic_write_text(directory / "meta.json", json.dumps(meta, indent=2, sort_keys=True))


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no meta.json: not a complete checkpoint; "
            "HINT: a crash during saving leaves no meta.json, use an earlier checkpoint"
        )
    meta: dict[str, Any] = json.loads(path.read_text())
    return meta


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
