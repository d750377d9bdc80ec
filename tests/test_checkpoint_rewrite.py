"""Saving the step of the newest checkpoint again never loses it (issue 42, defect 4).

One rank on ``COMM_SELF`` with a stand-in stage (a layer slot is what ``save`` reads)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI

from dynmo_hpc.checkpoint import resume, store


def _stage() -> SimpleNamespace:
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 2)
    slot = SimpleNamespace(index=0, module=module, optimizer=torch.optim.AdamW(module.parameters()))
    return SimpleNamespace(slots=[slot])


def _killed() -> None:
    raise RuntimeError("killed while writing the checkpoint")


def test_a_kill_while_saving_the_same_step_again_keeps_the_checkpoint(tmp_path: Path) -> None:
    """``start_step == train.steps``: the final checkpoint is saved again. A kill in that save
    (here: right after this rank's layer files) must leave the checkpoint complete."""
    stage = _stage()
    directory, _, num_bytes = resume.save(MPI.COMM_SELF, tmp_path, 4, stage, 1, {"step": 4})
    assert store.verify(directory) is None and num_bytes > 0
    manifest = (directory / store.MANIFEST).read_bytes()
    try:
        again, _, rewritten = resume.save(
            MPI.COMM_SELF, tmp_path, 4, stage, 1, {"step": 4}, after_files=_killed
        )
    except RuntimeError:
        again, rewritten = directory, -1
    assert store.verify(directory) is None, "the newest checkpoint was lost"
    assert (again, rewritten) == (directory, 0)
    assert (directory / store.MANIFEST).read_bytes() == manifest
    assert store.resolve(tmp_path)[0].path == directory


def test_an_incomplete_directory_of_the_step_is_replaced(tmp_path: Path) -> None:
    """A crash mid-save left ``step_4`` without a manifest: the next save writes it anew."""
    stage = _stage()
    directory, _, _ = resume.save(MPI.COMM_SELF, tmp_path, 4, stage, 1, {"step": 4})
    (directory / store.MANIFEST).unlink()
    with pytest.raises(RuntimeError):
        resume.save(MPI.COMM_SELF, tmp_path, 4, stage, 1, {"step": 4}, after_files=_killed)
    _, _, num_bytes = resume.save(MPI.COMM_SELF, tmp_path, 4, stage, 1, {"step": 4})
    assert num_bytes > 0 and store.verify(directory) is None
