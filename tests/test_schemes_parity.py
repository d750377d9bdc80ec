"""With each scheme on, the real MPI pipeline's per-step losses equal the single-process run.

Every scheme changes the work (routing, shrinking, freezing, skipping blocks and tokens) and some
make discrete, data-dependent decisions (top-k routes, exits, kept attention blocks, which
structures to prune, when to freeze). Those decisions must come out the same on every partition:
the losses of 2 and 4 real ranks must match ``train_reference`` within 1e-5 relative. The
overrides (``SCHEME_OVERRIDES`` in ``tests/helpers/scheme_jobs.py``) make each mechanism act
within the four steps; the run log's ``scheme_stats`` events confirm that it did.
"""

from __future__ import annotations

import pytest

from dynmo_hpc.model.schemes import BUILTIN_SCHEMES
from dynmo_hpc.pipeline.reference import train_reference
from dynmo_hpc.runlog import load
from tests.helpers.jobs import assert_losses_close, run_job
from tests.helpers.scheme_jobs import scheme_acted, scheme_config, scheme_events

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BUILTIN_NAMES = [scheme.name for scheme in BUILTIN_SCHEMES]
"""Every built-in scheme, from the registry (a new one needs its SCHEME_OVERRIDES entry)."""


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("scheme", BUILTIN_NAMES)
def test_scheme_losses_match_single_process(tmp_path, scheme, num_stages):
    cfg = scheme_config(
        tmp_path, scheme, f"pipeline.num_stages={num_stages}", f"job.name={scheme}_{num_stages}"
    )
    reference = train_reference(cfg)
    result = run_job(cfg)
    assert_losses_close(result["losses"], reference.losses, rel=1e-5)
    events = scheme_events(load(cfg.run_dir / "run.h5").events)
    assert scheme_acted(scheme, events), f"{scheme} did not act in the parity run: {events}"
