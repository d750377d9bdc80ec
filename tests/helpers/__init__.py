"""Test helpers: tiny job configs and local launches (:mod:`.jobs`), the in-process pipeline
(:mod:`.local_pipeline`) and the real SLURM test cluster fixture (:mod:`.slurm_cluster`)."""
