# Two commands: `make demo` runs the CPU sandbox demo, `make test` runs the test suite.
# Both create or refresh their virtual environments (re-installed when pyproject.toml or the
# constraints change) with pinned versions:
#   .venv       core + TRL integration + sandbox   (constraints.txt: torch 2.13.0, trl 1.16.0, transformers 5.23.0,
#                                                   deepspeed 0.19.8 for the 2-process ZeRO tests)
#   .venv-verl  core + verl recipe                 (constraints-verl.txt: torch 2.13.0, verl 0.9.1, transformers 5.10.4,
#                                                   TransferQueue 0.1.11 for verl's v1 trainer)
# Two environments because verl 0.9.1 requires transformers < 5.11 while the TRL integration is tested on 5.23.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.hdreplay-installed
VENV_VERL := .venv-verl
VPY       := $(VENV_VERL)/bin/python
VSTAMP    := $(VENV_VERL)/.hdreplay-installed
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: demo test lint test-core test-verl test-release bench bench-verl venv venv-verl clean

venv: $(STAMP)
venv-verl: $(VSTAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt torch==2.13.0
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

$(VSTAMP): pyproject.toml constraints-verl.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV_VERL)
	$(VPY) -m pip install $(PIP_FLAGS) -c constraints-verl.txt torch==2.13.0
	$(VPY) -m pip install $(PIP_FLAGS) -c constraints-verl.txt -e ".[verl,test,cli]"
	touch $(VSTAMP)

demo: $(STAMP)
	$(VENV)/bin/hdreplay demo

test: lint test-core test-verl test-release

# ruff (rules in pyproject.toml [tool.ruff]): pyflakes, pycodestyle errors and warnings, import order
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

test-core: $(STAMP)
	$(PY) -m pytest -q -m "not verl and not release"

# the built wheel installed into a fresh venv from PyPI (unconstrained but for torch) and trained through
# HDRGRPOTrainer: 2-3 minutes, once per `make test` (tests/release/test_clean_install.py)
test-release: $(STAMP)
	$(PY) -m pytest -q -m release

test-verl: $(VSTAMP)
	$(VPY) -m pytest -q -m verl

bench: $(STAMP)
	$(PY) benchmarks/core.py
	$(PY) benchmarks/trl_step.py
	$(PY) benchmarks/trl_step.py --rollout-ms-per-token 0 --out benchmarks/results/trl_step_native.json

bench-verl: $(VSTAMP)
	$(VPY) benchmarks/verl_fill.py

clean:
	rm -rf $(VENV) $(VENV_VERL) .pytest_cache .hypothesis
