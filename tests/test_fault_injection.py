"""The one fault-injection system: configured under ``fault.inject_*``, a null object otherwise.

The injector's choices are checked here without killing anything (the crashes themselves are in
tests/test_faults.py); the old ``runtime.fail_*`` keys get an error naming the new key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.config.fault import FaultSection
from dynmo_hpc.errors import ConfigError
from dynmo_hpc.testing.fault_injection import ArmedFault, NoFaults, make_injector


def _fault(**kw: object) -> FaultSection:
    section = FaultSection(**kw)  # type: ignore[arg-type]
    section.validate()
    return section


def test_unconfigured_or_other_rank_or_relaunch_gets_the_null_injector() -> None:
    armed = _fault(inject_step=3, inject_rank=1)
    assert isinstance(make_injector(FaultSection(), rank=0, attempt=0), NoFaults)
    assert isinstance(make_injector(armed, rank=0, attempt=0), NoFaults)
    assert isinstance(make_injector(armed, rank=1, attempt=1), NoFaults)
    assert isinstance(make_injector(armed, rank=1, attempt=0), ArmedFault)
    null = NoFaults()
    null.at("step", 3)
    assert null.hook("checkpoint", 3) is None
    assert null.chunk_hook(3) is None


def test_raise_fires_once_at_the_first_phase_at_or_after_its_step() -> None:
    injector = make_injector(_fault(inject_step=2, inject_action="raise"), rank=0, attempt=0)
    injector.at("step", 1)  # before its step
    injector.at("load_report", 2)  # another phase
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at step 2"):
        injector.at("step", 2)
    injector.at("step", 3)  # disarmed


def test_checkpoint_strikes_through_its_hook_and_corruption_through_the_chunk_hook() -> None:
    checkpoint = _fault(inject_step=0, inject_phase="checkpoint", inject_action="raise")
    injector = make_injector(checkpoint, rank=0, attempt=0)
    hook = injector.hook("checkpoint", 4)
    assert hook is not None and injector.chunk_hook(4) is None
    with pytest.raises(RuntimeError):
        hook()

    corrupt = _fault(inject_step=1, inject_phase="migration", inject_action="corrupt")
    injector = make_injector(corrupt, rank=0, attempt=0)
    injector.at("migration", 1)  # a corruption needs a chunk: nothing happens
    on_chunk = injector.chunk_hook(1)
    assert on_chunk is not None
    empty, chunk = np.zeros(0, dtype=np.float32), np.zeros(4, dtype=np.float32)
    on_chunk(None, 0, empty)  # nothing to damage: stays armed
    on_chunk(None, 1, chunk)
    assert chunk.view(np.uint8)[0] == 0xFF
    second = np.zeros(4, dtype=np.float32)
    on_chunk(None, 2, second)
    assert not second.any(), "a fault fires once"


def test_new_actions_are_validated() -> None:
    with pytest.raises(ConfigError, match="inject_action=corrupt damages a migration"):
        _fault(inject_step=0, inject_action="corrupt")
    with pytest.raises(ConfigError, match="must be one of signal, hang, corrupt, raise, kill_job"):
        dataclasses.replace(FaultSection(), inject_action="explode").validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fail_at_step: 2", "fault.inject_step"),
        ("fail_rank: 1", "fault.inject_rank"),
        ("fail_mode: sigkill_job", "fault.inject_action"),
    ],
)
def test_an_old_runtime_fail_key_in_a_yaml_names_the_new_key(
    tmp_path: Path, old: str, new: str
) -> None:
    job = tmp_path / "old.yaml"
    job.write_text(f"runtime:\n  {old}\n")
    with pytest.raises(ConfigError, match=rf"runtime\.{old.split(':')[0]}.? was replaced by {new}"):
        config_mod.load(job)
