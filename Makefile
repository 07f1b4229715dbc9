# Set-up is part of every target: a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV ?= .venv
# A CPU build of torch, pinned so that installs stay small and fast; override with
#   make test TORCH_SPEC='torch==2.14.1'
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py ray_checkfreq/codec/_kernels.c Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,dali,report]" "$(TORCH_SPEC)"
	touch $(STAMP)

test: lint
	$(PY) -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check ray_checkfreq benchmarks tools tests examples
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) examples/ray_demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache ray_checkfreq/codec/*.so
