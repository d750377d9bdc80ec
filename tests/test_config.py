"""Config errors name the key, the file and the fix; valid files load into frozen dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dynmo_hpc import config as config_mod
from dynmo_hpc.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_every_shipped_job_loads():
    jobs = sorted((ROOT / "jobs").glob("*.yaml"))
    assert jobs
    for job in jobs:
        cfg = config_mod.load(job)
        assert cfg.model.num_layers >= cfg.pipeline.num_stages


def test_defaults_and_frozen():
    cfg = config_mod.from_dict({})
    assert cfg.pipeline.schedule == "1f1b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3  # type: ignore[misc]


def test_unknown_key_names_key_file_and_valid_keys(tmp_path):
    path = write(tmp_path, "train:\n  num_microbatch: 8\n")
    with pytest.raises(ConfigError) as info:
        config_mod.load(path)
    msg = str(info.value)
    assert str(path) in msg and "train.num_microbatch" in msg and "num_microbatches" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key .trian.*train"):
        config_mod.load(write(tmp_path, "trian: {}\n"))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("train:\n  steps: ten\n", r"train.steps='ten' must be an integer"),
        ("train:\n  lr: fast\n", r"train.lr='fast' must be a number"),
        ("checkpoint:\n  at_end: 3\n", r"must be true or false"),
        ("pipeline:\n  schedule: zigzag\n", r"choose one of \['1f1b', 'gpipe'\]"),
        ("train:\n  num_microbatches: 0\n", r"train.num_microbatches=0 must be >= 1"),
        ("model:\n  d_model: 100\n  num_heads: 3\n", r"d_model\(100\) % model.num_heads\(3\)"),
        (
            "model:\n  num_blocks: 2\npipeline:\n  num_stages: 5\n",
            r"pipeline.num_stages\(5\) > model.num_blocks \+ 2 \(4\)",
        ),
        ("pipeline:\n  num_stages: 2\n  partition: [0, 10, 10]\n", r"strictly increasing"),
        ("pipeline:\n  num_stages: 2\n  partition: [0, 3]\n", r"num_stages \+ 1 = 3 entries"),
        ("data:\n  path: /no/such/file.txt\n", r"data.path='/no/such/file.txt' is not a file"),
        ("elastic:\n  policy: fastest\n", r"choose one of \['throughput', 'node_hours'\]"),
        ("elastic:\n  max_slowdown: 1.5\n", r"elastic.max_slowdown=1.5 must be in \[0, 1\)"),
        ("elastic:\n  min_stages: 0\n", r"elastic.min_stages=0 must be >= 1"),
        ("elastic:\n  interval: 0\n", r"elastic.interval=0 must be >= 1"),
        ("elastic:\n  restart_overhead_s: -1\n", r"restart_overhead_s=-1.0 must be a finite"),
        (
            "elastic:\n  enabled: true\n  min_stages: 3\npipeline:\n  num_stages: 2\n",
            r"elastic.min_stages\(3\) > pipeline.num_stages\(2\)",
        ),
        ("checkpoint:\n  keep: 0\n", r"checkpoint.keep=0 must be >= 1"),
        ("checkpoint:\n  every_steps: -1\n", r"checkpoint.every_steps=-1 must be >= 0"),
        ("", r"the job file is empty; HINT"),
        ("# only a comment\n", r"the job file is empty"),
        ("train:\n  steps: 3\n  steps: 4\n", r"duplicate key 'steps'"),
        ("train: {}\ntrain: {}\n", r"duplicate key 'train'"),
        ("a: &a [1, 1]\nb: &b [*a, *a]\nc: [*b, *b]\n", r"aliases \(\*a\) are not allowed"),
        ("job:\n  name: ..\n", r"job.name='..' must be"),
        ("job:\n  name: .\n", r"job.name='.' must be"),
        ('job:\n  name: "a\\nb"\n', r"control characters"),
        ("model:\n  num_blocks: 1000000000\n", r"model.num_blocks=1000000000 > 100000"),
        ("model:\n  num_blocks: 1.0e+30\n", r"must be an integer"),
        ("- a\n- b\n", r"top level must be a mapping"),
        ("train: [\n", r"not valid YAML"),
    ],
)
def test_bad_values(tmp_path, text, pattern):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=pattern) as info:
        config_mod.load(path)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="job file not found"):
        config_mod.load("/no/such/job.yaml")


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, "train:\n  steps: 5\n")
    cfg = config_mod.load(path, ["train.steps=7", "pipeline.partition=[0, 4, 10]"])
    assert cfg.train.steps == 7 and cfg.pipeline.partition == [0, 4, 10]
    with pytest.raises(ConfigError, match=r"unknown key .train.stepz."):
        config_mod.load(path, ["train.stepz=7"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        config_mod.load(path, ["steps=7"])
    with pytest.raises(ConfigError, match="must be an integer"):
        config_mod.load(path, ["train.steps=many"])


def test_resolved_yaml_round_trips(tmp_path):
    cfg = config_mod.load(ROOT / "jobs" / "default.yaml", ["train.steps=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    assert config_mod.load(path) == cfg


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=nan",
        "train.lr=.nan",
        "train.weight_decay=inf",
        "train.grad_clip=-.inf",
        "runtime.timeout_s=1e400",
        "balance.margin=nan",
        "schemes.moe.capacity_factor=nan",
    ],
)
def test_non_finite_numbers_are_refused_at_load_time(override):
    with pytest.raises(ConfigError, match=r"must be a finite number"):
        config_mod.load(ROOT / "jobs" / "default.yaml", [override])
