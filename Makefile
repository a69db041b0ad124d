# Two commands: `make demo` runs the CPU sandbox demo, `make test` runs the test suite.
# Both create or refresh the local virtual environment .venv (re-installed when
# pyproject.toml or constraints.txt change) with the pinned versions of constraints.txt.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hdreplay-installed
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hdreplay demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
