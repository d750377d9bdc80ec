# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOB ?= jobs/elastic.yaml
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
MPICH_VENV := .venv-mpich
MPICH_PY := $(MPICH_VENV)/bin/python
MPICH_STAMP := $(MPICH_VENV)/.installed
# The pure modules (no MPI, torch.distributed, subprocess or h5py): kept clean under mypy --strict.
TYPECHECK_PATHS := dynmo_hpc/balance dynmo_hpc/config dynmo_hpc/errors.py dynmo_hpc/atomic_io.py \
	dynmo_hpc/checkpoint/lineage.py dynmo_hpc/checkpoint/manifest.py \
	dynmo_hpc/version.py dynmo_hpc/pipeline/schedule.py dynmo_hpc/pipeline/costs.py \
	dynmo_hpc/train/rebalance.py dynmo_hpc/pipeline/topology.py dynmo_hpc/pipeline/waiting.py dynmo_hpc/slurm/sbatch.py dynmo_hpc/slurm/environment.py \
	dynmo_hpc/slurm/step.py dynmo_hpc/launch/rundir.py dynmo_hpc/runlog/schema.py \
	dynmo_hpc/launch/preflight.py dynmo_hpc/data/corpus.py dynmo_hpc/data/tokens.py dynmo_hpc/data/shards.py dynmo_hpc/data/text_files.py dynmo_hpc/data/prepare.py dynmo_hpc/data/source.py dynmo_hpc/data/cache.py dynmo_hpc/pipeline/evaluate.py dynmo_hpc/model/layer_call.py dynmo_hpc/model/tied.py dynmo_hpc/pipeline/tied_grads.py dynmo_hpc/runlog/precheck.py dynmo_hpc/runlog/torn_chunk.py \
	dynmo_hpc/isolation.py dynmo_hpc/launch/failure.py dynmo_hpc/launch/supervisor.py \
	dynmo_hpc/handoff dynmo_hpc/report_cycle.py dynmo_hpc/placement.py \
	dynmo_hpc/testing/fault_injection.py dynmo_hpc/sim/__init__.py dynmo_hpc/sim/orders.py \
	dynmo_hpc/sim/step.py dynmo_hpc/sim/shared_cores.py dynmo_hpc/sim/wakeup.py dynmo_hpc/sim/replay.py dynmo_hpc/sim/oversubscribed_cpu.py dynmo_hpc/sim/machine.py dynmo_hpc/sim/heldout.py dynmo_hpc/sim/cost_model.py dynmo_hpc/sim/cost_ops.py dynmo_hpc/sim/scale.py dynmo_hpc/sim/scale_limits.py dynmo_hpc/runlog/trajectory.py dynmo_hpc/bench/algorithms.py \
	dynmo_hpc/bench/measure.py dynmo_hpc/bench/summary.py dynmo_hpc/pipeline/migration/host_memory.py dynmo_hpc/train/capacity.py \
	dynmo_hpc/bench/ab.py dynmo_hpc/bench/ab_summary.py dynmo_hpc/bench/ceiling.py dynmo_hpc/train/ab_arms.py \
	dynmo_hpc/calibrate/short_runs.py dynmo_hpc/bench/scripts.py \
	dynmo_hpc/calibrate/cost_fit.py dynmo_hpc/calibrate/cost_measure.py

.PHONY: venv run test test-gpu test-fast lint typecheck format bench bench-env mpich-env slurm-up slurm-down clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

# --overwrite: the demo may be run again (a plain `dynmo-hpc run` refuses to replace a run).
run: $(STAMP)
	$(VENV)/bin/dynmo-hpc run $(JOB) --overwrite --report

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q -ra

# The CUDA tier alone (a normal `make test` includes it where torch sees a GPU).
test-gpu: $(STAMP)
	DYNMO_GPU_TIER=1 $(PY) -m pytest -q -ra -m gpu tests/test_gpu.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow and not slurm"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict $(TYPECHECK_PATHS)

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/bench_pipeline.py

# The peer-check env for benchmarks/peer_deepspeed.py: .venv plus DeepSpeed, kept apart so that
# .venv and `make test` never see DeepSpeed. It reuses .venv's packages (torch included) through a
# .pth file that adds .venv's site-packages after its own, so nothing is downloaded twice and it
# follows .venv; its own site-packages (DeepSpeed, its extra deps, this checkout's editable
# install) come first. .venv is made when it has no stamp, but never reinstalled from here (a
# prerequisite, even order-only, would reinstall it whenever requirements.txt is newer).
# --without-pip: pip and setuptools come from .venv too (Python 3.11's bundled setuptools 65
# would shadow them and cannot build DeepSpeed's wheel: no bdist_wheel).
# DS_BUILD_OPS=0: no CUDA/C++ ops are compiled; partition_balanced is pure Python.
# --no-build-isolation: DeepSpeed's setup.py then sees torch (via the .pth) instead of a bare
# build env. After moving the checkout, delete .venv-bench and run this again (absolute path).
bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): requirements-bench.txt
	@test -f $(STAMP) || $(MAKE) venv
	@test -x $(BENCH_PY) || $(PY) -m venv --without-pip $(BENCH_VENV)
	@main_site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	bench_site=$$($(BENCH_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	echo "import site; site.addsitedir('$$main_site')" > "$$bench_site/dynmo_main_env.pth"
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(BENCH_PY) -m pip install --quiet --no-build-isolation \
		-r requirements-bench.txt
	$(BENCH_PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	DS_ACCELERATOR=cpu $(BENCH_PY) -c 'from deepspeed.runtime.utils import partition_balanced'
	@touch $(BENCH_STAMP)

# The MPICH tier's env (tests/test_mpich.py): .venv plus the PyPI mpich wheel, kept apart so
# that .venv stays on Open MPI. As for bench-env, a .pth file adds .venv's site-packages after
# its own, so torch, mpi4py and this checkout's editable install come from .venv; only MPICH is
# installed here (about 3 s from the pip cache). How mpi4py picks the MPI: its binary wheel holds
# one extension per MPI ABI and dlopens the first libmpi.so, libmpi.so.12 (MPICH) or
# libmpi.so.40 (Open MPI) in the running environment's lib/ (sys.exec_prefix; MPI4PY_LIBMPI
# overrides the search), so under .venv-mpich/bin/python it loads .venv-mpich/lib's MPICH, and
# the local launcher takes the mpiexec (Hydra) beside that Python. The last line checks both.
mpich-env: $(MPICH_STAMP)

$(MPICH_STAMP): requirements-mpich.txt
	@test -f $(STAMP) || $(MAKE) venv
	@test -x $(MPICH_PY) || $(PYTHON) -m venv --without-pip $(MPICH_VENV)
	@main_site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	mpich_site=$$($(MPICH_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	echo "import site; site.addsitedir('$$main_site')" > "$$mpich_site/dynmo_main_env.pth"
	$(MPICH_PY) -m pip install --quiet -r requirements-mpich.txt
	$(MPICH_VENV)/bin/mpiexec -n 1 $(MPICH_PY) -c \
		'from mpi4py import MPI; assert MPI.Get_library_version().startswith("MPICH")'
	@touch $(MPICH_STAMP)

slurm-up: $(STAMP)
	bash scripts/slurm_cluster.sh up

slurm-down:
	bash scripts/slurm_cluster.sh down

clean:
	rm -rf runs .pytest_cache .ruff_cache
