"""What runs on every rank: one pipeline stage, its schedule, its costs, and layer migration.

- :mod:`~dynmo_hpc.pipeline.trainer`: the per-rank step loop and rank 0's load-report round.
- :mod:`~dynmo_hpc.pipeline.stage`: the layers a stage owns and the runner for its schedule.
- :mod:`~dynmo_hpc.pipeline.schedule`: 1F1B and GPipe as pure functions.
- :mod:`~dynmo_hpc.pipeline.comm`: stage-to-stage activations and gradients (mpi4py or
  torch.distributed).
- :mod:`~dynmo_hpc.pipeline.costs`: per-layer cost accumulation, smoothing, the load report.
- :mod:`~dynmo_hpc.pipeline.rebalance`: rank 0's balancing decision (pure).
- :mod:`~dynmo_hpc.pipeline.migration`: moving layers with their optimizer state.
- :mod:`~dynmo_hpc.pipeline.checkpoint`, :mod:`~dynmo_hpc.pipeline.data`,
  :mod:`~dynmo_hpc.pipeline.device`, :mod:`~dynmo_hpc.pipeline.reference` (single process).
"""
