"""The resume rules (docs/checkpoints.md, "Resume rules"), without MPI.

Which config changes a resume accepts is one table (:mod:`dynmo_hpc.config.resume_rules`); the
launcher applies it before any rank starts, on a checkpoint it reads only the run state of, so
these tests write that state directly (:mod:`tests.helpers.fake_checkpoint`). The end-to-end
reproductions (the real step_2 kept, a changed weight decay reaching AdamW) are in
tests/test_resume.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint import resume, store
from dynmo_hpc.cli import main
from dynmo_hpc.config.resume_rules import (
    KEY_RULES,
    KeyRule,
    check_allowed_keys,
    classify,
    judge_resume,
    refusal_message,
)
from dynmo_hpc.errors import CheckpointError, LaunchError
from dynmo_hpc.launch.rundir import claim_run_dir
from dynmo_hpc.model.optim import apply_hyperparameters, build_optimizer
from tests.helpers.fake_checkpoint import write_fake_checkpoint
from tests.helpers.jobs import tiny_config

SAVED = {
    "train.lr": 1e-3,
    "train.beta2": 0.95,
    "train.steps": 6,
    "train.log_interval": 5,
    "checkpoint.every_steps": 2,
    "model.d_model": 32,
}


def _with(**changes: object) -> dict[str, object]:
    return {**SAVED, **{k.replace("__", "."): v for k, v in changes.items()}}


# --- the table -------------------------------------------------------------------------------


def test_every_config_key_is_classified_by_an_explicit_entry() -> None:
    """A new config key must be placed in the table by its author (the default is MATH)."""
    for key in resume.config_dict(config_mod.JobConfig()):
        parts = key.split(".")
        prefixes = {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
        assert prefixes & set(KEY_RULES), f"{key} falls under no entry of KEY_RULES"


def test_classification() -> None:
    assert classify("train.lr") is KeyRule.MATH
    assert classify("train.weight_decay") is KeyRule.MATH
    assert classify("train.beta1") is KeyRule.MATH
    assert classify("train.steps") is KeyRule.STEPS
    assert classify("train.log_interval") is KeyRule.FREE
    assert classify("checkpoint.every_steps") is KeyRule.FREE
    assert classify("pipeline.num_stages") is KeyRule.FREE
    assert classify("model.d_model") is KeyRule.IDENTITY
    assert classify("job.seed") is KeyRule.IDENTITY
    assert classify("nosuchsection.key") is KeyRule.MATH  # the safe side


def test_identity_is_the_identity_rows_of_the_table() -> None:
    ident = resume.identity(config_mod.JobConfig())
    assert "job.seed" in ident and "model.d_model" in ident and "data.path" in ident
    assert not any(k.startswith(("train.", "pipeline.", "job.name")) for k in ident)


# --- the judgement ---------------------------------------------------------------------------


def test_unchanged_and_free_changes_pass() -> None:
    verdict = judge_resume(SAVED, _with(train__log_interval=1, checkpoint__every_steps=3), 4)
    assert verdict.ok
    assert [c.key for c in verdict.passed] == ["checkpoint.every_steps", "train.log_interval"]


def test_math_change_is_refused_unless_allowed() -> None:
    new = _with(train__lr=3e-3, train__beta2=0.99)
    verdict = judge_resume(SAVED, new, 4)
    assert not verdict.ok
    assert [c.key for c in verdict.refused] == ["train.beta2", "train.lr"]
    message = refusal_message(verdict, "runs/x/checkpoint/step_4", 4)
    assert message is not None and "\n" not in message
    assert "train.lr 0.001 -> 0.003" in message and "train.beta2 0.95 -> 0.99" in message
    assert "--allow-change train.beta2 --allow-change train.lr" in message
    allowed = judge_resume(SAVED, new, 4, allowed={"train.lr", "train.beta2"})
    assert allowed.ok and [c.key for c in allowed.accepted] == ["train.beta2", "train.lr"]
    partly = judge_resume(SAVED, new, 4, allowed={"train.lr"})
    assert [c.key for c in partly.refused] == ["train.beta2"]


def test_train_steps_up_passes_down_needs_allowing_below_the_checkpoint_never() -> None:
    assert judge_resume(SAVED, _with(train__steps=10), 4).ok
    lowered = judge_resume(SAVED, _with(train__steps=5), 4)
    assert [c.key for c in lowered.refused] == ["train.steps"]
    assert judge_resume(SAVED, _with(train__steps=5), 4, allowed={"train.steps"}).ok
    assert judge_resume(SAVED, _with(train__steps=4), 4, allowed={"train.steps"}).ok
    below = judge_resume(SAVED, _with(train__steps=2), 4, allowed={"train.steps"})
    assert not below.ok and below.below_checkpoint is not None
    message = refusal_message(below, "step_4", 4)
    assert message is not None and "train.steps=2 is below the checkpoint's step 4" in message


def test_identity_change_is_refused_even_if_allowed() -> None:
    verdict = judge_resume(SAVED, _with(model__d_model=64), 4, allowed={"model.d_model"})
    assert not verdict.ok and [c.key for c in verdict.identity] == ["model.d_model"]
    assert check_allowed_keys(["model.d_model"], SAVED) is not None
    assert check_allowed_keys(["train.lrr"], SAVED) is not None
    assert check_allowed_keys(["train.lr"], SAVED) is None


# --- the launcher's check on a written checkpoint -----------------------------------------------


def test_launcher_refuses_a_changed_lr_and_accepts_it_when_allowed(tmp_path: Path) -> None:
    written = write_fake_checkpoint(tiny_config(tmp_path, "train.steps=6"), 4)
    changed = tiny_config(tmp_path, "train.steps=6", "train.lr=3e-3")
    with pytest.raises(CheckpointError, match=r"train\.lr 0\.001 -> 0\.003.*--allow-change"):
        resume.choose_checkpoint(changed, "")
    chosen = resume.choose_checkpoint(changed, "", ["train.lr"])
    assert chosen.path == written and [c.key for c in chosen.verdict.accepted] == ["train.lr"]
    # The ranks (allowed=None) refuse only what no flag can allow.
    state = store.read_run_state(written)
    assert resume.check_identity(changed, state, written).ok
    with pytest.raises(CheckpointError, match="below the checkpoint's step 4"):
        resume.check_identity(tiny_config(tmp_path, "train.steps=2"), state, written)


def test_checkpoint_without_saved_config_still_refuses_steps_below_it(tmp_path: Path) -> None:
    write_fake_checkpoint(tiny_config(tmp_path, "train.steps=6"), 4, with_config=False)
    with pytest.raises(CheckpointError, match="below the checkpoint's step 4"):
        resume.choose_checkpoint(tiny_config(tmp_path, "train.steps=2"), "")
    assert resume.choose_checkpoint(tiny_config(tmp_path, "train.lr=3e-3"), "").verdict.ok


def test_cli_refusal_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_fake_checkpoint(tiny_config(tmp_path, "train.steps=6"), 4)
    from tests.helpers.jobs import TINY

    sets = [a for o in [*TINY, f"job.out_dir={tmp_path}"] for a in ("--set", o)]
    rc = main(["run", "jobs/default.yaml", *sets, "--set", "train.steps=2", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "train.steps=2 is below the checkpoint's step 4" in err
    rc = main(["run", "jobs/default.yaml", *sets, "--allow-change", "train.lr"])
    assert rc == 2 and "--allow-change train.lr needs --resume" in capsys.readouterr().err


# --- the new values really apply ---------------------------------------------------------------


def test_restored_optimizer_takes_the_jobs_betas_and_weight_decay() -> None:
    old = config_mod.TrainSection()
    new = config_mod.TrainSection(weight_decay=0.01, beta1=0.8, beta2=0.99)
    layer = torch.nn.Linear(4, 4)
    saved = build_optimizer(layer, old).state_dict()
    restored = build_optimizer(layer, new)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["weight_decay"] == old.weight_decay  # what torch does
    apply_hyperparameters(restored, new)
    fresh = build_optimizer(layer, new)
    for got, want in zip(restored.param_groups, fresh.param_groups, strict=True):
        assert got["weight_decay"] == want["weight_decay"]
        assert tuple(got["betas"]) == tuple(want["betas"]) == (0.8, 0.99)
    assert restored.param_groups[1]["weight_decay"] == 0.0


# --- --overwrite says what it removes ----------------------------------------------------------


def test_overwrite_names_everything_it_removes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tiny_config(tmp_path)
    write_fake_checkpoint(cfg, 2)
    write_fake_checkpoint(cfg, 10)
    (cfg.run_dir / "run.h5").write_bytes(b"log")
    (cfg.run_dir / "job.sbatch").write_text("#!/bin/bash\n")
    with pytest.raises(LaunchError, match="add --resume"):
        claim_run_dir(cfg.run_dir, overwrite=False)
    with caplog.at_level(logging.WARNING, logger="dynmo_hpc"):
        claim_run_dir(cfg.run_dir, overwrite=True)
    said = caplog.text
    assert f"{cfg.run_dir / 'run.h5'} (run log)" in said
    assert f"{cfg.run_dir / 'checkpoint'}/ (checkpoints: step_2, step_10)" in said
    assert not (cfg.run_dir / "run.h5").exists() and not (cfg.run_dir / "checkpoint").exists()
    assert (cfg.run_dir / "job.sbatch").is_file()  # not named, not removed


def test_restored_costs_follow_the_microbatches_each_replica_runs(tmp_path):
    """Issue 42, defect 7: a cost is seconds per step of one replica (``M / R``
    microbatches). Saved on 2 replicas of M=4 and resumed on 1 replica, each layer costs twice
    as much per step; the first decisions after the resize must see that."""
    from dynmo_hpc.checkpoint.resume import restored_costs
    from tests.helpers.jobs import tiny_config

    state = {
        "num_replicas": 2,
        "config": {"train": {"num_microbatches": 4}},
        "balancer": {"costs_s": [1.0, 2.0, 3.0]},
    }
    one = tiny_config(tmp_path, "pipeline.replicas=1", "train.num_microbatches=4")
    assert restored_costs(one, state) == [2.0, 4.0, 6.0]
    two = tiny_config(tmp_path, "pipeline.replicas=2", "train.num_microbatches=8")
    assert restored_costs(two, state) == [2.0, 4.0, 6.0]
    same = tiny_config(tmp_path, "pipeline.replicas=2", "train.num_microbatches=4")
    assert restored_costs(same, state) == [1.0, 2.0, 3.0]
    assert restored_costs(same, {"balancer": {"costs_s": None}}) is None


def test_free_changes_that_are_not_bitwise_are_logged_as_config_change(tmp_path):
    """Issue 42, defect 9: a resume onto another replica count, device or bucket size keeps the
    math but not its bits; it is logged as a ``config_change``; a stage count change is not."""
    from dynmo_hpc.checkpoint.resume import config_dict
    from dynmo_hpc.checkpoint.resume_events import log_config_changes
    from dynmo_hpc.config.resume_rules import is_bitwise
    from tests.helpers.jobs import tiny_config

    class Writer:
        def __init__(self):
            self.events = []

        def log_event(self, *, step, kind, detail):
            self.events.append((step, kind, detail))

    saved = tiny_config(tmp_path)
    state = {"step": 2, "config": config_dict(saved)}
    now = tiny_config(tmp_path, "pipeline.replicas=2", "pipeline.grad_bucket_mb=1.0")
    writer = Writer()
    log_config_changes(writer, now, state, 2)
    ((step, kind, detail),) = writer.events
    assert (step, kind) == (2, "config_change")
    keys = {c["key"]: c["rule"] for c in detail["changes"]}
    assert keys == {"pipeline.replicas": "free", "pipeline.grad_bucket_mb": "free"}
    restaged = Writer()
    log_config_changes(restaged, tiny_config(tmp_path, "pipeline.num_stages=3"), state, 2)
    assert restaged.events == []
    assert not is_bitwise("runtime.device") and is_bitwise("pipeline.num_stages")
    assert not is_bitwise("train.lr")
