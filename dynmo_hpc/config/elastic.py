"""The ``elastic:`` section: when and how a job packs onto fewer stages and gives nodes back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dynmo_hpc.errors import ConfigError

ELASTIC_POLICIES = ("throughput", "node_hours")


@dataclass(frozen=True, kw_only=True)
class ElasticSection:
    """Packing: checkpoint, end the MPI step, shrink the allocation, resume on fewer stages.

    The decision (:func:`dynmo_hpc.balance.packing.plan_pack`) is made on rank 0 every
    ``interval`` load reports from the smoothed layer costs; see docs/elastic.md.
    """

    enabled: bool = False
    """Consider packing at all (off: the stage count never changes)."""
    policy: Literal["throughput", "node_hours"] = "throughput"
    """``throughput``: the fewest nodes whose predicted tokens/s stays within ``max_slowdown`` of
    the reference (the best partition at the job's original stage count). ``node_hours``: the
    best predicted tokens per node-hour within the same bound."""
    max_slowdown: float = 0.1
    """The largest predicted throughput loss a pack may cost against the reference, under
    either policy (0.1 = 10 %)."""
    min_stages: int = 1
    """Never pack below this many stages (raised above a packed stage count that ran out of
    memory)."""
    min_replicas: int = 1
    """Never pack below this many replicas (raised above a packed replica count that ran out of
    memory)."""
    interval: int = 2
    """Load reports between packing decisions."""
    restart_overhead_s: float | None = None
    """Seconds a resize stops training, for the pays-off test; null: measured (this launch's
    start-up plus a checkpoint write and restore)."""

    def validate(self) -> None:
        if self.policy not in ELASTIC_POLICIES:
            raise ConfigError(
                f"elastic.policy={self.policy!r} must be one of {', '.join(ELASTIC_POLICIES)}"
            )
        if not (math.isfinite(self.max_slowdown) and 0.0 <= self.max_slowdown < 1.0):
            raise ConfigError(
                f"elastic.max_slowdown={self.max_slowdown} must be in [0, 1) (0.1 means 10 %)"
            )
        if self.min_stages < 1:
            raise ConfigError(f"elastic.min_stages={self.min_stages} must be >= 1")
        if self.min_replicas < 1:
            raise ConfigError(f"elastic.min_replicas={self.min_replicas} must be >= 1")
        if self.interval < 1:
            raise ConfigError(f"elastic.interval={self.interval} must be >= 1 (load reports)")
        if self.restart_overhead_s is not None and not (
            math.isfinite(self.restart_overhead_s) and self.restart_overhead_s >= 0
        ):
            raise ConfigError(
                f"elastic.restart_overhead_s={self.restart_overhead_s} must be a finite number "
                ">= 0, or null to measure it"
            )
