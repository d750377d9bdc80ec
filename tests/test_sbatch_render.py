"""sbatch rendering: a golden file for the full script, plus the option checks.

Regenerate the golden file after an intended template change with
``DYNMO_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_render.py`` and review the diff.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dynmo_hpc.slurm import (
    SbatchOptionError,
    mpi_step_argv,
    render_sbatch,
    sbatch_parameters,
    slurm_mpi_env,
    validate_sbatch_options,
)
from dynmo_hpc.slurm.sbatch import template_text

GOLDEN = Path(__file__).parent / "golden" / "dynmo_job.sbatch"

# Every optional feature switched on, so the golden file shows each template branch but conda's.
GOLDEN_PARAMS: dict[str, Any] = {
    "job_name": "gpt-pp4",
    "config_path": "runs/gpt-pp4/config.yaml",
    "output_dir": "runs/gpt-pp4",
    "nodes": 4,
    "tasks_per_node": 2,
    "gpus_per_node": 2,
    "gpu_bind": "single:1",
    "nccl_defaults": True,
    "cpus_per_task": 4,
    "time_min": 90,
    "partition": "gpu",
    "account": "proj42",
    "qos": "normal",
    "mem_gb": 32,
    "signal_delay_s": 300,
    "venv": "/opt/envs/dynmo venv",
    "modules": ["gcc/12.2", "cuda/12.4"],
    "launcher": "srun",
    "mpi_loopback_only": True,
    "extra_sbatch": ["--exclusive", "--requeue"],
}

MINIMAL: dict[str, Any] = {"job_name": "j", "config_path": "c.yaml", "output_dir": "out"}


def test_golden_file() -> None:
    text = render_sbatch(**GOLDEN_PARAMS)
    if os.environ.get("DYNMO_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), f"{GOLDEN} missing; regenerate with DYNMO_REGEN_GOLDEN=1"
    assert text == GOLDEN.read_text(), (
        "rendered sbatch script differs from the golden file; if the change is intended, "
        "regenerate with DYNMO_REGEN_GOLDEN=1 and review the diff"
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_rendered_scripts_are_valid_bash(tmp_path: Path) -> None:
    for params in (GOLDEN_PARAMS, MINIMAL, {**MINIMAL, "conda_env": "my env"}):
        script = tmp_path / "job.sbatch"
        script.write_text(render_sbatch(**params))
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_minimal_script_leaves_optional_flags_out() -> None:
    text = render_sbatch(**MINIMAL)
    for flag in ("--gpus-per-node", "--mem", "--partition", "--account", "--qos", "module load"):
        assert flag not in text
    assert "activate" not in text
    assert "#SBATCH --time=30\n" in text
    assert "#SBATCH --signal=B:USR2@120\n" in text
    assert text.rstrip().endswith("exec python -m dynmo_hpc.slurm.manager c.yaml")
    # On a real cluster Open MPI must be free to pick its interconnect.
    assert "OMPI_MCA_btl" not in text
    assert "if_include" not in text


def test_mem_is_rendered_in_mb_rounded_up() -> None:
    assert "#SBATCH --mem=1536M\n" in render_sbatch(**MINIMAL, mem_gb=1.5)
    assert "#SBATCH --mem=1M\n" in render_sbatch(**MINIMAL, mem_gb=0.0001)


def test_conda_env_is_activated_and_quoted() -> None:
    text = render_sbatch(**MINIMAL, conda_env="my env")
    assert "eval \"$(conda shell.bash hook)\"\nconda activate 'my env'\n" in text


def test_launcher_env_matches_launch_module() -> None:
    """The script exports exactly what dynmo_hpc.slurm.step says the launch needs."""
    for launcher in ("auto", "srun", "mpirun"):
        text = render_sbatch(**MINIMAL, launcher=launcher, mpi_loopback_only=True)
        assert f"export DYNMO_MPI_LAUNCHER={launcher}\n" in text
        for name, value in slurm_mpi_env(launcher, loopback_only=True).items():
            assert f"export {name}={value}\n" in text
    assert "SLURM_MPI_TYPE" not in render_sbatch(**MINIMAL, launcher="mpirun")


def test_template_has_no_hard_coded_paths() -> None:
    template = template_text()
    for fragment in ("/work", "/home", "/opt", "/usr", ".venv", "/tmp", "/root"):
        assert fragment not in template


def test_keyword_defaults_are_the_valid_parameters() -> None:
    params = sbatch_parameters()
    signature = inspect.signature(render_sbatch).parameters
    assert list(params) == list(signature)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.values())
    assert params["time_min"] == 30
    assert params["signal_delay_s"] == 120
    assert params["job_name"] is inspect.Parameter.empty


def test_validate_fills_defaults_and_renders() -> None:
    params = validate_sbatch_options({**MINIMAL, "nodes": 2})
    assert params["nodes"] == 2
    assert params["tasks_per_node"] == 1
    assert render_sbatch(**params) == render_sbatch(**MINIMAL, nodes=2)


def test_unknown_option_lists_valid_ones() -> None:
    with pytest.raises(SbatchOptionError) as info:
        validate_sbatch_options({**MINIMAL, "timeout_min": 5, "node": 2})
    message = str(info.value)
    assert "unknown sbatch option(s): node, timeout_min" in message
    for name in sbatch_parameters():
        assert f"  - {name}" in message
    assert "time_min (default 30)" in message
    assert "job_name (required)" in message


def test_missing_required_option() -> None:
    with pytest.raises(SbatchOptionError, match="missing required sbatch option"):
        validate_sbatch_options({"job_name": "j"})


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"nodes": 0}, r"nodes=0 must be >= 1"),
        ({"nodes": 1.5}, r"nodes=1.5 must be an integer"),
        ({"nodes": True}, r"nodes=True must be an integer"),
        ({"tasks_per_node": 0}, r"tasks_per_node=0 must be >= 1"),
        ({"cpus_per_task": -1}, r"cpus_per_task=-1 must be >= 1"),
        ({"gpus_per_node": -1}, r"gpus_per_node=-1 must be >= 0"),
        ({"time_min": 0}, r"time_min=0 must be >= 1"),
        ({"time_min": 2, "signal_delay_s": 120}, r"signal_delay_s=120 is not less than"),
        ({"signal_delay_s": -5}, r"signal_delay_s=-5 must be >= 0"),
        ({"mem_gb": 0}, r"mem_gb=0 must be a positive"),
        ({"mem_gb": float("nan")}, r"mem_gb=nan must be a positive"),
        ({"venv": "/v", "conda_env": "c"}, r"both set; the job activates one environment"),
        ({"launcher": "mpiexec"}, r"launcher='mpiexec' must be one of auto, srun, mpirun"),
        ({"job_name": "my job"}, r"job_name='my job' has characters"),
        ({"job_name": ""}, r"job_name='' must be a non-empty string"),
        ({"partition": "a\nb"}, r"partition='a\\nb' has characters"),
        ({"modules": "gcc"}, r"modules='gcc' must be a list of strings"),
        ({"extra_sbatch": ["exclusive"]}, r"must be an sbatch flag"),
        ({"extra_sbatch": ["--x\n--y"]}, r"has an empty entry or a newline"),
        ({"mpi_loopback_only": "yes"}, r"mpi_loopback_only='yes' must be true or false"),
    ],
)
def test_impossible_options_are_explained(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(SbatchOptionError, match=message):
        validate_sbatch_options({**MINIMAL, **patch})
    with pytest.raises(SbatchOptionError, match=message):
        render_sbatch(**{**MINIMAL, **patch})


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(SbatchOptionError) as info:
        validate_sbatch_options({**MINIMAL, "nodes": 0, "time_min": 0})
    assert "nodes=0" in str(info.value)
    assert "time_min=0" in str(info.value)


# --- the MPI step command the manager runs -----------------------------------------------------


def test_mpi_step_argv_srun() -> None:
    argv = mpi_step_argv("auto", ["/v/bin/python", "w.py"])
    assert argv == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "/v/bin/python", "w.py"]


def test_mpi_step_argv_mpirun_uses_the_venvs() -> None:
    argv = mpi_step_argv("mpirun", ["/v/bin/python", "w.py"], num_tasks=8)
    assert argv == ["/v/bin/mpirun", "-n", "8", "/v/bin/python", "w.py"]
    assert mpi_step_argv("mpirun", ["python", "w.py"])[0] == "mpirun"


@pytest.mark.parametrize(
    ("launcher", "argv", "num_tasks"),
    [("ssh", ["p"], None), ("srun", [], None), ("srun", ["p"], 0)],
)
def test_mpi_step_argv_errors(launcher: str, argv: list[str], num_tasks: int | None) -> None:
    with pytest.raises(ValueError):
        mpi_step_argv(launcher, argv, num_tasks=num_tasks)


def test_resume_from_reaches_the_manager_quoted_and_only_when_given() -> None:
    plain = render_sbatch(**MINIMAL)
    assert plain.endswith("exec python -m dynmo_hpc.slurm.manager c.yaml\n")
    assert "--resume" not in plain
    text = render_sbatch(**MINIMAL, resume_from="/r/my run/checkpoint/step_4")
    assert text.endswith(
        "exec python -m dynmo_hpc.slurm.manager c.yaml --resume '/r/my run/checkpoint/step_4'\n"
    )
    assert text.count("exec ") == 1
    with pytest.raises(SbatchOptionError, match="resume_from"):
        render_sbatch(**MINIMAL, resume_from="")


def test_mpich_gets_no_open_mpi_variables_and_its_own_srun_plugin() -> None:
    """The exported variables and ``srun --mpi=`` follow the MPI implementation and
    ``slurm.mpi``: PMIx and Open MPI's workarounds only with Open MPI."""
    from dynmo_hpc.slurm.step import srun_mpi_plugin

    mpich = render_sbatch(**MINIMAL, launcher="srun", mpi_implementation="mpich")
    assert "SLURM_MPI_TYPE=pmi2" in mpich
    assert "OMPI_" not in mpich and "PMIX_" not in mpich
    looped = slurm_mpi_env("srun", loopback_only=True, implementation="mpich", mpi="cray_shasta")
    assert looped == {"SLURM_MPI_TYPE": "cray_shasta"}
    openmpi = slurm_mpi_env("srun", implementation="openmpi")
    assert openmpi["SLURM_MPI_TYPE"] == "pmix" and openmpi["PMIX_MCA_gds"] == "hash"
    assert "SLURM_MPI_TYPE" not in slurm_mpi_env("mpirun", implementation="mpich")
    assert mpi_step_argv("srun", ["py"], srun_mpi="pmi2")[:2] == ["srun", "--mpi=pmi2"]
    assert srun_mpi_plugin("none", "openmpi") == "none"
    with pytest.raises(SbatchOptionError, match="Open MPI 5 is not built with SLURM's PMI-2"):
        render_sbatch(**MINIMAL, mpi="pmi2", mpi_implementation="openmpi")
    with pytest.raises(SbatchOptionError, match="mpi='pmi3' must be one of auto, pmix"):
        render_sbatch(**MINIMAL, mpi="pmi3")
    with pytest.raises(SbatchOptionError, match="mpi_implementation='lam'"):
        render_sbatch(**MINIMAL, mpi_implementation="lam")


def test_gpus_are_asked_for_one_way_and_bound_one_per_rank() -> None:
    from dynmo_hpc.slurm.sbatch import gpu_request

    assert gpu_request("cuda", 4)["gpus_per_task"] == 0
    text = render_sbatch(**MINIMAL, **gpu_request("cuda", 0))
    assert "#SBATCH --gpus-per-task=1\n#SBATCH --gpu-bind=single:1\n" in text
    assert 'TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"' in text
    cpu = render_sbatch(**MINIMAL, **gpu_request("cpu", 0))
    assert "gpu" not in cpu and "NCCL" not in cpu
    with pytest.raises(SbatchOptionError, match="ask for GPUs one way"):
        render_sbatch(**MINIMAL, gpus_per_node=2, gpus_per_task=1)
