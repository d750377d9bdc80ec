"""Starting the ranks: locally with ``mpiexec``, or inside a SLURM allocation by the manager.

- :mod:`~dynmo_hpc.launch.local`: the venv's ``mpiexec`` on this machine (the default).
- :mod:`~dynmo_hpc.launch.manager`: runs once in a SLURM allocation and starts the MPI step.
- :mod:`~dynmo_hpc.launch.worker`: the rank entry point both of them start.
- :mod:`~dynmo_hpc.launch.rundir`: the run directory both of them prepare.
"""
