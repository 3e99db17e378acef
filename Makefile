# The README's commands. `make run` and `make test` work on a fresh machine: they create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Arguments for `make run`, e.g. make run ARGS="-- --max-steps 50"
ARGS ?=

.PHONY: setup run test unit integration gpu-test lint docs reference bench bench-launcher clean

setup: $(STAMP)

# torch is installed first on its own, pinned: here that takes the CPU build from the machine's wheel
# cache, and nothing else can pull a multi-GB CUDA build in its place.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $@

run: setup
	$(VENV)/bin/launcher submit --nodes 2 --gpus-per-node 1 $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The unit tests on both cores (pytest-xdist); then the integration tests in two phases (tests/phases.sh):
# the `beside` ones (SLURM, image builds and pulls, compose) in a pytest beside one of the rest, then
# the `alone` ones (a threshold or a time budget measured on the machine) by themselves.
test: lint docs
	$(VENV)/bin/pytest -q -n 2 tests/unit
	bash tests/phases.sh $(VENV)/bin/pytest

# The docs site into site/; --strict (mkdocs.yml): a broken link or anchor, or a page left out, fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --quiet

# The generated reference pages (docs/reference/): the CLI's --help, the config fields, the exit codes.
reference: setup
	$(PY) -m tools.reference docs/reference

unit: setup
	$(VENV)/bin/pytest -q tests/unit

integration: setup
	$(VENV)/bin/pytest -q tests/integration

# On a machine with a CUDA GPU (../shared/GPU.md): the GPU paths, which CI cannot run.
gpu-test: setup
	GPTLAUNCH_GPU_TESTS=1 $(VENV)/bin/pytest -q tests/gpu

bench: setup
	$(PY) benchmarks/bench_trainer.py

bench-launcher: setup
	$(PY) benchmarks/bench_launcher.py

clean:
	rm -rf $(VENV) jobs runs site .pytest_cache .mypy_cache .ruff_cache
