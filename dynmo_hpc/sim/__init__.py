"""Offline simulation of pipeline steps and of whole runs under each balancing algorithm.

Why: whether a dynamic balancer beats a static split depends on the schedule's bubble, the
communication between stages and the price of migration, not only on the heaviest stage. These
modules answer "how long would this step (this run) take?" from numbers alone: no MPI, no torch.

- :mod:`~dynmo_hpc.sim.orders`: each stage's action order, as arrays (the trainer's schedules);
- :mod:`~dynmo_hpc.sim.step`: one step, action by action;
- :mod:`~dynmo_hpc.sim.replay`: a run's cost traces replayed under a balancing algorithm.
- :mod:`~dynmo_hpc.sim.machine`: the calibrated terms beyond layer compute (overheads, link,
  wall seconds per CPU second) and their JSON file;
- :mod:`~dynmo_hpc.sim.cost_model`: a layer's forward and backward FLOPs and bytes from its
  shape and its scheme state, and their seconds at a machine's rates;
- :mod:`~dynmo_hpc.sim.overheads`: a run log's measured step split per stage, and the overhead
  constants fitted from such splits;

The per-layer rates and the calibration runs are fitted in :mod:`dynmo_hpc.calibrate`.
"""
