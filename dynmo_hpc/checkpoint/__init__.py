"""Checkpoints: writing them, finding the newest good one, and resuming from it.

- :mod:`~dynmo_hpc.checkpoint.store`: one checkpoint on disk (layers, optimizer state, run
  state), written atomically and verified on load.
- :mod:`~dynmo_hpc.checkpoint.manifest`: the manifest format and its checksums (pure).
- :mod:`~dynmo_hpc.checkpoint.lineage`: the run's checkpoints in order, and which to resume.
- :mod:`~dynmo_hpc.checkpoint.resume`: what a resumed launch restores, and which config changes
  it accepts.
- :mod:`~dynmo_hpc.checkpoint.resume_events`: the run-log events a resume writes.

What a checkpoint's ``run_state.json`` holds is built by the trainer
(:mod:`dynmo_hpc.train.run_state`).
"""
