"""The ``>>>`` examples in the docstrings of the core and of its baselines run (fast: no TRL / verl import)."""

import doctest
import importlib
import pkgutil

import pytest

import hdreplay
import hdreplay.baselines
import hdreplay.checkpoint
import hdreplay.diagnostics
import hdreplay.staleness
import hdreplay.store

CORE = sorted(m.name for p in (hdreplay, hdreplay.store, hdreplay.checkpoint)
              for m in pkgutil.iter_modules(p.__path__, p.__name__ + ".") if not m.ispkg)
BASELINES = sorted(m.name for p in (hdreplay.baselines, hdreplay.diagnostics, hdreplay.staleness)
                   for m in pkgutil.iter_modules(p.__path__, p.__name__ + ".")) + [
    "hdreplay.diagnostics", "hdreplay.staleness"]
#: the public API's modules that must carry a runnable example (config, ingest, buffer, selection, scores)
REQUIRED = ("hdreplay.config", "hdreplay.store.ingest", "hdreplay.store.buffer", "hdreplay.controller",
            "hdreplay.scores", "hdreplay.selectors", "hdreplay.diagnostics.adaptive_tau", "hdreplay.diagnostics")


@pytest.mark.parametrize("name", CORE + BASELINES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
    if name in REQUIRED:
        assert result.attempted > 0, f"{name} has no >>> example"


def test_the_public_api_carries_at_least_five_examples():
    assert set(REQUIRED) <= set(CORE + BASELINES)
