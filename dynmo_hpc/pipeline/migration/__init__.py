"""Live migration: moving layers between stages with their optimizer state.

- :mod:`~dynmo_hpc.pipeline.migration.move`: the plan's transfers, in global layer order.
- :mod:`~dynmo_hpc.pipeline.migration.wire`: a layer's wire format (storages, checksums).
- :mod:`~dynmo_hpc.pipeline.migration.host_memory`: huge-page host memory for layer storages.
"""
