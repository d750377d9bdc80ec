"""SLURM submission without a cluster: the slurm: section, sweeps, resource checks, the CLI.

The scheduler is faked by patching ``dynmo_hpc.slurm.scheduler.run_command``, the one function
that runs sinfo, sbatch, squeue, sacct and scontrol. submitit's own sbatch text is rendered with
its pure ``_make_sbatch_string``. Real jobs are in tests/test_slurm_jobs.py.

Regenerate the golden script after an intended change with
``DYNMO_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_slurm_submit.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from dynmo_hpc import config as config_mod
from dynmo_hpc.cli import main
from dynmo_hpc.config import ConfigError
from dynmo_hpc.errors import CheckpointError, LaunchError
from dynmo_hpc.slurm import render_sbatch, scheduler
from dynmo_hpc.slurm import submit as submit_mod
from dynmo_hpc.slurm.scheduler import (
    PartitionInfo,
    SubmitError,
    check_fits_cluster,
    parse_sinfo,
    submit_sbatch,
    wait_for_sbatch_job,
)
from dynmo_hpc.slurm.submit import (
    executor_parameters,
    load_job,
    parse_sweep,
    resolve_for_cluster,
    sbatch_parameters_for,
    submitit_python,
    sweep_configs,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JOB = ROOT / "jobs" / "default.yaml"
GOLDEN = Path(__file__).parent / "golden" / "default_job.sbatch"

# What this test cluster's sinfo prints (scripts/slurm_cluster.sh).
SINFO = "shared*|4|2|4000|(null)\nexclusive|4|2|4000|(null)\n"


def cfg_with(*overrides: str) -> config_mod.JobConfig:
    return config_mod.load(DEFAULT_JOB, list(overrides))


FakeAnswer = tuple[int, str, str]


def fake_scheduler(
    monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[FakeAnswer] | FakeAnswer]
) -> list[list[str]]:
    """Answer each command by its program name (a list answers successive calls); log calls."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str], *, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        answer = answers.get(argv[0])
        if answer is None:
            raise AssertionError(f"unexpected command {argv}")
        if isinstance(answer, list):
            answer = answer.pop(0) if len(answer) > 1 else answer[0]
        rc, out, err = answer
        return subprocess.CompletedProcess(list(argv), rc, out, err)

    monkeypatch.setattr(scheduler, "run_command", run)
    return calls


# --- the slurm: section ------------------------------------------------------------------------


def test_slurm_defaults_one_node_per_stage() -> None:
    cfg = cfg_with("pipeline.num_stages=4")
    assert cfg.slurm.nodes is None
    assert cfg.slurm.num_nodes(cfg.pipeline.num_stages) == 4
    assert sbatch_parameters_for(cfg, Path("c.yaml"))["nodes"] == 4


def test_too_few_task_slots_shows_the_arithmetic() -> None:
    with pytest.raises(ConfigError) as info:
        cfg_with("pipeline.num_stages=4", "slurm.nodes=1", "slurm.tasks_per_node=2")
    message = str(info.value)
    assert "slurm.nodes(1) * slurm.tasks_per_node(2) = 2 < pipeline.num_stages(4)" in message
    assert "HINT:" in message
    assert cfg_with("pipeline.num_stages=4", "slurm.nodes=2", "slurm.tasks_per_node=2")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("slurm.nodes=0", r"slurm.nodes=0 must be >= 1"),
        ("slurm.time_min=1", r"slurm.signal_delay_s=120 is not less than time_min\*60=60"),
        ("slurm.launcher=mpiexec", r"slurm.launcher='mpiexec' is not valid; choose one of"),
        ("slurm.partition=a b", r"slurm.partition='a b' has characters"),
        ("slurm.nodez=4", r"unknown key 'slurm.nodez'; valid keys under 'slurm' are: nodes,"),
        ("slurm.mem_gb=-1", r"slurm.mem_gb=-1.0 must be a positive number"),
        ("slurm.extra_sbatch=[exclusive]", r"must be an sbatch flag"),
    ],
)
def test_impossible_slurm_settings(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg_with(override)


def test_venv_and_conda_together_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"both set.*HINT"):
        cfg_with("slurm.venv=/v", "slurm.conda_env=c")


def test_unknown_keyword_option_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_job(DEFAULT_JOB, slurm_options={"node": 4, "time": 5})
    message = str(info.value)
    assert "unknown SLURM option(s) node, time" in message
    assert "nodes=None" in message and "time_min=30" in message and "HINT" in message


def test_keyword_options_land_in_the_slurm_section() -> None:
    data, source = load_job(DEFAULT_JOB, ["train.steps=3"], {"nodes": 2, "partition": "gpu"})
    cfg = config_mod.from_dict(data, source)
    assert (cfg.train.steps, cfg.slurm.nodes, cfg.slurm.partition) == (3, 2, "gpu")


def test_resolve_makes_paths_absolute_and_fills_the_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = resolve_for_cluster(cfg_with("job.out_dir=runs"))
    assert cfg.job.out_dir == str(tmp_path / "runs")
    if sys.prefix != sys.base_prefix:
        assert cfg.slurm.venv == sys.prefix
    conda = resolve_for_cluster(cfg_with("slurm.conda_env=dynmo"))
    assert conda.slurm.venv is None


# --- sweeps ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "values"),
    [
        ("train.lr=1e-3,3e-3", "train.lr", [0.001, 0.003]),
        ("train.steps=10, 20", "train.steps", [10, 20]),
        ("pipeline.schedule=1f1b,gpipe", "pipeline.schedule", ["1f1b", "gpipe"]),
        ("pipeline.partition=[0,3,10],[0,5,10]", "pipeline.partition", [[0, 3, 10], [0, 5, 10]]),
        ("checkpoint.at_end=true,false", "checkpoint.at_end", [True, False]),
    ],
)
def test_parse_sweep(text: str, key: str, values: list[Any]) -> None:
    assert parse_sweep(text) == (key, values)


@pytest.mark.parametrize(
    "text", ["train.lr", "lr=1,2", "train.lr=", "train.lr=[1,", "train.lr=1,1"]
)
def test_parse_sweep_errors(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--sweep.*HINT") as info:
        parse_sweep(text)
    assert "\n" not in str(info.value)  # the CLI prints it as one error: line


def test_sweep_gives_each_point_its_own_name_and_value() -> None:
    data, source = load_job(DEFAULT_JOB)
    configs = sweep_configs(data, {"train.lr": [1e-3, 3e-3]}, source)
    assert [c.job.name for c in configs] == ["default-0-lr0.001", "default-1-lr0.003"]
    assert [c.train.lr for c in configs] == [1e-3, 3e-3]
    assert len({c.run_dir for c in configs}) == 2


def test_sweep_over_two_keys_is_their_product() -> None:
    data, source = load_job(DEFAULT_JOB)
    configs = sweep_configs(
        data, {"train.lr": [1e-3, 2e-3], "pipeline.schedule": ["1f1b", "gpipe"]}, source
    )
    assert [(c.train.lr, c.pipeline.schedule) for c in configs] == [
        (1e-3, "1f1b"),
        (1e-3, "gpipe"),
        (2e-3, "1f1b"),
        (2e-3, "gpipe"),
    ]
    assert configs[3].job.name == "default-3-lr0.002-schedulegpipe"


def test_an_invalid_sweep_point_names_itself() -> None:
    data, source = load_job(DEFAULT_JOB)
    with pytest.raises(ConfigError, match=r"sweep train.steps=0.*train.steps=0 must be >= 1"):
        sweep_configs(data, {"train.steps": [5, 0]}, source)
    with pytest.raises(ConfigError, match=r"job\.name cannot be swept"):
        sweep_configs(data, {"job.name": ["a", "b"]}, source)


def test_sweep_that_changes_the_allocation_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = fake_scheduler(monkeypatch, {})
    with pytest.raises(ConfigError, match=r"changes the allocation \(nodes\).*HINT"):
        submit_mod.submit(
            DEFAULT_JOB,
            overrides=[f"job.out_dir={tmp_path}"],
            sweep={"pipeline.num_stages": [2, 4]},
        )
    assert calls == []  # refused before the cluster was asked
    assert not any(tmp_path.iterdir())


# --- submitit's script ---------------------------------------------------------------------------


def test_executor_runs_the_manager_once_with_the_template_allocation(tmp_path: Path) -> None:
    cfg = cfg_with(
        "pipeline.num_stages=4",
        "slurm.venv=/opt/venvs/dynmo",
        "slurm.mem_gb=1.5",
        "slurm.partition=gpu",
        "slurm.gpus_per_node=2",
        "slurm.modules=[cuda/12.4]",
        "slurm.extra_sbatch=[--exclusive, --constraint=a100]",
    )
    params = executor_parameters(cfg)
    assert params["use_srun"] is False
    # The job's Python replaces the batch shell, so --signal=B:USR2 reaches it (the manager).
    assert submitit_python(cfg.slurm) == "exec python"
    text = _make_sbatch_string(
        command="python -u -m submitit.core._submit F", folder=tmp_path, **params
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --mem=1536M",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=B:USR2@120",
        "#SBATCH --exclusive",
        "#SBATCH --constraint=a100",
        "module load cuda/12.4",
        "source /opt/venvs/dynmo/bin/activate",
    ):
        assert line + "\n" in text, line
    assert "srun" not in text  # the manager itself starts the MPI step
    # The same allocation as the rendered sbatch script.
    rendered = render_sbatch(**sbatch_parameters_for(cfg, Path("c.yaml")))
    for line in ("--nodes=4", "--gpus-per-node=2", "--mem=1536M", "--signal=B:USR2@120"):
        assert f"#SBATCH {line}\n" in rendered


def test_short_extra_flags_are_refused_for_submitit() -> None:
    with pytest.raises(ConfigError, match="long flags only"):
        executor_parameters(cfg_with("slurm.extra_sbatch=[-C a100]"))


# --- does the request fit the cluster ------------------------------------------------------------


def test_parse_sinfo() -> None:
    rows = parse_sinfo(SINFO + "gpu|2|64|512000+|gpu:a100:4(S:0-1)\n")
    assert rows[0] == PartitionInfo("shared", True, 4, 2, 4000, 0)
    assert rows[2] == PartitionInfo("gpu", False, 2, 64, 512000, 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["slurm.partition=nope"],
            r"'nope' is not a partition.*valid: exclusive, shared \(default\)",
        ),
        (
            ["pipeline.num_stages=5", "model.num_blocks=4"],
            r"needs 5 node\(s\).*only 4 node\(s\) fit",
        ),
        (["slurm.cpus_per_task=3"], r"slurm.cpus_per_task\(3\) = 3 CPUs"),
        (["slurm.mem_gb=8"], r"8192 MB \(slurm.mem_gb=8.0\).*4000 MB"),
        (["slurm.gpus_per_node=1"], r"1 GPUs, but only 0 node\(s\) fit"),
    ],
)
def test_requests_the_cluster_cannot_run(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_fits_cluster(cfg_with(*overrides), parse_sinfo(SINFO))


def test_requests_that_fit() -> None:
    check_fits_cluster(cfg_with("pipeline.num_stages=4"), parse_sinfo(SINFO))
    check_fits_cluster(cfg_with("slurm.partition=exclusive", "slurm.mem_gb=3"), parse_sinfo(SINFO))
    mixed = parse_sinfo("gpu|2|8|1000|gpu:2\ngpu|2|8|1000|(null)\n")
    check_fits_cluster(cfg_with("slurm.partition=gpu", "slurm.gpus_per_node=2"), mixed)
    with pytest.raises(ConfigError, match=r"only 2 node\(s\) fit"):
        check_fits_cluster(
            cfg_with("slurm.partition=gpu", "slurm.gpus_per_node=2", "pipeline.num_stages=3"),
            mixed,
        )


# --- sbatch job ids and states (faked scheduler) -----------------------------------------------


def test_submit_sbatch_and_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scheduler(monkeypatch, {"sbatch": (0, "123;cluster\n", "")})
    assert submit_sbatch(Path("/x/job.sbatch")) == 123
    fake_scheduler(monkeypatch, {"sbatch": (1, "", "sbatch: error: invalid partition")})
    with pytest.raises(SubmitError, match=r"invalid partition.*HINT"):
        submit_sbatch(Path("/x/job.sbatch"))


def test_wait_polls_squeue_then_sacct(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_scheduler(
        monkeypatch,
        {
            "squeue": [(0, "RUNNING\n", ""), (0, "", "")],
            "sacct": [(0, "RUNNING\n", ""), (0, "CANCELLED by 0\n", "")],
        },
    )
    assert wait_for_sbatch_job(7, poll_s=0) == "CANCELLED by 0"
    assert [c[0] for c in calls] == ["squeue", "squeue", "sacct", "squeue", "sacct"]


def test_wait_without_accounting_asks_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scheduler(
        monkeypatch,
        {
            "squeue": (0, "", ""),
            "sacct": (1, "", "Slurm accounting storage is disabled"),
            "scontrol": (0, "JobId=7 JobName=x JobState=FAILED Reason=NonZeroExitCode\n", ""),
        },
    )
    assert wait_for_sbatch_job(7, poll_s=0) == "FAILED"


# --- the CLI -------------------------------------------------------------------------------------


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_sbatch_prints_the_script_of_the_default_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Golden file: ``dynmo-hpc sbatch jobs/default.yaml``, paths normalised."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(
        ["sbatch", str(DEFAULT_JOB), "--set", "slurm.venv=/opt/venvs/dynmo"], capsys
    )
    assert rc == 0, err
    assert f"wrote {tmp_path}/runs/default/config.yaml" in err
    assert (tmp_path / "runs" / "default" / "config.yaml").is_file()
    text = out.replace(str(tmp_path), "<TMP>")
    if os.environ.get("DYNMO_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "the rendered script differs from tests/golden/default_job.sbatch; if intended, "
        "regenerate with DYNMO_REGEN_GOLDEN=1 and review the diff"
    )


BAD_NODES = ["--set", "pipeline.num_stages=4", "--set", "slurm.nodes=2"]
GPU = ["--set", "slurm.partition=gpu"]


@pytest.mark.parametrize("command", ["submit", "sbatch"])
def test_invalid_config_is_one_error_line_and_nothing_is_submitted(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = fake_scheduler(monkeypatch, {})
    extra = ["--submit"] if command == "sbatch" else []
    rc, out, err = run_cli(
        [command, str(DEFAULT_JOB), *extra, "--set", f"job.out_dir={tmp_path}", *BAD_NODES],
        capsys,
    )
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "slurm.nodes(2) * slurm.tasks_per_node(1) = 2 < pipeline.num_stages(4)" in err
    assert calls == []
    assert not any(tmp_path.iterdir())


def test_impossible_request_is_refused_before_sbatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_scheduler(monkeypatch, {"sinfo": (0, SINFO, "")})
    rc, _, err = run_cli(
        ["sbatch", str(DEFAULT_JOB), "--submit", "--set", f"job.out_dir={tmp_path}", *GPU],
        capsys,
    )
    assert rc == 2
    assert "error: slurm.partition='gpu' is not a partition" in err
    assert [c[0] for c in calls] == ["sinfo"]


def test_sbatch_submit_wait_reports_a_failed_job_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_scheduler(
        monkeypatch,
        {
            "sinfo": (0, SINFO, ""),
            "sbatch": (0, "41\n", ""),
            "squeue": (0, "", ""),
            "sacct": (0, "FAILED\n", ""),
        },
    )
    rc, out, err = run_cli(
        ["sbatch", str(DEFAULT_JOB), "--submit", "--wait", "--set", f"job.out_dir={tmp_path}"],
        capsys,
    )
    run_dir = tmp_path / "default"
    assert rc == 1
    assert f"submitted job 41: 'default' on 2 node(s); log {run_dir}/default-41.out" in out
    assert "error: job 41 FAILED" in err
    assert f"log {run_dir}/default-41.out (stderr {run_dir}/default-41.err)" in err
    assert (run_dir / "job.sbatch").is_file() and (run_dir / "config.yaml").is_file()


def test_wait_needs_submit(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["sbatch", str(DEFAULT_JOB), "--wait"], capsys)
    assert rc == 2 and "--wait needs --submit" in err


def test_python_api_is_reexported() -> None:
    import dynmo_hpc

    assert callable(dynmo_hpc.submit)
    submit_fn: Callable[..., Any] = submit_mod.submit
    assert submit_fn.__name__ == "submit"


def test_sweep_values_are_read_like_job_files() -> None:
    """No base-60 numbers (1:00:00 stays the SLURM time it means) and no aliases."""
    assert parse_sweep("slurm.time_min=1:00:00,2-00") == ("slurm.time_min", ["1:00:00", "2-00"])
    with pytest.raises(ConfigError, match=r"aliases .* are not allowed.*HINT") as info:
        parse_sweep("train.steps=&a 1,*a")
    assert "\n" not in str(info.value)


# --- --resume: continuing a run on the cluster (docs/checkpoints.md, "Resume rules") -----------


def _tiny_sets(tmp_path: Path, *more: str) -> list[str]:
    from tests.helpers.jobs import TINY

    return [a for o in [*TINY, f"job.out_dir={tmp_path}", *more] for a in ("--set", o)]


def test_sbatch_submit_resume_passes_the_checkpoint_to_the_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.fake_checkpoint import write_fake_checkpoint
    from tests.helpers.jobs import tiny_config

    cfg = tiny_config(tmp_path, "train.steps=6")
    step_4 = write_fake_checkpoint(cfg, 4)
    calls = fake_scheduler(monkeypatch, {"sinfo": (0, SINFO, ""), "sbatch": (0, "51\n", "")})
    sets = _tiny_sets(tmp_path, "train.steps=8")
    rc, _, err = run_cli(["sbatch", str(DEFAULT_JOB), "--submit", *sets], capsys)
    assert rc == 2 and "add --resume" in err  # the refusal names the flag that now exists
    rc, out, err = run_cli(["sbatch", str(DEFAULT_JOB), "--submit", "--resume", *sets], capsys)
    assert rc == 0, err
    assert f"resuming from {step_4} (after step 4 of 8" in out
    script = (cfg.run_dir / "job.sbatch").read_text()
    assert script.rstrip().endswith(f"--resume {step_4.resolve()}")
    assert [c[0] for c in calls] == ["sinfo", "sinfo", "sbatch"]


def test_sbatch_resume_with_a_changed_lr_is_refused_before_sbatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.fake_checkpoint import write_fake_checkpoint
    from tests.helpers.jobs import tiny_config

    write_fake_checkpoint(tiny_config(tmp_path), 2)
    calls = fake_scheduler(monkeypatch, {"sinfo": (0, SINFO, ""), "sbatch": (0, "52\n", "")})
    sets = _tiny_sets(tmp_path, "train.lr=3e-3")
    rc, out, err = run_cli(["sbatch", str(DEFAULT_JOB), "--submit", "--resume", *sets], capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "train.lr 0.001 -> 0.003" in err and "--allow-change train.lr" in err
    assert "sbatch" not in [c[0] for c in calls]
    argv = ["sbatch", str(DEFAULT_JOB), "--submit", "--resume", "--allow-change", "train.lr"]
    rc, out, err = run_cli([*argv, *sets], capsys)
    assert rc == 0, err
    assert "accepted change (--allow-change): train.lr 0.001 -> 0.003" in out


def test_sbatch_printed_with_resume_keeps_stdout_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.fake_checkpoint import write_fake_checkpoint
    from tests.helpers.jobs import tiny_config

    step_2 = write_fake_checkpoint(tiny_config(tmp_path), 2)
    rc, out, err = run_cli(
        ["sbatch", str(DEFAULT_JOB), "--resume", str(step_2), *_tiny_sets(tmp_path)], capsys
    )
    assert rc == 0, err
    assert out.startswith("#!/bin/bash\n") and out.rstrip().endswith(f"--resume {step_2}")
    assert f"resuming from {step_2}" in err


class _FakeJob:
    job_id = "77"


class _FakeExecutor:
    folder = Path("/nonexistent")

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def submit(self, fn: Any, *args: Any) -> _FakeJob:
        self.calls.append(args)
        return _FakeJob()


def test_submit_resume_hands_the_checkpoint_to_the_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers.fake_checkpoint import write_fake_checkpoint
    from tests.helpers.jobs import TINY, tiny_config

    step_4 = write_fake_checkpoint(tiny_config(tmp_path, "train.steps=6"), 4)
    fake_scheduler(monkeypatch, {"sinfo": (0, SINFO, "")})
    executor = _FakeExecutor()
    monkeypatch.setattr(submit_mod, "make_executor", lambda *a, **k: executor)
    overrides = [*TINY, f"job.out_dir={tmp_path}", "train.steps=6"]
    with pytest.raises(LaunchError, match="already holds a run"):
        submit_mod.submit(DEFAULT_JOB, overrides=overrides)
    with pytest.raises(CheckpointError, match=r"train\.steps=2 is below the checkpoint's step 4"):
        submit_mod.submit(DEFAULT_JOB, overrides=[*overrides, "train.steps=2"], resume=True)
    with pytest.raises(ConfigError, match="resume does not take a sweep"):
        submit_mod.submit(DEFAULT_JOB, overrides=overrides, resume=True, sweep={"train.lr": [1]})
    submit_mod.submit(DEFAULT_JOB, overrides=overrides, resume=True)
    config_path, _, _, resume_flag, resume_path = executor.calls[-1]
    assert resume_flag is None and resume_path == str(step_4.resolve())
    assert config_path == str(tmp_path / "default" / "config.yaml")


def test_manager_takes_resume_for_its_first_run_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynmo_hpc.slurm import manager
    from tests.helpers.fake_checkpoint import write_fake_checkpoint
    from tests.helpers.jobs import tiny_config

    cfg = tiny_config(tmp_path)
    step_2 = write_fake_checkpoint(cfg, 2)
    step_3 = write_fake_checkpoint(cfg, 3)
    seen: list[tuple[Any, ...]] = []
    done = SimpleNamespace(interrupted=0, exit_code=0)
    monkeypatch.setattr(manager, "run_manager", lambda *a, **k: seen.append((a, k)) or done)
    assert manager.main(["c.yaml", "--resume", str(step_2), "train.lr=0.002"]) == 0
    assert seen == [(("c.yaml", ["train.lr=0.002"]), {"resume_path": str(step_2)})]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert manager._starting_checkpoint(cfg.run_dir, None, 1, step_2) == (True, step_2)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: it has written newer ones
    assert manager._starting_checkpoint(cfg.run_dir, None, 1, step_2) == (True, step_3)


def test_failed_requeue_names_the_command_that_continues_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dynmo_hpc.slurm import manager

    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Requested operation is presently disabled' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with caplog.at_level("ERROR", logger="dynmo_hpc"):
        assert manager.requeue(12, "runs/my job/config.yaml") is False
    assert "presently disabled" in caplog.text
    assert "dynmo-hpc sbatch 'runs/my job/config.yaml' --submit --resume" in caplog.text


GPU_GOLDEN = Path(__file__).parent / "golden" / "gpu_job.sbatch"


def test_the_gpu_job_renders_its_gpu_request_and_nccl_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Golden file: ``dynmo-hpc sbatch jobs/gpu.yaml`` (no GPU needed to render): GPUs per
    node, one bound to each rank, the NCCL defaults, the MPI of the venv (Open MPI here)."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(
        ["sbatch", str(ROOT / "jobs" / "gpu.yaml"), "--set", "slurm.venv=/opt/venvs/dynmo"],
        capsys,
    )
    assert rc == 0, err
    for line in ("--gpus-per-node=4", "--gpu-bind=single:1", "SLURM_MPI_TYPE=pmix"):
        assert line in out, line
    assert 'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"' in out
    text = out.replace(str(tmp_path), "<TMP>")
    if os.environ.get("DYNMO_REGEN_GOLDEN") == "1":
        GPU_GOLDEN.write_text(text)
    assert text == GPU_GOLDEN.read_text(), "regenerate with DYNMO_REGEN_GOLDEN=1 and review"
    cfg = config_mod.load(ROOT / "jobs" / "gpu.yaml", [f"job.out_dir={tmp_path}"])
    params = executor_parameters(cfg)
    assert params["gpus_per_node"] == 4
    assert params["additional_parameters"]["gpu-bind"] == "single:1"
    one_per_task = config_mod.load(
        ROOT / "jobs" / "gpu.yaml", [f"job.out_dir={tmp_path}", "slurm.gpus_per_node=0"]
    )
    assert "#SBATCH --gpus-per-task=1\n" in render_sbatch(
        **sbatch_parameters_for(one_per_task, tmp_path / "c.yaml")
    )
