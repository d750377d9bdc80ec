"""Job configuration: a YAML file loaded strictly into frozen, typed dataclasses.

Why strict: a typo in a batch job (``num_microbatch: 8``) that is silently ignored costs a queue
wait plus a wasted allocation. Every unknown key, wrong type and impossible combination is rejected
before any rank starts, with an error naming the key, the file and the fix.

Adding a section: write a frozen keyword-only dataclass with a docstring under each field, add it as
a field of :class:`JobConfig`, and put cross-field checks in its ``validate`` method.
"""

from __future__ import annotations

from dynmo_hpc.config.elastic import ELASTIC_POLICIES, ElasticSection
from dynmo_hpc.config.fault import FAULT_PHASES, FaultSection
from dynmo_hpc.config.job import JobConfig
from dynmo_hpc.config.loader import (
    apply_overrides,
    from_dict,
    load,
    load_yaml,
    parse_override,
    set_dotted,
)
from dynmo_hpc.config.scheme_sections import (
    SCHEME_SECTIONS,
    EarlyExitSection,
    FreezingSection,
    MoDSection,
    MoESection,
    PruningSection,
    SchemesSection,
    SparseAttentionSection,
    every_other_block,
    register_section,
    unregister_section,
)
from dynmo_hpc.config.sections import (
    BalanceSection,
    CheckpointSection,
    DataSection,
    JobSection,
    ModelSection,
    PipelineSection,
    RuntimeSection,
    TrainSection,
)
from dynmo_hpc.config.slurm import LAUNCHERS, SlurmSection, mem_mb, sbatch_option_problems
from dynmo_hpc.errors import ConfigError

__all__ = [
    "ELASTIC_POLICIES",
    "FAULT_PHASES",
    "LAUNCHERS",
    "SCHEME_SECTIONS",
    "BalanceSection",
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "EarlyExitSection",
    "ElasticSection",
    "FaultSection",
    "FreezingSection",
    "JobConfig",
    "JobSection",
    "MoDSection",
    "MoESection",
    "ModelSection",
    "PipelineSection",
    "PruningSection",
    "RuntimeSection",
    "SchemesSection",
    "SlurmSection",
    "SparseAttentionSection",
    "TrainSection",
    "apply_overrides",
    "every_other_block",
    "from_dict",
    "load",
    "load_yaml",
    "mem_mb",
    "parse_override",
    "register_section",
    "sbatch_option_problems",
    "set_dotted",
    "unregister_section",
]
