"""Fitting the simulator's machine to measurements: per-layer rates and the calibration runs.

- :mod:`~dynmo_hpc.calibrate.cost_measure`: times the project's real layers in each scheme state.
- :mod:`~dynmo_hpc.calibrate.cost_fit`: fits a machine's per-layer rates to those times and
  checks them on shapes the fit never saw.
- :mod:`~dynmo_hpc.calibrate.short_runs`: the short real runs the simulator is calibrated and
  checked against.

The simulator itself (replay, step model, held-out check) is :mod:`dynmo_hpc.sim`.
"""
