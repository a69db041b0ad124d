"""Where things are, for tests at any depth of tests/ (imported as ``from paths import ROOT, SUPPORT``)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support: helper scripts the tests launch
TESTS = SUPPORT.parent
ROOT = TESTS.parent  # the repository
BENCHMARKS = ROOT / "benchmarks"
CORE_DATA = TESTS / "core" / "data"  # checkpoints written by earlier builds (the compatibility tests)
