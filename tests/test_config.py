"""Config errors name the key, the file and the fix; valid files load into frozen dataclasses."""

from __future__ import annotations

import dataclasses
import typing
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
    jobs = sorted((ROOT / "jobs").rglob("*.yaml"))
    assert {j.parent.name for j in jobs} == {"jobs", "natural", "stress"}
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
        ("pipeline:\n  schedule: zigzag\n", r"choose one of \['1f1b', '1f1b-slack', 'gpipe'\]"),
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


def test_unusable_job_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory; HINT: pass a YAML file"):
        config_mod.load(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot check the job file \(File name too long\)"):
        config_mod.load("j" * 5000)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("job:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 16\); HINT: save it as UTF-8"):
        config_mod.load(latin1)


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


DEFAULT_JOB = ROOT / "jobs" / "default.yaml"


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("job.seed=-1", r"job.seed=-1 must be in \[0, 4294967295\]; HINT: numpy and torch"),
        ("job.seed=4294967296", r"job.seed=4294967296 must be in \[0, 4294967295\]"),
        ("job.out_dir=''", r"job.out_dir='' is empty; HINT"),
        ("runtime.threads_per_rank=2147483648", r"threads_per_rank=2147483648 > 1024; HINT"),
        ("runtime.threads_per_rank=0", r"runtime.threads_per_rank=0 must be >= 1"),
        ("runtime.timeout_s=1e12", r"runtime.timeout_s=1000000000000.0 > 31536000.0; HINT"),
        ("runtime.timeout_s=0", r"runtime.timeout_s=0.0 must be > 0"),
        ("fault.inject_step=-1", r"fault.inject_step=-1 must be >= 0"),
        ("fault.inject_rank=-1", r"fault.inject_rank=-1 must be >= 0"),
        ("runtime.fail_at_step=2", r"runtime.fail_at_step'? was replaced by fault.inject_step"),
        ("runtime.fail_mode=sigterm", r"fail_mode'? was replaced by fault.inject_action"),
        ("runtime.mpi_launcher=''", r"runtime.mpi_launcher='' is empty; HINT"),
        ("balance.capacity_bytes=1", r"capacity_bytes=1 cannot hold layer .*HINT: .*in bytes"),
        ("balance.capacity_bytes=-5", r"balance.capacity_bytes=-5.0 must be > 0 or null"),
        ("balance.margin=1e9", r"balance.margin=1000000000.0 > 1000.0; HINT"),
        ("balance.smoothing=0", r"balance.smoothing=0.0 must be in \(0, 1\]"),
        ("model.num_blocks=1e30", r"model.num_blocks='1e30' must be an integer; HINT"),
        ("model.num_blocks=1.0e+30", r"model.num_blocks=1e\+30 must be an integer"),
        ("model.num_blocks=4.0", r"model.num_blocks=4.0 must be an integer"),
        ("model.num_blocks=" + "9" * 30, r"model.num_blocks=<an integer of 100 bits> does not fit"),
        ("model.num_blocks=0x" + "f" * 2000, r"<an integer of 8000 bits> does not fit in 64 bits"),
        ("model.num_blocks=" + "9" * 5000, r"a value cannot be read .*HINT"),
        ("model.d_model=2097152", r"model.d_model=2097152 > 1048576; HINT"),
        ("model.seq_len=0", r"model.seq_len=0 must be >= 1"),
        ("model.d_ff=-3", r"model.d_ff=-3 must be >= 1"),
        ("model.layer_d_ff=[1,1,1,1,1,1,1,0]", r"layer_d_ff entries must be in \[1, 1048576\]"),
        ("train.steps=10000000000", r"train.steps=10000000000 > 1000000000; HINT"),
        ("train.micro_batch_size=0", r"train.micro_batch_size=0 must be >= 1"),
        ("train.num_microbatches=2000000", r"train.num_microbatches=2000000 > 1048576"),
        ("train.lr=0", r"need 0 <= min_lr <= lr, lr > 0"),
        ("train.lr=5", r"train.lr=5.0 > 1.0; HINT"),
        ("train.min_lr=-1", r"need 0 <= min_lr <= lr"),
        ("train.weight_decay=-0.1", r"weight_decay=-0.1, grad_clip=1.0: all must be >= 0"),
        ("train.weight_decay=3", r"train.weight_decay=3.0 > 1.0; HINT"),
        ("train.grad_clip=-1", r"grad_clip=-1.0: all must be >= 0"),
        ("train.beta1=1", r"train.beta1=1.0, train.beta2=0.95 must be in \[0, 1\)"),
        ("train.beta2=-0.5", r"train.beta2=-0.5 must be in \[0, 1\)"),
        ("train.warmup_steps=-1", r"warmup_steps=-1"),
        ("train.lr=[0.1]", r"train.lr=\[0.1\] must be a number"),
        ("train.steps=[1, 2]", r"train.steps=\[1, 2\] must be an integer"),
        ("train.steps={a: 1}", r"train.steps=\{'a': 1\} must be an integer"),
        ("train.steps=true", r"train.steps=True must be an integer"),
        ("checkpoint.at_end='true'", r"checkpoint.at_end='true' must be true or false; HINT"),
        ("checkpoint.at_end=1", r"checkpoint.at_end=1 must be true or false"),
        ("checkpoint.keep=100000", r"checkpoint.keep=100000 > 1000; HINT"),
        ("checkpoint.every_minutes=-1", r"checkpoint.every_minutes=-1.0 must be a finite"),
        ("data.val_fraction=1", r"data.val_fraction=1.0 must be in \[0, 1\)"),
        ("data.val_fraction=-0.1", r"data.val_fraction=-0.1 must be in \[0, 1\)"),
        ("data.path=[a.txt]", r"data.path=\['a.txt'\] must be a string"),
        ('data.path="a\\0b"', r"data.path='a\\x00b' contains control characters"),
        ("data.path=" + "a" * 5000, r"cannot be checked \(File name too long\); HINT"),
        ("job.name=yes", r"job.name=True must be a string; HINT: quote it"),
        ("pipeline.num_stages=0", r"pipeline.num_stages=0 must be >= 1"),
        ("pipeline.num_stages=11", r"pipeline.num_stages\(11\) > model.num_blocks \+ 2 \(10\)"),
        ("schemes.moe={num_experts: 0}", r"need 1 <= top_k <= num_experts"),
        ("schemes.moe={num_experts: 100000, top_k: 1}", r"num_experts=100000 > 65536"),
        ("schemes.moe={capacity_factor: 0}", r"capacity_factor=0.0 must be > 0"),
        ("schemes.moe={capacity_factor: 1e9}", r"capacity_factor=1000000000.0 > 1000.0"),
        ("schemes.moe={aux_loss_weight: -1}", r"aux_loss_weight=-1.0 must be >= 0"),
        ("schemes.moe={aux_loss_weight: 1e6}", r"aux_loss_weight=1000000.0 > 100.0"),
        ("schemes.moe={d_ff_expert: 0}", r"d_ff_expert=0 must be >= 1 or null"),
        ("schemes.moe={d_ff_expert: 1e3}", r"schemes.moe.d_ff_expert='1e3' must be an integer"),
        ("schemes.moe={overflow: spill}", r"choose one of \['drop', 'reroute'\]"),
        ("schemes.moe={dispatch: pad}", r"choose one of \['gather', 'padded'\]"),
        ("schemes.early_exit={exit_loss_weight: .nan}", r"exit_loss_weight=nan must be a finite"),
        ("schemes.early_exit={exit_loss_weight: 1e9}", r"exit_loss_weight=1000000000.0 > 100.0"),
        ("schemes.early_exit={threshold: 1.5}", r"early_exit.threshold=1.5 must be in \[0, 1\]"),
        ("schemes.pruning={final_sparsity: 1.0}", r"need 0 <= initial <= final < 1"),
        ("schemes.pruning={initial_sparsity: -0.1}", r"need 0 <= initial <= final < 1"),
        ("schemes.mod={capacity: 0}", r"schemes.mod capacities \[0.0\] must be in \(0, 1\]"),
        ("schemes.mod={capacity: 1.5}", r"must be in \(0, 1\]"),
        ("schemes.mod={initial_capacity: 0}", r"capacities \[0.125, 0.0\] must be in \(0, 1\]"),
        ("schemes.mod={anneal_start_step: 9, anneal_end_step: 3}", r"need 0 <= anneal_start"),
        ("schemes.mod={anneal_end_step: 10000000000}", r"anneal_end_step=10000000000 > 1000000000"),
        ("schemes.sparse_attention={density: 2}", r"densities \[2.0\] must be in \(0, 1\]"),
        ("schemes.sparse_attention={drift_factor: -1}", r"need drift_factor > 0"),
        ("schemes.sparse_attention={initial_density: 1.5}", r"densities \[0.5, 1.5\] must be"),
        ("schemes.freezing={threshold: -1}", r"need threshold >= 0"),
        ("schemes.freezing={interval_steps: 0}", r"interval_steps >= 1"),
        ("schemes.moe=[1]", r"schemes.moe must be a mapping"),
        ("elastic.max_slowdown=-0.5", r"elastic.max_slowdown=-0.5 must be in \[0, 1\)"),
        ("elastic.restart_overhead_s=.inf", r"restart_overhead_s=inf must be a finite number"),
        ("elastic.enabled='no'", r"elastic.enabled='no' must be true or false"),
        ("train.bogus=1", r"unknown key 'train.bogus'"),
        ("schemes.moe={bogus: 1}", r"unknown key 'schemes.moe.bogus'"),
    ],
)
def test_out_of_range_numbers_are_one_line_config_errors(override, pattern):
    """Every number is bounded at load time: one line naming the key and value, with a HINT."""
    with pytest.raises(ConfigError, match=pattern) as info:
        config_mod.load(DEFAULT_JOB, [override])
    message = str(info.value)
    assert "\n" not in message and "HINT:" in message
    assert message.startswith(str(DEFAULT_JOB)) or message.startswith("--set")


NON_FINITE_OVERRIDES = [
    "train.lr=nan",
    "train.min_lr=nan",
    "train.weight_decay=.inf",
    "train.grad_clip=nan",
    "train.beta1=nan",
    "train.beta2=-.inf",
    "runtime.timeout_s=nan",
    "balance.margin=.inf",
    "balance.smoothing=nan",
    "balance.capacity_bytes=.inf",
    "pipeline.grad_bucket_mb=nan",
    "checkpoint.every_minutes=nan",
    "data.val_fraction=nan",
    "elastic.max_slowdown=nan",
    "elastic.restart_overhead_s=nan",
    "fault.stop_grace_s=nan",
    "fault.phase_timeout_s=.inf",
    "slurm.mem_gb=nan",
    "model.norm_eps=nan",
    "model.rope_theta=.inf",
    "schemes.moe={capacity_factor: .inf}",
    "schemes.moe={aux_loss_weight: nan}",
    "schemes.pruning={final_sparsity: nan}",
    "schemes.pruning={initial_sparsity: nan}",
    "schemes.freezing={threshold: nan}",
    "schemes.sparse_attention={density: nan}",
    "schemes.sparse_attention={drift_factor: .inf}",
    "schemes.sparse_attention={layer_density: [nan, 1, 1, 1, 1, 1, 1, 1]}",
    "schemes.sparse_attention={initial_density: nan}",
    "schemes.early_exit={threshold: nan}",
    "schemes.early_exit={exit_loss_weight: .inf}",
    "schemes.mod={capacity: nan}",
    "schemes.mod={layer_capacity: [nan, 1, 1, 1]}",
    "schemes.mod={initial_capacity: .inf}",
]
"""One NaN or infinity for every float key of every section (checked to be complete below)."""


@pytest.mark.parametrize("override", NON_FINITE_OVERRIDES)
def test_every_float_key_refuses_nan_and_inf(override):
    with pytest.raises(ConfigError, match=r"must be a finite number .*HINT"):
        config_mod.load(DEFAULT_JOB, [override])


def _float_keys(cls: type, prefix: str) -> set[str]:
    """Dotted names of the float fields under ``cls``, scheme sub-sections included."""
    keys = set()
    for name, hint in typing.get_type_hints(cls).items():
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        section = hint if dataclasses.is_dataclass(hint) else (inner[0] if inner else None)
        if section is not None:
            keys |= _float_keys(section, f"{prefix}{name}.")
        elif "float" in str(hint):
            keys.add(prefix + name)
    return keys


def test_every_float_key_is_in_the_non_finite_list():
    """A new float key must join NON_FINITE_OVERRIDES (and so be shown to refuse NaN)."""
    named = set()
    for override in NON_FINITE_OVERRIDES:
        key, value = override.split("=", 1)
        named.add(f"{key}.{value[1:].split(':')[0].strip()}" if value.startswith("{") else key)
    floats = _float_keys(config_mod.JobConfig, "")
    assert "schemes.moe.capacity_factor" in floats and "train.lr" in floats
    assert floats - named == set(), f"float keys without a NaN case: {floats - named}"


def test_sexagesimal_looking_scalars_stay_strings(tmp_path):
    """YAML 1.1 would read 1:00:00 as 3600 and 1:30 as 90; the job loader keeps them strings."""
    data = config_mod.load_yaml(write(tmp_path, "a:\n  b: 1:00:00\n  c: 1:30\n  d: 1:30.5\n"))
    assert data == {"a": {"b": "1:00:00", "c": "1:30", "d": "1:30.5"}}
    path, value = config_mod.parse_override("slurm.time_min=1:00:00")
    assert path == ["slurm", "time_min"] and value == "1:00:00"


@pytest.mark.parametrize(
    ("value", "minutes"),
    [
        ("45", 45),
        ("1:00:00", 60),
        ("90:30", 91),  # MM:SS, seconds round up
        ("0:30", 1),
        ("2-00", 2880),
        ("1-12:30", 2190),
        ("1-00:00:01", 1441),
        ("30", 30),
    ],
)
def test_slurm_time_min_takes_slurm_time_formats(tmp_path, value, minutes):
    cfg = config_mod.load(write(tmp_path, f"slurm:\n  time_min: {value}\n  signal_delay_s: 10\n"))
    assert cfg.slurm.time_minutes == minutes
    assert cfg.slurm.sbatch_options(2)["time_min"] == minutes
    path = tmp_path / "resolved.yaml"  # the resolved config keeps the text and loads again
    path.write_text(cfg.to_yaml())
    assert config_mod.load(path) == cfg


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("slurm.time_min=1:75", r"slurm.time_min='1:75': seconds 75 must be < 60; HINT"),
        ("slurm.time_min=1:60:00", r"minutes 60 must be < 60"),
        ("slurm.time_min=1-24", r"hours 24 must be < 24"),
        ("slurm.time_min=1h", r"slurm.time_min='1h' is not a SLURM time limit; HINT: write"),
        ("slurm.time_min=UNLIMITED", r"is not a SLURM time limit"),
        ("slurm.time_min=''", r"slurm.time_min='' is not a SLURM time limit"),
        ("slurm.time_min=0:00", r"slurm.time_min='0:00' is 0 minutes; it must be in \[1, 525600\]"),
        ("slurm.time_min=999-00", r"is 1438560 minutes; it must be in \[1, 525600\]"),
        ("slurm.time_min=0", r"slurm.time_min=0 must be >= 1"),
        ("slurm.time_min=10000000", r"slurm.time_min=10000000 must be <= 525600"),
        ("slurm.time_min=1.5", r"slurm.time_min=1.5 has the wrong type; expected int \| str"),
        ("slurm.nodes=0", r"slurm.nodes=0 must be >= 1"),
        ("slurm.nodes=1000000", r"slurm.nodes=1000000 must be <= 100000"),
        ("slurm.tasks_per_node=0", r"slurm.tasks_per_node=0 must be >= 1"),
        ("slurm.cpus_per_task=0", r"slurm.cpus_per_task=0 must be >= 1"),
        ("slurm.cpus_per_task=5000", r"slurm.cpus_per_task=5000 must be <= 1024"),
        ("slurm.gpus_per_node=-1", r"slurm.gpus_per_node=-1 must be >= 0"),
        ("slurm.gpus_per_node=65", r"slurm.gpus_per_node=65 must be <= 64"),
        ("slurm.signal_delay_s=-1", r"slurm.signal_delay_s=-1 must be >= 0"),
        ("slurm.signal_delay_s=1800", r"signal_delay_s=1800 is not less than time_min\*60=1800"),
        ("slurm.mem_gb=4G", r"slurm.mem_gb='4G' must be a number"),
        ("slurm.mem_gb=0", r"slurm.mem_gb=0.0 must be a positive number of GB"),
        ("slurm.mem_gb=1e9", r"mem_gb=1000000000.0 must be a positive number of GB up to 1e\+06"),
        ("slurm.partition='gpu; rm -rf /'", r"slurm.partition='gpu; rm -rf /' has characters"),
        ("slurm.partition='a b'", r"slurm.partition='a b' has characters sbatch cannot take"),
        ("slurm.partition=''", r"slurm.partition='' has characters .*or is empty"),
        ('slurm.account="x\\ny"', r"slurm.account='x\\ny' contains control characters"),
        ("slurm.qos='$(id)'", r"slurm.qos='\$\(id\)' has characters"),
        ('slurm.venv="/v\\n#SBATCH --x"', r"slurm.venv=.* contains control characters"),
        ("slurm.venv=''", r"slurm.venv='' must be a non-empty path"),
        ('slurm.conda_env="e\\rx"', r"slurm.conda_env=.* contains control characters"),
        (
            'slurm.modules=["cuda\\n#SBATCH --x"]',
            r"slurm.modules=.* has an empty entry or a newline",
        ),
        ('slurm.modules=["a\\tb"]', r"has an empty entry or a newline \(or another control"),
        ("slurm.modules=cuda", r"slurm.modules='cuda' must be a list of str"),
        ('slurm.extra_sbatch=["--x\\n--y"]', r"slurm.extra_sbatch=.* has an empty entry"),
        (
            "slurm.extra_sbatch=[exclusive]",
            r"extra_sbatch entry 'exclusive' must be an sbatch flag",
        ),
        ("slurm.launcher=ssh", r"choose one of \['auto', 'srun', 'mpirun'\]"),
        ("slurm.loopback_only=maybe", r"slurm.loopback_only='maybe' must be true or false"),
        ('job.out_dir="runs\\n#SBATCH --x"', r"job.out_dir=.* contains control characters"),
    ],
)
def test_bad_slurm_values_are_refused(override, pattern):
    """What sbatch would reject, and anything that could add a line to the script, is refused."""
    with pytest.raises(ConfigError, match=pattern) as info:
        config_mod.load(DEFAULT_JOB, [override])
    assert "\n" not in str(info.value) and "HINT:" in str(info.value)
