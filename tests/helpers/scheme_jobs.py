"""Scheme jobs for the tests: the TINY job with a scheme switched on, and a one-rank real run.

``SCHEME_OVERRIDES`` makes each mechanism act within a few steps; :func:`scheme_acted` reads the
run log's events to confirm that it did. :func:`train_one_rank` trains a job with the library's
own :class:`~dynmo_hpc.train.trainer.Trainer` on ``MPI.COMM_SELF`` inside the test process
(one stage: no ``mpiexec``, so it costs no rank start-up), and returns what the scheme tests look
at: the losses, the trained layers, the scheme events and the per-step layer costs. The
multi-rank behaviour (hand-offs, collective decisions, migration) is tested under ``mpiexec`` in
``test_schemes_parity.py`` and ``test_migration_schemes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dynmo_hpc import config as config_mod
from dynmo_hpc.pipeline.stage import LayerSlot
from tests.helpers.jobs import ROOT, TINY

# Per scheme: overrides on the TINY model that make the mechanism act within a few steps.
SCHEME_OVERRIDES: dict[str, list[str]] = {
    "moe": ["schemes.moe.capacity_factor=1.0", "schemes.moe.overflow=reroute"],
    "pruning": [
        "schemes.pruning.start_step=0",
        "schemes.pruning.end_step=3",
        "schemes.pruning.interval_steps=1",
        "schemes.pruning.final_sparsity=0.5",
    ],
    "freezing": [
        "schemes.freezing.threshold=1000.0",
        "schemes.freezing.interval_steps=1",
        "schemes.freezing.start_step=1",
        "schemes.freezing.max_layers_per_check=1",
    ],
    "sparse_attention": [
        "schemes.sparse_attention.block_size=8",
        "schemes.sparse_attention.layer_density=[0.5,1.0,0.25,0.75]",
        "schemes.sparse_attention.drift_factor=0.5",
        "schemes.sparse_attention.drift_end_step=4",
    ],
    "early_exit": ["schemes.early_exit.threshold=0.0058", "schemes.early_exit.layers=[1,2,3]"],
    "mod": ["schemes.mod.layers=[1,2,4]", "schemes.mod.layer_capacity=[0.5,0.25,0.75]"],
}

LLAMA = [
    "model.arch=llama",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.rope_theta=500.0",
]
"""The TINY model as a Llama with grouped-query attention (4 query heads in 2 key/value groups)."""


def arch_schemes(arch: str) -> list[str]:
    """The built-in schemes model family ``arch`` supports (``ARCH_SCHEMES``; None = all)."""
    from dynmo_hpc.config.sections import ARCH_SCHEMES
    from dynmo_hpc.model.schemes import BUILTIN_SCHEMES

    supported = ARCH_SCHEMES[arch]
    return [s.name for s in BUILTIN_SCHEMES if supported is None or s.name in supported]


SCHEME_EVENT_KINDS = ("scheme_stats", "prune", "freeze")
"""Run-log event kinds the scheme controller writes."""


def scheme_config(tmp_path: Path, scheme: str | None, *overrides: str) -> config_mod.JobConfig:
    """The TINY job with one scheme switched on (None: no scheme)."""
    extra = SCHEME_OVERRIDES[scheme] if scheme else []
    return config_mod.load(
        ROOT / "jobs/default.yaml",
        [*TINY, f"job.out_dir={tmp_path}", f"job.name={scheme or 'plain'}", *extra, *overrides],
    )


def scheme_acted(scheme: str, events: list[dict[str, Any]]) -> bool:
    """Whether the run log's scheme events show ``scheme``'s mechanism at work."""
    stats = [e for e in events if e.get("layers")]
    layers = [v for e in stats for v in e["layers"].values()]
    if scheme == "moe":
        return any(v.get("mlp.dropped", 0) + v.get("mlp.rerouted", 0) > 0 for v in layers)
    if scheme == "pruning":
        return any(v.get("sparsity.neuron", 0) > 0 for v in layers)
    if scheme == "freezing":
        return any(e["frozen_prefix_end"] >= 3 for e in stats)
    if scheme == "sparse_attention":
        return any(
            v.get(f"{attn}.kept_blocks", 0) < v.get(f"{attn}.causal_blocks", 0)
            for v in layers
            for attn in ("attn", "self_attn")  # gpt2's and llama's attention module
        )
    if scheme == "early_exit":
        return any(v.get("exit_head.exited", 0) > 0 for v in layers)
    if scheme == "mod":
        return any(
            0 < v.get("depth_router.processed", 0) < v["depth_router.tokens"] for v in layers
        )
    raise AssertionError(f"no check for scheme {scheme!r}")


def scheme_events(events: pd.DataFrame) -> list[dict[str, Any]]:
    """The scheme controller's events of a run log, in order, as the controller returned them."""
    rows = events[events["kind"].isin(SCHEME_EVENT_KINDS)]
    return [
        {**row["detail"], "kind": row["kind"], "step": int(row["step"])}
        for _, row in rows.iterrows()
    ]


@dataclass
class OneRankRun:
    losses: list[float]
    slots: dict[int, LayerSlot]
    """The trained layers, by global index."""
    events: list[dict[str, Any]]
    """The scheme controller's events (see :func:`scheme_events`)."""
    backward_s: list[dict[int, float]]
    """Per load report (every step with ``balance.interval=1``): each layer's mean backward
    cost per step (0.0: its backward never ran)."""


def train_one_rank(cfg: config_mod.JobConfig) -> OneRankRun:
    """Train ``cfg`` (``pipeline.num_stages=1``) with the real trainer in this process."""
    from mpi4py import MPI

    from dynmo_hpc.runlog import load
    from dynmo_hpc.train.trainer import Trainer

    if cfg.pipeline.num_stages != 1:
        raise ValueError(
            f"train_one_rank runs one stage, the job has pipeline.num_stages="
            f"{cfg.pipeline.num_stages}; HINT: add the override pipeline.num_stages=1"
        )
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, MPI.COMM_SELF, cfg.run_dir)
    result = trainer.train()
    log = load(cfg.run_dir / "run.h5")
    costs = log.layer_costs
    backward_s = [
        dict(zip(rows["layer"].astype(int), rows["backward_s"].astype(float), strict=True))
        for _, rows in costs.groupby("step", sort=True)
    ]
    return OneRankRun(
        losses=list(result.losses),
        slots={slot.index: slot for slot in trainer.pipeline_stage.slots},
        events=scheme_events(log.events),
        backward_s=backward_s,
    )
