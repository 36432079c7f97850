# The two commands of a fresh machine: `make demo` and `make test`.
# the Python that creates the venv (not exported: scripts use .venv/bin/python)
BASE_PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-gpu demo test test-e2e test-all lint clean

$(STAMP): setup.py constraints.txt
	@command -v $(BASE_PYTHON) >/dev/null || { echo "error: $(BASE_PYTHON) not found; install Python 3.11 or run 'make BASE_PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@test -x $(BIN)/python || $(BASE_PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (a few minutes; pip's output goes to $(VENV)/install.log)"
	@# the CPU build of torch first, so that nothing pulls the multi-GB CUDA build
	@{ $(BIN)/pip install --upgrade pip && \
	   $(BIN)/pip install torch==2.13.0 && \
	   $(BIN)/pip install -c constraints.txt -e '.[dev]'; } > $(VENV)/install.log 2>&1 || \
	 { tail -n 40 $(VENV)/install.log; echo "error: installing into $(VENV) failed (whole log: $(VENV)/install.log)"; exit 1; }
	@touch $(STAMP)

install: $(STAMP)

# The GPU stack, on a GPU node (Linux x86_64, an NVIDIA driver for CUDA 13): the CUDA build of torch from
# TORCH_INDEX, then this package with its dev, sglang and gpu extras. It resolves to SGLang's own pins (torch
# GPU_TORCH, transformers, tokenizers), so without constraints.txt, whose torch (CPU build), transformers and
# tokenizers are the CPU dev environment's (DEV_ONLY in rollout_sglang/testing/sglang_pins.py). SGLang goes into
# this interpreter, the trainer's: under Ray the engine actors run `python -m sglang.launch_server` with the
# driver's. Transformer Engine's PyTorch part is an sdist built against the installed torch, so without build
# isolation (it fetches a prebuilt binary or compiles with the CUDA toolkit). TORCH_INDEX is the index of torch's
# CUDA build: a mirror, or another CUDA 13.x build (`make install-gpu TORCH_INDEX=https://.../whl/cu13x`); not
# CUDA 12, SGLang 0.5.23's kernels (flashinfer, sglang-kernel) and torchvision from PyPI are CUDA 13 builds.
# Then `$(BIN)/agentrl doctor` checks the node. The CPU targets (test, lint, demo) then use this venv as it is
GPU_TORCH ?= 2.14.1
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
GPU_STAMP := $(VENV)/.installed-gpu

$(GPU_STAMP): setup.py
	@command -v $(BASE_PYTHON) >/dev/null || { echo "error: $(BASE_PYTHON) not found; install Python 3.11 or run 'make BASE_PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@test -x $(BIN)/python || $(BASE_PYTHON) -m venv $(VENV)
	@echo "installing the GPU stack into $(VENV): torch $(GPU_TORCH) from $(TORCH_INDEX), SGLang, Transformer Engine (several GB; pip's output goes to $(VENV)/install-gpu.log)"
	@{ $(BIN)/pip install --upgrade pip setuptools wheel && \
	   $(BIN)/pip install torch==$(GPU_TORCH) --index-url $(TORCH_INDEX) && \
	   $(BIN)/pip install -e '.[dev,sglang]' && \
	   $(BIN)/pip install --no-build-isolation -e '.[dev,sglang,gpu]'; } > $(VENV)/install-gpu.log 2>&1 || \
	 { tail -n 40 $(VENV)/install-gpu.log; echo "error: installing the GPU stack into $(VENV) failed (whole log: $(VENV)/install-gpu.log)"; exit 1; }
	@touch $(GPU_STAMP) $(STAMP)

install-gpu: $(GPU_STAMP)

demo: $(STAMP)
	$(BIN)/agentrl train --config examples/configs/tiny_cpu.yaml

# the tiers (tests/README.md): the fast one, the end-to-end one (whole runs, real servers, bench smokes, faults), all.
# The fast one runs on TEST_JOBS pytest-xdist workers, a test file on one worker (its module fixtures built once)
TEST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not e2e and not gpu and not slow" --durations=30 tests

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -q -m "e2e and not gpu and not slow" --durations=30 tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 tests

# the import contracts of .importlinter (layers, env_controller without torch, no cycles), then ruff
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check

clean:
	rm -rf $(VENV) outputs
