# The two commands of a fresh machine: `make demo` and `make test`.
# the Python that creates the venv (not exported: scripts use .venv/bin/python)
BASE_PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-e2e test-all lint clean

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
