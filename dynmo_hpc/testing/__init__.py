"""Machinery that exists for the tests: nothing here changes what a normal run computes.

- :mod:`~dynmo_hpc.testing.reference`: single-process training, the yardstick for pipeline
  parity.
- :mod:`~dynmo_hpc.testing.fault_injection`: one chosen rank fails at a named phase of a chosen
  step (configured by the job's ``fault:`` section; a null object otherwise).
"""
