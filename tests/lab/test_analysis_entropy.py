"""Entropy-collapse timing (paper Appendix E.3.1) on hand-made trajectories."""

import pandas as pd
import pytest

from hdreplay_lab.analysis import AnalysisInputError, EntropyThresholds, collapse_timing
from hdreplay_lab.analysis.training import first_held, log_series


def series(steps, values):
    return pd.Series(values, index=steps, dtype=float)

STEPS = [10 * i for i in range(32)]
SCORE = [0.1, 0.2, 0.3, 0.45, 0.35] + [0.5] * 27           # first S >= 0.40 at i = 3 -> step 30
ENTROPY = (
    [0.5, 0.4, 0.3, 0.2, 0.1]
    + [0.02, 0.01, 0.02]          # i = 5..7: a dip of 3 points, too short for entry
    + [0.2, 0.1]                  # i = 8, 9
    + [0.02] * 5 + [0.03] + [0.01] * 6   # i = 10..21: 12 points <= H_L (0.03 itself counts) -> entry at i = 10
    + [0.05]                      # i = 22: one point >= H_U, too short for rebound
    + [0.02]                      # i = 23
    + [0.04] + [0.05] * 4         # i = 24..28: 5 points >= H_U (0.04 itself counts) -> rebound at i = 24
    + [0.06] * 3                  # i = 29..31
)


def test_entry_rebound_and_delays_by_hand():
    assert len(ENTROPY) == len(STEPS) == len(SCORE)
    t = collapse_timing(series(STEPS, SCORE), series(STEPS, ENTROPY))
    assert (t["t_first"], t["t_entry"], t["t_rebound"]) == (30, 100, 240)
    assert t["delta_entry"] == 70 and t["delta_rebound"] == 140
    assert t["notes"] == [] and t["n_entropy_points"] == 32


def test_hold_lengths_are_exact():
    low = pd.Series([0.5] + [0.01] * 9 + [0.5] * 10)
    assert first_held(low <= 0.03, 10) is None
    assert first_held(pd.concat([low, pd.Series([0.01] * 10)]) <= 0.03, 10) == 20
    assert first_held(pd.Series([True, True, False, True, True]), 2, start=1) == 3  # runs start at or after start
    # rebound held for 4 points only -> none, reported in notes
    h = [0.01] * 10 + [0.05] * 4 + [0.01]
    t = collapse_timing(series(range(15), [0.5] * 15), series(range(15), h))
    assert t["t_entry"] == 0 and t["t_rebound"] is None and t["delta_rebound"] is None
    assert "no rebound" in t["notes"][0]


def test_custom_thresholds_negative_delay_and_missing_events():
    th = EntropyThresholds(score_anchor=0.9, entropy_low=0.2, entropy_high=0.3, entry_hold=2, rebound_hold=1)
    steps = [0, 1, 2, 3, 4, 5]
    t = collapse_timing(series(steps, [0.1, 0.2, 0.3, 0.9, 0.9, 0.9]), series(steps, [0.5, 0.2, 0.1, 0.1, 0.35, 0.1]),
                        th)
    assert (t["t_first"], t["t_entry"], t["t_rebound"]) == (3, 1, 4)
    assert t["delta_entry"] == -2 and t["delta_rebound"] == 3  # collapse before reaching the anchor
    none = collapse_timing(series(steps, [0.1] * 6), series(steps, [0.5] * 6))
    assert none["t_first"] is None and none["t_entry"] is None and none["delta_entry"] is None
    assert any("never reached s0=0.4" in n for n in none["notes"])
    assert any("never stayed <= H_L=0.03" in n for n in none["notes"])
    empty = collapse_timing(series([], []), series([], []))
    assert empty["notes"] == ["no score in the trainer log", "no entropy in the trainer log"]


def test_thresholds_are_validated():
    with pytest.raises(AnalysisInputError, match="H_L"):
        EntropyThresholds(entropy_low=0.05, entropy_high=0.04)
    with pytest.raises(AnalysisInputError, match="entry_hold"):
        EntropyThresholds(entry_hold=0)


def test_log_series_skips_missing_values_and_repeated_steps():
    log = pd.DataFrame([{"step": 2, "reward": 0.5}, {"step": 1, "reward": 0.1}, {"step": 3},
                        {"step": 3, "reward": None}, {"reward": 0.9}, {"step": 2, "reward": 0.6},
                        {"step": 4, "reward": float("nan")},
                        {"step": True, "reward": 0.7}, {"step": 5, "reward": "0.3"}])
    s = log_series(log, "reward")
    assert s.index.tolist() == [1, 2] and s.tolist() == [0.1, 0.6]  # the last entry of a repeated step wins
    e = log_series(pd.DataFrame([{"step": 0, "train/entropy": 0.3}]), "entropy")
    assert e.index.tolist() == [0] and e.tolist() == [0.3]
    assert log_series(log, "entropy").empty
