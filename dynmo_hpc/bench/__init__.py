"""``dynmo-hpc bench``: DynMo against the static splits users run today, on this machine.

Why a package of its own: the comparison is the claim the project makes, so its parts are kept
small and checkable. :mod:`.algorithms` says what each balancing algorithm
(:data:`dynmo_hpc.balance.ALGORITHMS`) changes in a job and in which order the runs go;
:mod:`.measure` turns one run's log into figures; :mod:`.summary` aggregates repeats, checks that
every algorithm trained the same model, and renders the table; :mod:`.output` writes the
HDF5 file and the chart. Only :mod:`dynmo_hpc.cli.bench` launches ranks for the bench;
:mod:`.scripts` holds what the ``benchmarks/*.py`` scripts share (their output files, their
rank programs on local MPI ranks).
"""
