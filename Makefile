# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOB ?= jobs/elastic.yaml
# The pure modules (no MPI, torch.distributed, subprocess or h5py): kept clean under mypy --strict.
TYPECHECK_PATHS := dynmo_hpc/balance dynmo_hpc/config dynmo_hpc/errors.py dynmo_hpc/atomic_io.py \
	dynmo_hpc/version.py dynmo_hpc/pipeline/schedule.py dynmo_hpc/pipeline/costs.py \
	dynmo_hpc/pipeline/rebalance.py dynmo_hpc/slurm/sbatch.py dynmo_hpc/slurm/environment.py \
	dynmo_hpc/slurm/step.py dynmo_hpc/launch/rundir.py dynmo_hpc/runlog/schema.py \
	dynmo_hpc/launch/preflight.py dynmo_hpc/pipeline/corpus.py dynmo_hpc/runlog/precheck.py \
	dynmo_hpc/isolation.py dynmo_hpc/launch/failure.py dynmo_hpc/launch/supervisor.py \
	dynmo_hpc/launch/rank_status.py dynmo_hpc/sim/__init__.py dynmo_hpc/sim/orders.py \
	dynmo_hpc/sim/step.py dynmo_hpc/sim/replay.py dynmo_hpc/bench/policies.py \
	dynmo_hpc/bench/measure.py dynmo_hpc/bench/summary.py

.PHONY: venv run test test-gpu test-fast lint typecheck format bench slurm-up slurm-down clean

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

slurm-up: $(STAMP)
	bash scripts/slurm_cluster.sh up

slurm-down:
	bash scripts/slurm_cluster.sh down

clean:
	rm -rf runs .pytest_cache .ruff_cache
