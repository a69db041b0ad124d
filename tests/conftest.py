import os
import sys

from hypothesis import HealthCheck, settings

# shared test helpers (tiny models, the protocol driver, run fixtures) live in tests/support; test
# modules are imported with --import-mode=importlib, so tests/ itself is never on sys.path (a folder
# named tests/trl or tests/verl must not shadow the real packages)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Deterministic property tests: the same examples on every run and machine.
settings.register_profile(
    "hdreplay", derandomize=True, deadline=None, max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("hdreplay")
