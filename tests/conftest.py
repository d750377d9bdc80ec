from __future__ import annotations

import os
import sys
from pathlib import Path

# Make tests/ importable as a plain directory (mpi_helpers, slurm_cluster).
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

from slurm_cluster import slurm_cluster  # noqa: F401  (session fixture for the SLURM tests)
