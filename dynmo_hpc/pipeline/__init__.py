"""The pipeline engine on every rank: one stage's layers, its schedule, its links, its costs.

- :mod:`~dynmo_hpc.pipeline.stage`: the layers a stage owns and the runner for its schedule.
- :mod:`~dynmo_hpc.pipeline.schedule`: 1F1B and GPipe as pure functions.
- :mod:`~dynmo_hpc.pipeline.comm`: stage-to-stage activations and gradients (mpi4py or
  torch.distributed); :mod:`~dynmo_hpc.pipeline.waiting`: how a waiting stage yields its core.
- :mod:`~dynmo_hpc.pipeline.topology` and :mod:`~dynmo_hpc.pipeline.groups`: which rank is which
  stage of which replica, and their communicators.
- :mod:`~dynmo_hpc.pipeline.grad_sync`: summing a stage's gradients over its replicas.
- :mod:`~dynmo_hpc.pipeline.costs`: per-layer cost accumulation and smoothing.
- :mod:`~dynmo_hpc.pipeline.device`: device choice and layer timers.
- :mod:`~dynmo_hpc.pipeline.migration`: moving layers between stages with their optimizer state.

The step loop that drives all this is :mod:`dynmo_hpc.train`.
"""
