"""Which rank is which: R data-parallel replicas of a P-stage pipeline (pure).

A job of ``pipeline.replicas`` (R) replicas of ``pipeline.num_stages`` (P) stages runs on
``R * P`` MPI ranks. Every rank is one stage of one replica; nothing else in the engine derives
a stage from a rank: the trainer builds a :class:`Topology` once at start and passes it (and the
communicators :mod:`dynmo_hpc.pipeline.groups` splits from it) down.

Placement: replica ``r``'s stages are consecutive ranks, ``rank = r * P + s``. Launchers place
ranks on nodes in blocks (``srun``'s and ``mpiexec``'s default: ranks ``0..k-1`` on the first
node, ``k..2k-1`` on the next, ...), so a replica's pipeline traffic (activations and gradients
every microbatch, to its stage neighbours) stays within as few nodes as possible, and only the
gradient all-reduce (once per step, between the same stage of every replica) crosses between
the replicas' nodes. Example with P = 2, R = 2 and two ranks per node: replica 0 is node 0,
replica 1 is node 1; each stage's data group spans both nodes.

Microbatches: a step's global batch is ``train.num_microbatches`` (M) microbatches whatever R is;
replica ``r`` trains the contiguous block ``r * M/R .. (r+1) * M/R - 1``
(:func:`replica_microbatches`). The data are a pure function of (seed, step, global microbatch),
so the union over replicas is exactly the batch one replica would train.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynmo_hpc.errors import ConfigError


def rank_of(replica: int, stage: int, num_stages: int) -> int:
    """The world rank of ``stage`` in ``replica``: replicas are consecutive blocks of ranks.

    Example: ``rank_of(1, 0, 2) == 2`` (replica 1's first stage follows replica 0's two).
    """
    return replica * num_stages + stage


def check_world(world_size: int, num_stages: int, num_replicas: int) -> None:
    """Refuse an MPI world that is not ``replicas * num_stages`` ranks (a launch mistake)."""
    if num_stages < 1 or num_replicas < 1 or world_size != num_stages * num_replicas:
        raise ConfigError(
            f"MPI world size ({world_size}) != pipeline.replicas({num_replicas}) * "
            f"pipeline.num_stages({num_stages}) = {num_replicas * num_stages}; HINT: launch "
            f"with -n {num_replicas * num_stages}, or set pipeline.replicas and "
            f"pipeline.num_stages so that their product is {world_size}"
        )


def replica_microbatches(replica: int, num_replicas: int, num_microbatches: int) -> range:
    """The global microbatch indices ``replica`` trains in every step (a contiguous block).

    Example: ``list(replica_microbatches(1, 2, 6)) == [3, 4, 5]``.
    """
    if num_microbatches % num_replicas:
        raise ConfigError(
            f"train.num_microbatches({num_microbatches}) is not divisible by "
            f"pipeline.replicas({num_replicas}); HINT: use a multiple of {num_replicas}"
        )
    per_replica = num_microbatches // num_replicas
    return range(replica * per_replica, (replica + 1) * per_replica)


def nodes_of_replica(replica: int, num_stages: int, ranks_per_node: int) -> list[int]:
    """The nodes (by index, block placement) replica ``replica``'s stages run on.

    Example: P = 3 with two ranks per node: replica 0 is on nodes [0, 1], replica 1 on [1, 2].
    """
    first = rank_of(replica, 0, num_stages)
    last = rank_of(replica, num_stages - 1, num_stages)
    per_node = max(1, ranks_per_node)
    return list(range(first // per_node, last // per_node + 1))


@dataclass(frozen=True, kw_only=True)
class Topology:
    """One rank's place in the R x P grid; made once per rank at start, the same rule on all."""

    world_size: int
    """Ranks in the job: ``num_replicas * num_stages``."""
    rank: int
    """This rank in the job (``MPI.COMM_WORLD``)."""
    num_stages: int
    """Pipeline stages per replica (P)."""
    num_replicas: int
    """Data-parallel replicas (R), all on one partition."""

    def __post_init__(self) -> None:
        check_world(self.world_size, self.num_stages, self.num_replicas)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")

    @property
    def replica(self) -> int:
        """Which replica this rank belongs to (its data-parallel index)."""
        return self.rank // self.num_stages

    @property
    def stage(self) -> int:
        """This rank's pipeline position within its replica."""
        return self.rank % self.num_stages

    @property
    def pipeline_ranks(self) -> list[int]:
        """The world ranks of this rank's replica, by stage (its pipeline communicator)."""
        return [rank_of(self.replica, s, self.num_stages) for s in range(self.num_stages)]

    @property
    def data_ranks(self) -> list[int]:
        """The world ranks holding this rank's stage, by replica (its data communicator)."""
        return [rank_of(r, self.stage, self.num_stages) for r in range(self.num_replicas)]

    @property
    def writes_layers(self) -> bool:
        """Whether this rank writes its layers to a checkpoint: replica 0 only (once per layer)."""
        return self.replica == 0

    def microbatches(self, num_microbatches: int) -> range:
        """The global microbatches this rank's replica trains each step."""
        return replica_microbatches(self.replica, self.num_replicas, num_microbatches)
