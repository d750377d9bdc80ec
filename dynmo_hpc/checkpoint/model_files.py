"""A whole model in one process, from one of our checkpoints or a Hugging Face directory.

Why: ``dynmo-hpc eval`` and ``dynmo-hpc export`` need every layer of a trained model on one
process, outside any pipeline. Our checkpoints are per layer (:mod:`.store`) with the job's
whole config in their run state, so the model is rebuilt from that config and each layer's
state dict, scheme state included (:func:`~dynmo_hpc.model.schemes.restore_layer`). A
Hugging Face directory (``config.json`` present) is imported as ``model.init_from`` does.

The config of a checkpoint is the one it was trained with, except ``model.init_from``, which is
dropped: the shapes are in the saved keys and the weights in the layer files, so the Hugging
Face directory a run started from need not exist any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint.store import load_layer, read_run_state, resolve
from dynmo_hpc.config import JobConfig
from dynmo_hpc.config.hf_model import CONFIG_FILE
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.hf_weights import HFCheckpoint, check_checkpoint
from dynmo_hpc.model.schemes import build_layer, restore_layer


@dataclass
class LoadedModel:
    """Every layer of a model, in global order, with the config that built them."""

    cfg: JobConfig
    layers: list[nn.Module]
    source: str
    """``checkpoint <dir>`` or ``huggingface <dir>``, for messages."""


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model.d_model": 128}`` -> ``{"model": {"d_model": 128}}`` (the inverse of
    :func:`~.store.flatten`)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if not (value is None and isinstance(node.get(leaf), dict)):
            node[leaf] = value
    return out


def checkpoint_config(directory: Path) -> JobConfig:
    """The job config a verified checkpoint was written with (``model.init_from`` dropped)."""
    state = read_run_state(directory)
    flat = state.get("config")
    if not isinstance(flat, dict):
        raise CheckpointError(
            f"checkpoint {directory} does not record its config (written by an older "
            "version); HINT: resume it once with this version to write a new checkpoint"
        )
    data = unflatten(flat)
    data.setdefault("model", {})["init_from"] = None
    return config_mod.from_dict(data, source=f"{directory}/run_state.json")


def load_model(path: Path, *, seq_len: int | None = None) -> LoadedModel:
    """The model at ``path``: a Hugging Face directory (with ``config.json``), or a run
    directory, checkpoint root or ``step_<n>`` checkpoint of ours (the newest intact one).

    ``seq_len``: the context the model will see (a Hugging Face GPT-2 must have at least that
    many positions).
    """
    if (path / CONFIG_FILE).is_file():
        model: dict[str, Any] = {"init_from": str(path)}
        if seq_len is not None:
            model["seq_len"] = seq_len
        cfg = config_mod.from_dict({"model": model}, source=str(path / CONFIG_FILE))
        check_checkpoint(cfg.model, HFCheckpoint(path))
        layers = [build_layer(cfg, i) for i in range(cfg.model.num_layers)]
        return LoadedModel(cfg, layers, f"huggingface {path}")
    candidate, _ = resolve(path)
    cfg = checkpoint_config(candidate.path)
    layers = [
        restore_layer(cfg, i, load_layer(candidate.path, i)["module"])
        for i in range(cfg.model.num_layers)
    ]
    return LoadedModel(cfg, layers, f"checkpoint {candidate.path}")
