"""Test helpers: tiny job configs and local launches (:mod:`.jobs`), many runs in one ``mpiexec``
launch (:mod:`.rank_program`), the elastic tests' static-vs-packed launch (:mod:`.elastic`),
scheme jobs and a one-rank run of the real trainer (:mod:`.scheme_jobs`) and the real SLURM test
cluster fixture (:mod:`.slurm_cluster`)."""
