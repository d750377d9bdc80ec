"""What a rank and the process that launched it tell each other, through the run directory and
the environment.

The ranks (:mod:`dynmo_hpc.pipeline`) sit below the launchers (:mod:`dynmo_hpc.launch`,
:mod:`dynmo_hpc.slurm`) in the package layers, so the few names and files both sides use live
here, beneath both, and neither side imports the other for them:

- :mod:`~dynmo_hpc.handoff.env`: the environment variables a launcher sets for its ranks;
- :mod:`~dynmo_hpc.handoff.rank_status`: each rank's last phase, read after a crash;
- :mod:`~dynmo_hpc.handoff.resize`: a pack's request and the phases of the resize it caused;
- :mod:`~dynmo_hpc.handoff.failures`: failures the next step's rank 0 puts into the run log;
- :mod:`~dynmo_hpc.handoff.oom`: a rank that ran out of memory, for the fallback after a pack.
"""
