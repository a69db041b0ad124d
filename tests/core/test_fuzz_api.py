"""A deterministic fuzz of the public API: 0 unexpected exception types, 0 silent acceptances of invalid
input, 0 state changes after a refusal (the engine and its classification: tests/support/core_fuzz.py;
the strategy stores: core_fuzz_strategies.py; the verl settings: tests/verl/test_verl_fuzz.py; the CLI:
tests/lab/test_cli_fuzz.py; the longer run: benchmarks/fuzz_core.py)."""

import dataclasses

import pytest

from core_fuzz import random_programs, run_cases
from hdreplay import ReplayConfig


def _assert_clean(counts):
    report = {k: v for k, v in counts.examples.items() if v}
    assert (counts.unexpected, counts.silent, counts.changed, counts.valid_failed) == (0, 0, 0, 0), report


def test_every_public_call_refuses_each_invalid_argument_without_a_trace(tmp_path):
    counts = run_cases(tmp_path)
    _assert_clean(counts)
    assert counts.refused > 500  # the cases really ran (and the valid calls beside them succeeded)


def test_random_protocol_programs_refuse_cleanly_and_run_valid_calls():
    counts = random_programs(12, seed=0, length=30)
    _assert_clean(counts)
    assert counts.refused > 50 and counts.calls - counts.refused > 100


def test_strategy_stores_refuse_each_invalid_argument_and_state_field_without_a_trace(tmp_path):
    """RePO, ExGRPO, BAPO: every public call and every loaded state field (tests/support/core_fuzz_strategies.py)."""
    from core_fuzz_strategies import run_strategy_cases

    counts = run_strategy_cases(tmp_path)
    _assert_clean(counts)
    assert counts.refused > 500


def test_the_config_cannot_be_changed_after_validation():
    cfg = ReplayConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tau = -1.0
    assert dataclasses.replace(cfg, tau=0.5).tau == 0.5
