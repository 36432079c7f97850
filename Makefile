# The two commands of a fresh machine: `make demo` and `make test`.
# the Python that creates the venv (not exported: scripts use .venv/bin/python)
BASE_PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all lint clean

$(STAMP): setup.py constraints.txt
	@command -v $(BASE_PYTHON) >/dev/null || { echo "error: $(BASE_PYTHON) not found; install Python 3.11 or run 'make BASE_PYTHON=/path/to/python3.11 ...'"; exit 1; }
	test -x $(BIN)/python || $(BASE_PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so that nothing pulls the multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/agentrl train --config examples/configs/tiny_cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not slow" tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q tests

# the import contracts of .importlinter (layers, env_controller without torch, no cycles), then ruff
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check

clean:
	rm -rf $(VENV) outputs
