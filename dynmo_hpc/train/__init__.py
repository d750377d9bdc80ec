"""The per-rank training run: the step loop, rank 0's load reports and decisions, the run log.

- :mod:`~dynmo_hpc.train.trainer`: the step loop every rank runs.
- :mod:`~dynmo_hpc.train.load_report`: the periodic load report and what rank 0 decides from it.
- :mod:`~dynmo_hpc.train.rebalance`: the balancing decision at a report (pure).
- :mod:`~dynmo_hpc.train.pack_inputs` and :mod:`~dynmo_hpc.train.capacity`: what the packing
  decision needs from the running job (memory per layer, what a stage may hold, restart cost).
- :mod:`~dynmo_hpc.train.lifecycle`: the run's result, stop signals and watchdog.
- :mod:`~dynmo_hpc.train.rank0_log`: rank 0's run-log writing.
- :mod:`~dynmo_hpc.train.run_state`: the record saved as a checkpoint's ``run_state.json``.
- :mod:`~dynmo_hpc.train.ab_arms`: the in-run A/B of ``dynmo-hpc bench`` (benchmark only).
"""
