# spheroid: `make demo` and `make test` do all set-up on a fresh clone.
#
# TORCH is the torch requirement pip installs before anything else. The default takes a CPU build
# (on the project's dev machines it lies on local disk); on a GPU machine use, for example,
#   make TORCH='torch==2.13.0' PIP_TORCH_FLAGS='--index-url https://download.pytorch.org/whl/cu128' install
# A bare `torch` requirement would pull a multi-GB CUDA build, so setup.cfg never installs it first.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP_TORCH_FLAGS ?=
DATA ?= $(if $(wildcard ../shared/data/wikitext),../shared/data/wikitext,$(SPHEROID_DATA))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export SPHEROID_DATA := $(DATA)

.PHONY: install test lint demo bench-ci bench-small bench-paper clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m ruff check spheroid bench tests
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check spheroid bench tests

demo: install
	$(PY) -m spheroid.demo --out runs/demo

bench-ci: install
	$(PY) bench/quality.py --preset ci

bench-small: install
	$(PY) bench/quality.py --preset small

bench-paper: install
	$(PY) bench/quality.py --preset paper

clean:
	rm -rf runs .pytest_cache
