"""The elastic packing tests' shared launch: one static run and the same job with packing on.

``tests/test_elastic.py`` (4 stages pack to 2) and ``tests/test_elastic_replicas.py`` (2 replicas
x 2 stages pack to 1 x 2) compare a packed run with the same job never resized. Both launch the
two jobs the same way and read the same files; :func:`run_static_and_packed` does it once.
Each test then asserts what its own pack must show.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynmo_hpc import config as config_mod
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load
from dynmo_hpc.runlog.reader import RunLog
from tests.helpers.jobs import tiny_config


@dataclass
class PackedRuns:
    static: config_mod.JobConfig
    packed: config_mod.JobConfig
    want: dict[str, Any]
    """The static run's result.json."""
    got: dict[str, Any]
    """The packed run's result.json."""
    run: RunLog
    """The packed run's one run log (across its resize)."""
    ranks: list[int]
    """The packed run's ranks per step, from its run log."""


def run_static_and_packed(
    tmp_path: Path, common: Sequence[str], packing: Sequence[str], timeout_s: float = 240
) -> PackedRuns:
    """Launch the job ``common`` twice on local ranks, as ``static`` and with ``packing`` as
    ``packed``; both must exit 0. The packed run must end with fewer ranks than it started
    with and never grow on the way (one pack, no resize back)."""
    static = tiny_config(tmp_path, *common, "job.name=static")
    packed = tiny_config(tmp_path, *common, *packing, "job.name=packed")
    for cfg in (static, packed):
        rc, _ = launch_local(cfg, timeout_s=timeout_s)
        assert rc == 0, cfg.job.name
    want = json.loads((static.run_dir / "result.json").read_text())
    got = json.loads((packed.run_dir / "result.json").read_text())
    run = load(packed.run_dir / "run.h5")
    ranks = [int(r) for r in run.steps["num_ranks"].tolist()]
    assert ranks == sorted(ranks, reverse=True) and ranks[-1] < ranks[0], ranks
    return PackedRuns(static, packed, want, got, run, ranks)
