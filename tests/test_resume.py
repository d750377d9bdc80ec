"""Exact resume: a run stopped at step k and resumed (on the same or another stage count)
trains bitwise the same as a run never stopped, for the plain model, all six schemes, and the
llama family with Mixture of Depths (routed tokens keep their rotary positions).

Each case is one uninterrupted reference run and one chain of three launches over the same
steps: the first is stopped by SIGTERM (the path of SLURM's warning signal: stop at the step
boundary and checkpoint); the second, resumed on another stage count, is SIGKILLed as a whole
job some steps after a periodic checkpoint (a crash: nothing saved at the end, steps redone);
the third resumes from the newest complete checkpoint, on a third stage count, and finishes.
The chain's per-step losses, final weights and AdamW state must equal the reference's bitwise,
and its one run log must show two restarts and one authoritative row per step.

The eight uninterrupted reference runs train in one ``mpiexec`` launch
(:mod:`tests.helpers.rank_program`); each chain's three launches are launched as a user would.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dynmo_hpc import config as config_mod
from dynmo_hpc.checkpoint import store
from dynmo_hpc.cli.run import resolve_resume
from dynmo_hpc.launch.local import launch_local
from dynmo_hpc.runlog import load
from tests.helpers import rank_program
from tests.helpers.jobs import read_result
from tests.helpers.scheme_jobs import LLAMA, scheme_config

NUM_STEPS = 8
# Launch 1 gets SIGTERM during step 1 and stops after it: checkpoint step_2.
# Launch 2 checkpoints every 3 steps (step_3, step_6) and is killed at the start of step 5,
# after step 3's load report was flushed: steps 3 and 4 ran, step 3's rows reached the log
# (step 4's too if the writer's timed flush came before the kill).
# Launch 3 resumes from step_3 and redoes steps 3 and 4.
SIGTERM_AT_STEP = 1
SIGKILL_AT_STEP = 5
EVERY_STEPS = 3

CASES: dict[str, dict[str, Any]] = {
    # name: scheme, stage counts of the three launches, extra overrides
    "plain": {"scheme": None, "stages": (4, 2, 3), "extra": ["balance.algorithm=optimal"]},
    "moe": {"scheme": "moe", "stages": (2, 3, 2), "extra": []},
    "pruning": {"scheme": "pruning", "stages": (2, 3, 2), "extra": []},
    "freezing": {"scheme": "freezing", "stages": (2, 3, 2), "extra": ["pipeline.schedule=gpipe"]},
    "sparse_attention": {"scheme": "sparse_attention", "stages": (2, 3, 2), "extra": []},
    "early_exit": {"scheme": "early_exit", "stages": (3, 2, 3), "extra": []},
    "tied": {
        "scheme": None,
        "stages": (2, 3, 2),
        "extra": ["model.tie_embeddings=true", "balance.algorithm=optimal"],
    },
    "mod": {"scheme": "mod", "stages": (2, 3, 2), "extra": ["runtime.p2p=torch"]},
    "llama_mod": {"scheme": "mod", "stages": (3, 2, 3), "extra": LLAMA},
    "bf16": {
        "scheme": None,
        "stages": (3, 2, 3),
        "extra": [*LLAMA, "train.precision=bf16", "train.eval_interval=3", "train.eval_windows=4"],
    },
}


def _config(tmp_path: Path, case: str, name: str, *overrides: str) -> config_mod.JobConfig:
    spec = CASES[case]
    return scheme_config(
        tmp_path,
        spec["scheme"],
        f"train.steps={NUM_STEPS}",
        *spec["extra"],
        f"job.name={name}",
        "checkpoint.at_end=true",
        *overrides,
    )


REFERENCE_ON = {
    # case -> the communicator its reference run trains on (its second launch's stage count)
    "plain": "half0",
    "llama_mod": "half0",
    "early_exit": "half1",
    "bf16": "half0",
    "moe": "trio",
    "pruning": "trio",
    "freezing": "trio",
    "sparse_attention": "trio",
    "tied": "trio",
    "mod": "trio",  # last on its ranks: runtime.p2p=torch sets up torch.distributed
}


def reference_config(out_dir: Path, case: str) -> config_mod.JobConfig:
    """The uninterrupted run of ``case``, on its second launch's stage count."""
    second = CASES[case]["stages"][1]
    return _config(out_dir / case, case, "reference", f"pipeline.num_stages={second}")


def runs(out_dir: Path) -> rank_program.Runs:
    return [(REFERENCE_ON[case], reference_config(out_dir, case)) for case in CASES]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the one launch that trained every case's reference run."""
    out = tmp_path_factory.mktemp("resume_references")
    rank_program.launch(__file__, out)
    return out


def _launch(cfg: config_mod.JobConfig, resume: bool = False) -> int:
    resume_from = resolve_resume(cfg, "") if resume else None
    rc, _ = launch_local(cfg, timeout_s=240, resume_from=resume_from)
    return rc


def _final_layers(run_dir: Path, num_layers: int) -> list[dict[str, Any]]:
    directory = run_dir / "checkpoint" / f"step_{NUM_STEPS}"
    assert store.verify(directory) is None
    return [store.load_layer(directory, i) for i in range(num_layers)]


def assert_bitwise_equal(got: Any, want: Any, where: str) -> None:
    """Nested dicts/lists of tensors and numbers: equal to the bit (NaN never equals)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where}: tensors differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys differ"
        for key in want:
            assert_bitwise_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_run_is_bitwise_the_uninterrupted_run(references, tmp_path, case):
    first, second, third = CASES[case]["stages"]
    reference = reference_config(references, case)
    assert reference.pipeline.num_stages == second
    want = read_result(reference.run_dir)

    # Launch 1: SIGTERM during step 1 -> stops after step 2 with a checkpoint, exits 0.
    stopped = _config(
        tmp_path,
        case,
        "chain",
        f"pipeline.num_stages={first}",
        f"fault.inject_step={SIGTERM_AT_STEP}",
        "fault.inject_signal=SIGTERM",
    )
    assert _launch(stopped) == 0
    assert sorted(p.name for p in (stopped.run_dir / "checkpoint").glob("step_*")) == ["step_2"]

    # Launch 2: resumed on another stage count, periodic checkpoints, then the whole job dies.
    crashed = _config(
        tmp_path,
        case,
        "chain",
        f"pipeline.num_stages={second}",
        f"checkpoint.every_steps={EVERY_STEPS}",
        f"fault.inject_step={SIGKILL_AT_STEP}",
        "fault.inject_rank=1",
        "fault.inject_action=kill_job",
        "fault.max_restarts=0",  # this test resumes by hand
    )
    assert _launch(crashed, resume=True) != 0
    newest, _ = store.resolve(crashed.run_dir)
    assert newest.step == 3, f"expected step_3 to be the newest complete checkpoint: {newest}"

    # Launch 3: resumed from step_3 on a third stage count, to the end.
    finish = _config(tmp_path, case, "chain", f"pipeline.num_stages={third}")
    assert _launch(finish, resume=True) == 0
    got = read_result(finish.run_dir)

    assert got["losses"] == want["losses"], "per-step losses differ from the uninterrupted run"
    num_layers = reference.model.num_layers
    got_layers = _final_layers(finish.run_dir, num_layers)
    want_layers = _final_layers(reference.run_dir, num_layers)
    for index, (g, w) in enumerate(zip(got_layers, want_layers, strict=True)):
        assert_bitwise_equal(g["module"], w["module"], f"layer {index} weights")
        assert_bitwise_equal(g["optimizer"], w["optimizer"], f"layer {index} AdamW state")

    # One run log across the three launches: two restarts, one authoritative row per step.
    run = load(finish.run_dir / "run.h5")
    assert run.steps["step"].tolist() == list(range(NUM_STEPS))
    assert run.steps["loss"].tolist() == want["losses"]
    assert run.steps["segment"].tolist() == [0, 0, 1, 2, 2, 2, 2, 2]
    restarts = run.restarts
    assert restarts["checkpoint_step"].tolist() == [2, 3]
    assert restarts["num_stages"].tolist() == [second, third]
    assert (restarts["restore_s"] > 0).all()
    redone = run.superseded["steps"]
    # Step 3's rows were flushed at its load report; step 4's only if a timed flush came first.
    assert redone["step"].tolist() in ([3], [3, 4]) and set(redone["segment"]) == {1}
    assert run.end_status == "ok"
    assert "preempt" in run.events["kind"].tolist()
    if reference.train.eval_interval:  # validation passes: one authoritative row each, bitwise
        want_eval = load(reference.run_dir / "run.h5").eval
        assert run.eval["step"].tolist() == want_eval["step"].tolist() == [2, 5, 7]
        assert run.eval["loss"].tolist() == want_eval["loss"].tolist()


# --- the resume rules, end to end (docs/checkpoints.md, "Resume rules") -----------------------


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_rules_keep_history_and_apply_allowed_changes(tmp_path):
    """Reproductions: resuming step_4 with train.steps=2 rewrote step_2 with step-4 weights and
    left a result of 2 steps with 4 losses; a changed weight decay / beta2 never reached AdamW.
    Now the first is refused (by the launcher, and by the ranks if launched directly) and the
    second applies with --allow-change, logged as a config_change event."""
    from dynmo_hpc.errors import CheckpointError
    from dynmo_hpc.model.optim import lr_at
    from tests.helpers.jobs import tiny_config

    base = ("checkpoint.every_steps=2", "checkpoint.keep=5", "checkpoint.at_end=true")
    cfg = tiny_config(tmp_path, *base)
    assert launch_local(cfg, timeout_s=240)[0] == 0
    root = cfg.run_dir / "checkpoint"
    step_2, step_4 = root / "step_2", root / "step_4"
    before = _files(step_2)
    result_before = (cfg.run_dir / "result.json").read_text()

    shorter = tiny_config(tmp_path, *base, "train.steps=2", "fault.max_restarts=0")
    with pytest.raises(CheckpointError, match=r"train\.steps=2 is below the checkpoint's step 4"):
        resolve_resume(shorter, str(step_4), ["train.steps"])
    assert (cfg.run_dir / "result.json").read_text() == result_before
    rc, _ = launch_local(shorter, timeout_s=240, resume_from=step_4)  # past the launcher
    assert rc != 0
    assert _files(step_2) == before, "step_2 was rewritten"
    result_path = cfg.run_dir / "result.json"  # the launch clears it; no 2-step result appears
    assert not result_path.exists() or result_path.read_text() == result_before

    changes = ("train.lr=3e-3", "train.weight_decay=0.01", "train.beta2=0.99")
    changed = tiny_config(tmp_path, *base, "train.steps=6", *changes)
    with pytest.raises(CheckpointError, match=r"train\.lr 0\.001 -> 0\.003"):
        resolve_resume(changed, "")
    allowed = ["train.lr", "train.weight_decay", "train.beta2"]
    assert resolve_resume(changed, "", allowed) == step_4
    assert launch_local(changed, timeout_s=240, resume_from=step_4)[0] == 0

    result = read_result(cfg.run_dir)
    assert result["completed_steps"] == 6 and len(result["losses"]) == 6
    for index in range(cfg.model.num_layers):
        groups = store.load_layer(root / "step_6", index)["optimizer"]["param_groups"]
        assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
        assert tuple(groups[0]["betas"]) == (0.9, 0.99)
    run_log = load(cfg.run_dir / "run.h5")
    events = [r["detail"] for _, r in run_log.events.iterrows() if r["kind"] == "config_change"]
    assert len(events) == 1
    logged = {c["key"]: (c["saved"], c["new"], c["rule"]) for c in events[0]["changes"]}
    assert logged == {
        "train.lr": (1e-3, 3e-3, "math"),
        "train.weight_decay": (0.1, 0.01, "math"),
        "train.beta2": (0.95, 0.99, "math"),
        "train.steps": (4, 6, "steps"),
    }
    lrs = dict(zip(run_log.steps["step"], run_log.steps["lr"], strict=True))
    assert lrs[5] == pytest.approx(lr_at(5, changed.train))


if __name__ == "__main__":
    rank_program.train_all(runs(Path(sys.argv[1])))
