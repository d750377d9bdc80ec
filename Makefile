# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JOB ?= jobs/default.yaml

.PHONY: venv run test test-fast lint format bench slurm-up slurm-down clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dynmo-hpc run $(JOB) --report

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow and not slurm"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

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
