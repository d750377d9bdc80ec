"""Checkpoint lineage: a restart resumes from its own history, never from an abandoned branch.

The reproduction of issue 26: a 6-step run leaves step_4 and step_6; a resume from step_4
crashes after writing step_5. The restart must load step_5 (not the old run's step_6), step_4
must survive until step_5 is complete, and the old step_6 is set aside, never picked. Also: the
restart search reads one checkpoint in full, not all of them twice, and the "resumed from" log
line is written on a resume (and not on a restart with no checkpoint).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dynmo_hpc.checkpoint import lineage, resume, store
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.launch.supervisor import newest_checkpoint
from dynmo_hpc.runlog import load
from tests.helpers.jobs import read_result, tiny_config

NUM_LAYERS = 3


def _fake(root: Path, step: int, *, keep: int = 2, parent: Path | None = None) -> Path:
    """A complete checkpoint with made-up layer files (enough for every check but torch.load)."""
    directory = store.step_dir(root, step)
    files = {
        store.layer_name(i): store.write_file(
            directory, store.layer_name(i), f"layer {i} at step {step}".encode() * 50
        )
        for i in range(NUM_LAYERS)
    }
    files[store.RUN_STATE] = store.write_run_state(directory, {"step": step})
    key = store.key_of(root, parent) if parent is not None else None
    return store.commit(root, step, files, keep, key)


def _record(directory: Path) -> dict[str, Any]:
    manifest = json.loads((directory / "manifest.json").read_text())
    record: dict[str, Any] = manifest.get("lineage", {})  # {} before lineages (today's main)
    return record


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_a_resume_from_an_older_checkpoint_starts_a_branch_and_restarts_stay_on_it(tmp_path):
    run_dir = tmp_path / "run"
    root = store.checkpoint_root(run_dir)
    assert store.enter(root, None, restart=False) is None
    assert not root.exists()  # a fresh start writes nothing; the first save makes the branch
    s2 = _fake(root, 2)
    first = lineage.read_head(root)
    assert first is not None and first.start is None
    s4 = _fake(root, 4, parent=s2)
    _fake(root, 6, parent=s4)
    assert _names(root) == ["step_4", "step_6"]  # keep=2

    # resume from step_4: a new branch; the old step_6 is moved aside, latest names step_4
    second = store.enter(root, s4, restart=False)
    assert second.branch != first.branch and second.start == lineage.Key(first.branch, 4, "step_4")
    assert _names(root) == ["step_4"]
    aside = root / "abandoned" / first.branch / "step_6"
    assert store.verify(aside) is None and _record(aside)["branch"] == first.branch
    assert (root / "latest").read_text().strip() == "step_4"
    assert newest_checkpoint(run_dir) == s4  # a crash before step_5: restart from step_4

    # step_5 complete: step_4 (resumed from) is still kept (keep=2), the restart takes step_5
    s5 = _fake(root, 5, parent=s4)
    assert _names(root) == ["step_4", "step_5"]
    assert newest_checkpoint(run_dir) == s5
    assert (root / "latest").read_text().strip() == "step_5"
    record = _record(s5)
    assert record["branch"] == second.branch
    assert record["parent"] == {"branch": first.branch, "step": 4, "path": "step_4"}
    assert record["start"] == record["parent"]

    # a restart from step_5 continues the branch; its step_6 is not the abandoned one
    assert store.enter(root, s5, restart=False) == second
    s6 = _fake(root, 6, parent=s5)
    assert _names(root) == ["step_5", "step_6"]  # step_4 pruned only now: 2 newer are complete
    assert _record(s6)["branch"] == second.branch and store.resolve(run_dir)[0].path == s6
    assert store.verify(aside) is None  # never pruned


def test_the_abandoned_branch_is_never_chosen_even_when_it_is_newer(tmp_path):
    """Even left at the top level (a directory copied back by hand), another branch's newer
    checkpoint is not in the lineage: the search passes over it."""
    run_dir = tmp_path / "run"
    root = store.checkpoint_root(run_dir)
    s4 = _fake(root, 4)
    old = lineage.read_head(root)
    assert old is not None
    _fake(root, 6, parent=s4)
    store.enter(root, s4, restart=False)
    (root / "abandoned" / old.branch / "step_6").rename(root / "step_6")
    assert newest_checkpoint(run_dir) == s4
    s5 = _fake(root, 5, parent=s4, keep=1)
    assert newest_checkpoint(run_dir) == s5
    assert _names(root) == ["step_5", "step_6"]  # keep=1 prunes step_4, never the other branch


def test_damaged_newer_checkpoints_do_not_fork_the_branch(tmp_path):
    """A resume from step_4 because step_6 fails its checksum continues the branch."""
    run_dir = tmp_path / "run"
    root = store.checkpoint_root(run_dir)
    s4 = _fake(root, 4)
    head = lineage.read_head(root)
    s6 = _fake(root, 6, parent=s4)
    layer = s6 / store.layer_name(1)
    data = bytearray(layer.read_bytes())
    data[7] ^= 0x01
    layer.write_bytes(bytes(data))
    chosen, skipped = store.resolve(run_dir)
    assert chosen.path == s4 and "CRC-32" in (skipped[0].problem or "")
    assert store.enter(root, s4, restart=False) == head
    assert _names(root) == ["step_4", "step_6"] and not (root / "abandoned").exists()


def test_a_damaged_lineage_record_is_a_damaged_checkpoint(tmp_path):
    """A changed byte in the record (another branch id) must not move the checkpoint into
    another history silently: the record has its own CRC-32, and the search skips it."""
    run_dir = tmp_path / "run"
    root = store.checkpoint_root(run_dir)
    s4 = _fake(root, 4)
    s6 = _fake(root, 6, parent=s4)
    path = s6 / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["lineage"]["branch"] = "0" * 12
    path.write_text(json.dumps(manifest))
    chosen, skipped = store.resolve(run_dir)
    assert chosen.path == s4 and [c.path for c in skipped] == [s6]
    assert "lineage record" in (skipped[0].problem or "")


def test_a_directory_from_before_lineages_resumes_newest_first(tmp_path):
    run_dir = tmp_path / "run"
    root = store.checkpoint_root(run_dir)
    for step in (2, 4):
        _fake(root, step, keep=5)
    (root / lineage.HEAD).unlink()  # as an old version left it: no head, no records
    for step in (2, 4):
        path = root / f"step_{step}" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["lineage"]
        manifest["format"] = 1
        path.write_text(json.dumps(manifest))
    assert newest_checkpoint(run_dir) == root / "step_4"
    head = store.enter(root, root / "step_2", restart=False)
    assert head.start == lineage.Key(None, 2, "step_2")
    assert (
        _names(root) == ["step_2"] and (root / "abandoned" / "before-lineage" / "step_4").is_dir()
    )


def test_the_restart_search_reads_one_checkpoint_in_full_and_the_ranks_read_nothing_twice(
    tmp_path, monkeypatch
):
    """Issue 26: the search read every kept checkpoint in full, then rank 0 read the chosen one
    again (2N+1). Now: cheap checks (manifest, sizes), one full read of the chosen one, and
    rank 0 reads only the small run state before the ranks load their layers."""
    cfg = tiny_config(tmp_path, "job.name=reads", "train.steps=8")
    root = store.checkpoint_root(cfg.run_dir)
    num_layers = cfg.model.num_layers
    state = {
        "parts": [0, num_layers],
        "identity": resume.identity(cfg),
        "balancer": {},
        "history": {},
    }
    for step in (2, 4, 6):
        directory = store.step_dir(root, step)
        files = {
            store.layer_name(i): store.write_file(
                directory, store.layer_name(i), bytes([i, step]) * 4096
            )
            for i in range(num_layers)
        }
        files[store.RUN_STATE] = store.write_run_state(directory, {**state, "step": step})
        store.commit(root, step, files, keep=3)
    reads: Counter[str] = Counter()
    real = Path.read_bytes

    def counting(path: Path) -> bytes:
        if path.suffix == ".pt":
            reads[f"{path.parent.name}/{path.name}"] += 1
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", counting)
    chosen, skipped = store.resolve(cfg.run_dir)
    assert chosen.step == 6 and not skipped
    store.scan(root)  # what the rank 0 of a resumed run lists for its skip warnings
    resume.checked_resume_dir(cfg, chosen.path)
    assert reads == Counter({f"step_6/{store.layer_name(i)}": 1 for i in range(num_layers)})


@pytest.mark.mpi
def test_a_crash_after_a_resume_from_an_older_checkpoint_restarts_on_its_own_branch(tmp_path):
    """Issue 26's reproduction, end to end with real ranks and a real crash."""
    overrides = [
        "train.steps=6",
        "pipeline.num_stages=2",
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
        "checkpoint.at_end=true",
        "job.name=lineage",
    ]
    first = tiny_config(tmp_path, *overrides)
    rc, run_dir = launch_local(first, timeout_s=240)
    root = store.checkpoint_root(run_dir)
    assert rc == 0 and _names(root) == ["step_4", "step_6"]
    old_branch = _record(root / "step_6").get("branch")
    want = read_result(run_dir)["losses"]

    # the same job resumed from step_4, checkpointing every step; rank 1 is killed in step 5,
    # after step_5 was written; the supervisor restarts the job by itself
    crashing = tiny_config(
        tmp_path,
        *overrides,
        "checkpoint.every_steps=1",
        "fault.inject_step=5",
        "fault.inject_rank=1",
        "fault.max_restarts=1",
    )
    rc, _ = launch_local(crashing, timeout_s=240, resume_from=root / "step_4")
    assert rc == 0

    run = load(run_dir / "run.h5")
    assert run.restarts["checkpoint_step"].tolist() == [4, 5], "the restart left its lineage"
    failures = run.events[run.events["kind"] == "failure"]["detail"].tolist()
    assert [f["from"] for f in failures] == [str(root / "step_5")]
    assert read_result(run_dir)["losses"] == want
    assert run.steps["step"].tolist() == list(range(6))

    # the new branch: step_5 descends from step_4 of the old one, step_6 from step_5
    assert _names(root) == ["step_5", "step_6"]
    s5, s6 = _record(root / "step_5"), _record(root / "step_6")
    assert s5["branch"] == s6["branch"] != old_branch
    assert s5["parent"] == {"branch": old_branch, "step": 4, "path": "step_4"}
    assert s6["parent"] == {"branch": s5["branch"], "step": 5, "path": "step_5"}
    assert (root / "latest").read_text().strip() == "step_6"
    aside = root / "abandoned" / old_branch / "step_6"
    assert store.verify(aside) is None and _record(aside)["branch"] == old_branch


def _one_rank(tmp_path: Path, *overrides: str) -> Any:
    return tiny_config(
        tmp_path,
        "pipeline.num_stages=1",
        "job.name=logline",
        "balance.algorithm=static",
        *overrides,
    )


def test_the_resumed_from_line_is_logged_on_a_resume_and_not_on_a_fresh_restart(tmp_path, caplog):
    from mpi4py import MPI

    from dynmo_hpc.train.trainer import Trainer

    caplog.set_level(logging.INFO, logger="dynmo_hpc.train.trainer")
    cfg = _one_rank(tmp_path, "train.steps=2", "checkpoint.at_end=true")
    cfg.run_dir.mkdir(parents=True)
    Trainer(cfg, MPI.COMM_SELF, cfg.run_dir).train()
    step_2 = store.checkpoint_root(cfg.run_dir) / "step_2"
    assert store.verify(step_2) is None
    caplog.clear()

    resumed = _one_rank(tmp_path, "train.steps=3", "checkpoint.at_end=true")
    Trainer(resumed, MPI.COMM_SELF, resumed.run_dir, resume_from=step_2).train()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"resumed from {step_2} (step 2)") for line in lines), lines
    caplog.clear()

    restarted = _one_rank(tmp_path, "train.steps=1", "job.name=fresh")
    restarted.run_dir.mkdir(parents=True)
    Trainer(restarted, MPI.COMM_SELF, restarted.run_dir, restart=True).train()
    lines = [r.getMessage() for r in caplog.records]
    assert not any("resumed from" in line for line in lines), lines
    assert any(line.startswith("restarted from the beginning") for line in lines), lines


def test_manifest_crc_is_checked_on_the_bytes_a_rank_loads(tmp_path):
    """A layer file damaged after the search chose its checkpoint is refused by the loader."""
    from dynmo_hpc.errors import CheckpointError

    root = tmp_path / "checkpoint"
    directory = _fake(root, 1)
    name = store.layer_name(0)
    entry = store.manifest_files(directory)[name]
    assert entry["crc32"] == zlib.crc32((directory / name).read_bytes())
    with pytest.raises(CheckpointError, match="CRC-32"):
        store.load_layer(directory, 0, {**entry, "crc32": entry["crc32"] ^ 1})


def test_the_root_entries_are_fsynced_before_an_old_checkpoint_is_pruned(tmp_path, monkeypatch):
    """Issue 26: old checkpoints were deleted right after a new manifest was written, with the
    directory entries never fsynced. Records every fsync of a directory and every removal: the
    checkpoint root must be fsynced after the new step's manifest and before the old step goes."""
    import os
    import shutil
    import stat

    root = store.checkpoint_root(tmp_path / "run")
    _fake(root, 2, keep=1)
    events: list[tuple[str, str]] = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("remove", os.path.realpath(path)))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    _fake(root, 4, keep=1)
    assert _names(root) == ["step_4"]
    removed = events.index(("remove", os.path.realpath(root / "step_2")))
    manifest_dir = events.index(("fsync", os.path.realpath(root / "step_4")))
    root_synced = [i for i, e in enumerate(events) if e == ("fsync", os.path.realpath(root))]
    assert manifest_dir < removed, events
    assert any(manifest_dir < i < removed for i in root_synced), events
