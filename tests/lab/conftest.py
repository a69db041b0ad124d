"""Fixtures of the analysis tests (helpers live in analysis_runs.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from analysis_runs import make_real_run


@pytest.fixture(scope="session")
def _real_run_template(tmp_path_factory):
    return make_real_run(tmp_path_factory.mktemp("template"), "hdr")


@pytest.fixture
def real_run(tmp_path, _real_run_template):
    """A fresh copy (tests may corrupt it) of one real 30-step headroom_drift run named "hdr"."""
    return Path(shutil.copytree(_real_run_template, tmp_path / "hdr"))
