"""A checkpoint written without training: the run state a resume reads, dummy layer files.

For tests of what happens before any rank starts (the resume rules, ``--resume`` plumbing into
sbatch and submitit): those read the manifest and the run state, never the layers' contents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.balance import uniform
from dynmo_hpc.checkpoint import resume, store


def write_fake_checkpoint(
    cfg: config_mod.JobConfig, step: int, *, with_config: bool = True
) -> Path:
    """Commit ``<run dir>/checkpoint/step_<step>`` as ``cfg``'s run would have written it.

    ``with_config=False``: as a version that saved only the identity keys wrote it.
    """
    root = store.checkpoint_root(cfg.run_dir)
    directory = store.step_dir(root, step)
    files = {
        store.layer_name(i): store.write_file(directory, store.layer_name(i), b"x")
        for i in range(cfg.model.num_layers)
    }
    state: dict[str, Any] = {
        "step": step,
        "num_stages": cfg.pipeline.num_stages,
        "parts": uniform([1.0] * cfg.model.num_layers, cfg.pipeline.num_stages),
        "num_layers": cfg.model.num_layers,
        "identity": resume.identity(cfg),
        "config_sha256": resume.config_sha256(cfg),
        "balancer": {},
        "history": {"losses": [1.0] * step},
    }
    if with_config:
        state["config"] = resume.config_dict(cfg)
    files[store.RUN_STATE] = store.write_run_state(directory, state)
    return store.commit(root, step, files, keep=10)
