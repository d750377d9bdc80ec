"""The communicators of an R x P job, split from the world by the :class:`Topology`.

The MPI half of :mod:`dynmo_hpc.pipeline.topology` (which is pure): one ``Comm.Split`` by
replica gives each replica its pipeline communicator (rank there = stage), one by stage gives
each stage its data communicator (rank there = replica). Who talks over which:

- ``pipeline``: activations and gradients between stage neighbours, the clipping norm (each layer
  counted once), scheme decisions, layer migration (each replica moves the same layers over its
  own pipeline communicator);
- ``data``: the per-step gradient all-reduce between the copies of one stage;
- ``tied``: with tied embeddings and more than one stage, the first and the last stage of one
  replica (rank there 0 and 1), which sum the two copies' gradients of the tied weight
  (:mod:`dynmo_hpc.pipeline.tied_grads`); None on the other ranks;
- ``world``: step-boundary agreement (stop signals, checkpoint clock), the gathers to rank 0
  (losses, stage times, load reports) and checkpoints.

With one replica the pipeline communicator spans the world and the data communicator is each
rank alone, so a pipeline-only job runs exactly as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mpi4py import MPI

from dynmo_hpc.pipeline.topology import Topology


@dataclass(frozen=True)
class RankGroups:
    """This rank's topology and the communicators that go with it."""

    topology: Topology
    world: MPI.Comm
    pipeline: MPI.Comm
    """This replica's ranks, ordered by stage (``pipeline.rank == topology.stage``)."""
    data: MPI.Comm
    """This stage's ranks, ordered by replica (``data.rank == topology.replica``)."""
    tied: MPI.Comm | None = None
    """The first and last stage of this replica (tied embeddings, several stages), else None."""
    ranks_on_host: int = 1
    """The ranks on this rank's host (MPI's shared-memory split of ``world``, or the launcher's
    count when that is more): how many share its cores."""


LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
"""Where Open MPI and MPICH's Hydra tell a process how many ranks of its launch share its
host."""


def launcher_ranks_on_host() -> int:
    """The launch's ranks on this host as the launcher says (0 when it does not): more than
    ``world``'s own when ``world`` is a part of the launch (tests train several small jobs on
    parts of one launch), whose other ranks compete for the same cores."""
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def make_groups(
    world: MPI.Comm, num_stages: int, num_replicas: int, *, tied: bool = False
) -> RankGroups:
    """Split ``world`` into pipeline and data communicators (and, with ``tied``, the tied
    embeddings' ones); collective on ``world``.

    Raises :class:`~dynmo_hpc.errors.ConfigError` (on every rank alike) when the world is not
    ``num_replicas * num_stages`` ranks.
    """
    topology = Topology(
        world_size=world.size, rank=world.rank, num_stages=num_stages, num_replicas=num_replicas
    )
    pipeline = world.Split(color=topology.replica, key=topology.stage)
    data = world.Split(color=topology.stage, key=topology.replica)
    assert pipeline.rank == topology.stage and data.rank == topology.replica
    tied_comm = None
    if tied and num_stages > 1:
        ends = topology.stage in (0, num_stages - 1)
        tied_comm = world.Split(
            color=topology.replica if ends else MPI.UNDEFINED, key=topology.stage
        )
        if tied_comm == MPI.COMM_NULL:
            tied_comm = None
    host = world.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_on_host = max(host.size, launcher_ranks_on_host())
    host.Free()
    return RankGroups(
        topology=topology,
        world=world,
        pipeline=pipeline,
        data=data,
        tied=tied_comm,
        ranks_on_host=ranks_on_host,
    )
