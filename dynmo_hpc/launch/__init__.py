"""Starting the ranks: locally with ``mpiexec``, or inside a SLURM allocation by the manager.

- :mod:`~dynmo_hpc.launch.local`: the venv's ``mpiexec`` on this machine (the default).
- :mod:`~dynmo_hpc.launch.supervisor`: the loop both launchers share (resizes and restarts);
  the in-allocation manager that drives it under SLURM is :mod:`dynmo_hpc.slurm.manager`.
- :mod:`~dynmo_hpc.launch.worker`: the rank entry point both of them start.
- :mod:`~dynmo_hpc.launch.rundir`: the run directory both of them prepare.
"""
