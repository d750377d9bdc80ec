from __future__ import annotations

import os

os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (session fixture for the SLURM tests)
