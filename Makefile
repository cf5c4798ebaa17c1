# spheroid: `make demo` and `make test` do all set-up on a fresh clone.
#
# TORCH is the torch requirement, installed before anything else so that no other requirement can
# pull a torch build of its own choosing. The default, torch==2.13.0, is a CPU build on this
# project's machines (pip finds it on local disk). Elsewhere, pass pip the index of the build you
# want through PIP_TORCH_FLAGS (for example `--index-url <PyTorch's CPU wheel index>`), or a CUDA
# build on a GPU machine: `make TORCH='torch==2.13.0' PIP_TORCH_FLAGS='--index-url <CUDA index>' test`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP_TORCH_FLAGS ?=
DATA ?= $(if $(wildcard ../shared/data/wikitext),../shared/data/wikitext,$(SPHEROID_DATA))
PY := $(VENV)/bin/python
SPHEROID := $(VENV)/bin/spheroid
# the demo: a swarm of five nodes on 127.0.0.1 (block 0 twice), a model small enough for 2 cores, all
# blocks at once (each reads the earlier blocks from their holders); beside it, with the same model
# flags, the reference one block deep (the best one worker could do alone)
DEMO_OUT ?= runs/demo
DEMO_MODEL ?= --steps 600 --d-model 64 --context 64 --batch 32 --layers-per-block 1 --lr 2e-3
DEMO_FLAGS ?= $(DEMO_MODEL) --every 20
STAMP := $(VENV)/.installed
# the tests in two processes, each file's tests in one (its module fixtures, such as a bench run, run
# once), files in the order tests/conftest.py gives them
PYTEST_FLAGS ?= -n 2 --dist loadfile --no-loadscope-reorder

export SPHEROID_DATA := $(DATA)

.PHONY: install test lint demo bench-ci bench-small bench-paper results clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m ruff check spheroid bench tests
	$(PY) -m pytest -q $(PYTEST_FLAGS)

lint: install
	$(PY) -m ruff check spheroid bench tests

demo: install
	$(SPHEROID) swarm --out $(DEMO_OUT) --replicas 2,1,1,1 -- $(DEMO_FLAGS)
	$(SPHEROID) train --reference --n-blocks 1 --out $(DEMO_OUT)/model $(DEMO_MODEL)
	$(SPHEROID) eval $(DEMO_OUT)/model --windows 64 --draws 4 | tee $(DEMO_OUT)/eval.txt
	$(SPHEROID) generate $(DEMO_OUT)/model --prompt " = Robert Boulter = " --bytes 160 --temperature 0.7
	@echo "checkpoint: $(DEMO_OUT)/model  metrics: $(DEMO_OUT)/metrics.json $(DEMO_OUT)/eval.txt  logs: $(DEMO_OUT)/nodes"

bench-ci: install
	$(PY) bench/quality.py --preset ci

bench-small: install
	$(PY) bench/quality.py --preset small

bench-paper: install
	$(PY) bench/quality.py --preset paper

# docs/results.md and the README's results table, from the result files in bench/results
# (tests/test_report.py fails while they differ)
results:
	$(PYTHON) bench/report.py

clean:
	rm -rf runs .pytest_cache
