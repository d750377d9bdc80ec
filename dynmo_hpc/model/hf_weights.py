"""Hugging Face safetensors checkpoints: read a layer's tensors lazily, check, and write them.

Why lazy: ``model.init_from`` may name a checkpoint of gigabytes, and each rank needs only the
layers it owns. :class:`HFCheckpoint` maps tensor names to files (``model.safetensors``, or the
shards a ``model.safetensors.index.json`` lists) and reads each tensor through
``safetensors.safe_open`` (memory-mapped; a tensor is copied once, into its parameter). The
names and layouts come from the family (:attr:`~.families.registry.Family.hf_tensors`).

Errors (:class:`~dynmo_hpc.errors.CheckpointError`) are one line naming the file and the
tensor: a missing or extra tensor, a shape that does not match the config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from dynmo_hpc.config import ModelSection
from dynmo_hpc.errors import CheckpointError
from dynmo_hpc.model.families import HFTensor, build_module, family_of
from dynmo_hpc.model.tied import HEAD_WEIGHT, tied_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFCheckpoint:
    """The tensors of a Hugging Face model directory, by name, read on demand."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.files: dict[str, Path] = {}
        """Tensor name -> the safetensors file holding it."""
        self._handles: dict[Path, Any] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(
                    f"{index}: unreadable weight_map ({exc}); HINT: save the model again"
                ) from None
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            paths = sorted(self.directory.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(
                    f"{self.directory}: no *.safetensors file; HINT: save the model with "
                    "save_pretrained(..., safe_serialization=True)"
                )
            for path in paths:
                for name in self._handle(path).keys():  # noqa: SIM118 (a safe_open handle)
                    self.files[name] = path

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as exc:
                raise CheckpointError(
                    f"{path}: not a readable safetensors file ({exc}); HINT: save it again"
                ) from None
            self._handles[path] = handle
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (reads the header only)."""
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (memory-mapped read of its bytes)."""
        try:
            tensor: torch.Tensor = self._handle(self.files[name]).get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(
                f"{self.files[name]}: tensor {name}: unreadable ({exc}); HINT: save it again"
            ) from None
        return tensor

    def resolve(self, spec: HFTensor) -> str | None:
        """The stored name for ``spec`` (its fallback when absent), or None."""
        if spec.name in self.files:
            return spec.name
        if spec.fallback is not None and spec.fallback in self.files:
            return spec.fallback
        return None


def _where(ckpt: HFCheckpoint, name: str) -> str:
    return str(ckpt.files.get(name, ckpt.directory))


def check_checkpoint(cfg: ModelSection, ckpt: HFCheckpoint) -> None:
    """Every tensor the model needs is present with its shape, and no tensor is left over.

    Raises:
        CheckpointError: one line naming the file and the first bad tensor.
    """
    family = family_of(cfg)
    used: set[str] = set()
    for index in range(cfg.num_layers):
        shapes = expected_shapes(cfg, index)
        for ours, spec in family.hf_tensors(cfg, index).items():
            name = ckpt.resolve(spec)
            if name is None:
                raise CheckpointError(
                    f"{ckpt.directory}: tensor {spec.name} is missing; HINT: the checkpoint does "
                    f"not match its config.json"
                )
            used.add(name)
            want = shapes[ours]
            want = (want[1], want[0]) if spec.transposed else want
            got = ckpt.shape(name)
            if got != want:
                raise CheckpointError(
                    f"{_where(ckpt, name)}: tensor {name} has shape {list(got)}, config.json "
                    f"implies {list(want)}; HINT: the checkpoint does not match its config.json"
                )
    extra = sorted(set(ckpt.files) - used)
    if extra:
        raise CheckpointError(
            f"{_where(ckpt, extra[0])}: unexpected tensor {extra[0]} ({len(extra)} extra in "
            "all); HINT: the checkpoint is not a plain model of its config.json's architecture"
        )


def expected_shapes(cfg: ModelSection, index: int) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes of layer ``index`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        module = build_module(cfg, index)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def load_layer_(module: nn.Module, cfg: ModelSection, index: int, ckpt: HFCheckpoint) -> None:
    """Copy layer ``index``'s tensors from ``ckpt`` into ``module``'s parameters in place.

    Raises:
        CheckpointError: a tensor is missing, or its shape differs from the parameter's.
    """
    params = dict(module.named_parameters())
    for ours, spec in family_of(cfg).hf_tensors(cfg, index).items():
        name = ckpt.resolve(spec)
        if name is None:
            raise CheckpointError(
                f"{ckpt.directory}: tensor {spec.name} is missing; HINT: the checkpoint does not "
                "match its config.json"
            )
        if ours not in params:
            raise CheckpointError(
                f"{_where(ckpt, name)}: tensor {name} has no parameter {ours} in layer {index} "
                "(a scheme changed the block); HINT: import without that scheme"
            )
        tensor = ckpt.read(name)
        tensor = tensor.t() if spec.transposed else tensor
        param = params[ours]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{_where(ckpt, name)}: tensor {name} has shape {list(tensor.shape)}, layer "
                f"{index} needs {list(param.shape)}; HINT: the checkpoint does not match "
                "config.json"
            )
        with torch.no_grad():
            param.copy_(tensor)


def pad_to(tensor: torch.Tensor, shape: tuple[int, ...], parts: int = 1) -> torch.Tensor:
    """``tensor`` zero-padded at the end of every dimension to ``shape``; with ``parts`` > 1,
    dim 0 holds that many equal parts (q, k, v), each padded on its own."""
    if parts > 1:
        chunks = tensor.chunk(parts, dim=0)
        part_shape = (shape[0] // parts, *shape[1:])
        return torch.cat([pad_to(c, part_shape) for c in chunks], dim=0)
    out = tensor.new_zeros(shape)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def dense_state(
    cfg: ModelSection, index: int, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Layer ``index``'s family parameters at their dense shapes: a structurally pruned matrix
    (fewer neurons or heads) is zero-padded, which leaves the layer's function unchanged (a
    zero neuron adds nothing; a zero head's output projection columns are zero)."""
    family = family_of(cfg)
    shapes = expected_shapes(cfg, index)
    out = {}
    for name in family.hf_tensors(cfg, index):
        if name not in state:
            raise CheckpointError(
                f"layer {index} has no parameter {name} (a scheme replaced it); HINT: this "
                "model cannot be exported as a plain Hugging Face model"
            )
        tensor = state[name]
        if tuple(tensor.shape) != shapes[name]:
            tensor = pad_to(tensor, shapes[name], family.packed.get(name, 1))
        out[name] = tensor
    return out


def export_tensors(
    cfg: ModelSection, index: int, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Layer ``index``'s parameters from its state dict, under their Hugging Face names and
    layouts (contiguous fp32 copies); with ``tie_embeddings`` the head's ``lm_head.weight`` is
    left out (``tie_word_embeddings: true``: the embedding's tensor is the one weight)."""
    out = {}
    skip = HEAD_WEIGHT if tied_name(cfg, index) == HEAD_WEIGHT else None
    for ours, spec in family_of(cfg).hf_tensors(cfg, index).items():
        if ours == skip:
            continue  # a tied head: Hugging Face reads the embedding's tensor
        tensor = state[ours].detach().to(torch.float32)
        out[spec.name] = (tensor.t() if spec.transposed else tensor).contiguous().clone()
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as one safetensors file (``format: pt`` metadata, as transformers
    writes it)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
