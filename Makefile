# cem_jax: `make train` runs the main job on the default corpus, `make test` runs the tests.
# Without an active virtual environment both create .venv and install the package into it:
# `make train` (and `make bench`) the runtime only, `make test`, `make test-all`, `make lint`
# and `make install` with the dev extras (pytest, ruff, and torch and transformers for the
# export tests: about 2 GB more). A stamp file in the environment remembers each install.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
ifdef VIRTUAL_ENV
  PYTHON := python
  ENV_DIR := $(VIRTUAL_ENV)
else
  PYTHON := $(VENV)/bin/python
  ENV_DIR := $(VENV)
endif
RUNTIME_STAMP := $(ENV_DIR)/.cem_jax-runtime
DEV_STAMP := $(ENV_DIR)/.cem_jax-dev
PYTEST_ARGS ?=
# Test processes (pytest-xdist): the tests are mostly single-threaded compiles, so 2 workers
# take ~0.6x the time of one on the 2-core development machine.
PYTEST_WORKERS ?= 2
TRAIN_CONFIG ?= configs/shakespeare_cem.yaml
# glibc gives each train step's large XLA buffers fresh pages from the OS (page faults took a
# quarter of the CPU time of the `make train` step); transparent huge pages for malloc cut that
# (about 1.2x the train step's tokens/s, benchmarks/train_step.py). Ignored off glibc.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
ARGS ?=

.PHONY: install train test test-all lint bench clean

define new_env
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x $(VENV)/bin/python ]; then $(PY) -m venv $(VENV); fi
	$(PYTHON) -m pip install --quiet --upgrade pip
endef

$(RUNTIME_STAMP): pyproject.toml
	$(new_env)
	$(PYTHON) -m pip install --quiet -e .
	@touch $@

# The dev install holds the runtime: it stamps both.
$(DEV_STAMP): pyproject.toml
	$(new_env)
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	@touch $@ $(RUNTIME_STAMP)

install: $(DEV_STAMP)

# Fetches the corpus on first use, trains, then prints validation perplexity, bits per byte and
# a sample. Overrides: make train ARGS="run.steps=20 optimizer.lr=3e-3".
train: $(RUNTIME_STAMP)
	$(ENV_DIR)/bin/cem-train --config $(TRAIN_CONFIG) $(ARGS)

test: $(DEV_STAMP)
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow and not service and not tpu_compile" $(PYTEST_ARGS)

test-all: $(DEV_STAMP)
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(PYTHON) -m ruff check cem_jax tests benchmarks

bench: $(RUNTIME_STAMP)
	for b in layers train_step loss data decode loop attention compilation_cache; do $(PYTHON) benchmarks/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
