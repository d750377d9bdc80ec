"""The whole job: every section, plus the checks that span sections."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dynmo_hpc.config.elastic import ElasticSection
from dynmo_hpc.config.fault import FaultSection
from dynmo_hpc.config.scheme_sections import SchemesSection
from dynmo_hpc.config.sections import (
    ARCH_SCHEMES,
    BalanceSection,
    CheckpointSection,
    DataSection,
    JobSection,
    ModelSection,
    PipelineSection,
    RuntimeSection,
    TrainSection,
)
from dynmo_hpc.config.slurm import SlurmSection
from dynmo_hpc.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    balance: BalanceSection = field(default_factory=BalanceSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)
    fault: FaultSection = field(default_factory=FaultSection)
    schemes: SchemesSection = field(default_factory=SchemesSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    """SLURM submission settings; local runs ignore them."""

    @property
    def tokens_per_step(self) -> int:
        return self.train.micro_batch_size * self.train.num_microbatches * self.model.seq_len

    @property
    def run_dir(self) -> Path:
        return Path(self.job.out_dir) / self.job.name

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        self.schemes.validate_for(self.model)
        supported = ARCH_SCHEMES[self.model.arch]
        enabled = self.schemes.enabled
        unsupported = [n for n in enabled if supported is not None and n not in supported]
        if unsupported:
            raise ConfigError(
                f"schemes {', '.join(unsupported)} are not implemented for model.arch="
                f"{self.model.arch} (it supports: {', '.join(sorted(supported or ())) or 'none'}); "
                "HINT: remove them or use model.arch: gpt2"
            )
        self.slurm.validate_for(self.pipeline)
        self.balance.validate_for(self.model)
        world_size = self.pipeline.world_size
        if self.fault.inject_step is not None and self.fault.inject_rank >= world_size:
            raise ConfigError(
                f"fault.inject_rank={self.fault.inject_rank} is not a rank of the job's "
                f"{world_size} ranks (pipeline.replicas * pipeline.num_stages); "
                f"HINT: pick 0..{world_size - 1}"
            )
        self._validate_replicas()
        num_layers = self.model.num_layers
        num_stages = self.pipeline.num_stages
        if num_stages > num_layers:
            raise ConfigError(
                f"pipeline.num_stages({num_stages}) > model.num_blocks + 2 ({num_layers}) "
                "(embedding + blocks + head); every stage needs at least one layer: "
                "lower pipeline.num_stages or raise model.num_blocks"
            )
        if self.elastic.enabled and self.elastic.min_stages > num_stages:
            raise ConfigError(
                f"elastic.min_stages({self.elastic.min_stages}) > pipeline.num_stages"
                f"({num_stages}): the job could never pack; HINT: lower elastic.min_stages"
            )
        if self.elastic.enabled and self.elastic.min_replicas > self.pipeline.replicas:
            raise ConfigError(
                f"elastic.min_replicas({self.elastic.min_replicas}) > pipeline.replicas"
                f"({self.pipeline.replicas}): the floor is above the job's size; HINT: lower "
                "elastic.min_replicas"
            )
        if self.balance.ab_period_steps and self.elastic.enabled:
            raise ConfigError(
                f"balance.ab_period_steps={self.balance.ab_period_steps} (A/B within one run) "
                "with elastic.enabled=true: a pack would end the comparison; HINT: set "
                "elastic.enabled=false for an A/B run"
            )
        parts = self.pipeline.partition
        if parts is not None:
            if len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != num_layers:
                raise ConfigError(
                    f"pipeline.partition={parts} must have num_stages + 1 = {num_stages + 1} "
                    f"entries from 0 to {num_layers} (embedding + {self.model.num_blocks} "
                    "blocks + head)"
                )
            if any(b <= a for a, b in itertools.pairwise(parts)):
                raise ConfigError(
                    f"pipeline.partition={parts} must be strictly increasing: "
                    "every stage needs at least one layer"
                )

    def _validate_replicas(self) -> None:
        """Replicas split each step's microbatches evenly."""
        replicas = self.pipeline.replicas
        num_microbatches = self.train.num_microbatches
        if num_microbatches % replicas:
            lower = num_microbatches - num_microbatches % replicas
            raise ConfigError(
                f"train.num_microbatches({num_microbatches}) is not divisible by "
                f"pipeline.replicas({replicas}): the replicas split each step's microbatches; "
                f"HINT: set train.num_microbatches to a multiple of {replicas} "
                f"(e.g. {max(replicas, lower)})"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return str(yaml.safe_dump(self.to_dict(), sort_keys=False))
