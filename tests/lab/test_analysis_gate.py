"""Sections 1-3 (acceptance, replay KL, scan depth / prefix share) on hand-made StepRecords, numbers by hand."""

import pandas as pd
import pytest

from analysis_runs import step_rec, steps_frame
from hdreplay_lab.analysis import acceptance, prefix_share, replay_kl, scan
from hdreplay_lab.analysis.gate import accepted_ranks, rejections
from hdreplay_lab.analysis.stats import distribution, interval_means, pieces, running_mean


def rec(step, size, scan_pass, accepted, k_rep=2, kl=None, selector="headroom_drift", capped=False):
    n, passed = len(scan_pass), sum(scan_pass)
    return step_rec(step, selector=selector, k_rep=k_rep, buffer_size=size, scanned=n, accepted_gate=passed,
                    accepted=accepted, accept_rate=passed / n if n else None, budget_fill=accepted / k_rep,
                    replay_kl=kl, scan_pass=list(scan_pass), scan_age=[1] * n, scan_drift=[0.0] * n,
                    scan_cached_headroom=[0.5] * n, scan_headroom=[0.5] * n, scan_capped=capped)


# step 0: empty buffer; 1: 2/2 pass; 2: 2/4 pass; 3: 1/8 pass (underfilled, stopped by the scan budget)
STEPS = steps_frame(
    rec(0, 0, [], 0),
    rec(1, 4, [True, True], 2, kl=0.001),
    rec(2, 6, [False, True, False, True], 2, kl=0.002),
    rec(3, 8, [False, False, False, True, False, False, False, False], 1, kl=0.004, capped=True),
)


def test_acceptance_budget_and_rejections_by_hand():
    a = acceptance(STEPS)
    assert a["n_steps"] == 4 and a["n_updates"] == 3  # step 0 had an empty buffer
    assert a["mean_accept_rate"] == pytest.approx((1 + 0.5 + 0.125) / 3)
    assert a["pooled_accept_rate"] == pytest.approx(5 / 14)
    assert a["mean_budget_fill"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert a["series"]["rejections"] == [0, 0, 2, 7]
    assert a["series"]["accept_rate"] == [None, 1.0, 0.5, 0.125]
    assert a["mean_rejections"] == pytest.approx(3.0)
    assert a["by_interval"]["accept_rate"] == pytest.approx({"early": 1.0, "middle": 0.5, "final": 0.125})
    assert a["by_interval"]["rejections"] == pytest.approx({"early": 0, "middle": 2, "final": 7})


def test_rejections_never_negative_for_unscored_selectors():
    # recency without diagnostics: nothing scanned, accepted_gate = kept + truncated
    frame = steps_frame(step_rec(1, scanned=0, accepted_gate=3), step_rec(2, scanned=5, accepted_gate=2))
    assert rejections(frame).tolist() == [0, 3]


def test_replay_kl_intervals_ratio_and_running_mean():
    k = replay_kl(STEPS, window=2)
    assert k["mean"] == pytest.approx(0.007 / 3)
    assert k["by_interval"] == pytest.approx({"early": 0.001, "middle": 0.002, "final": 0.004})
    assert k["final_over_early"] == pytest.approx(4.0)
    assert k["running"]["step"] == [1, 2, 3]
    assert k["running"]["replay_kl"] == pytest.approx([0.001, 0.0015, 0.003])
    assert replay_kl(steps_frame(rec(0, 0, [], 0)))["available"] is False


def test_scan_depth_filled_capped_and_prefix_share():
    s = scan(STEPS)
    assert s["order"] == "headroom"
    assert s["mean_scan_depth"] == pytest.approx(14 / 3)
    assert (s["n_filled"], s["n_underfilled"], s["n_scan_capped"]) == (2, 1, 1)
    assert s["series"]["filled"] == [None, True, True, False]
    p = s["prefix"]
    # ranks / buffer size: 1/4, 2/4 | 2/6, 4/6 | 4/8
    assert p["n_accepted"] == 5
    assert p["share_at"] == pytest.approx({"0.05": 0.0, "0.1": 0.0, "0.25": 0.2, "0.5": 0.8})
    assert p["share_within_k_rep"] == pytest.approx(3 / 5)
    grid = dict(zip(p["grid"], p["cumulative_share"]))
    assert grid[0.33] == pytest.approx(0.2) and grid[0.34] == pytest.approx(0.4) and grid[1.0] == 1.0


def test_prefix_ranks_respect_truncation_and_recency_order_is_labelled():
    r = steps_frame(rec(5, 10, [False, True, True, True], 2))  # 3 gate passes, truncated to 2
    assert accepted_ranks(r)["rank"].tolist() == [2, 3]
    assert prefix_share(r)["share_at"] == pytest.approx({"0.05": 0, "0.1": 0, "0.25": 0.5, "0.5": 1.0})
    assert scan(steps_frame(rec(1, 4, [True], 1, selector="drift_only")))["order"] == "recency"


def test_scan_unavailable_when_nothing_was_scanned():
    r = steps_frame(step_rec(1, selector="recency", buffer_size=5, scanned=0, accepted_gate=2, accepted=2))
    assert scan(r)["available"] is False and "recency" in scan(r)["reason"]
    assert acceptance(steps_frame())["available"] is False


def test_stats_helpers():
    # equal-count pieces: the first pieces take the extras, like numpy.array_split
    assert pieces(7, 3).tolist() == [0, 0, 0, 1, 1, 2, 2] and pieces(10, 4).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert interval_means([1, None, 3, float("nan"), 5]) == {"early": 1.0, "middle": 3.0, "final": 5.0}
    assert interval_means([2.0]) == {"early": 2.0, "middle": None, "final": None}
    r = running_mean(pd.Series([0, 1, 2, 3]), pd.Series([1.0, None, 3.0, 5.0]), 2)
    assert r["step"] == [0, 2, 3] and r["value"] == pytest.approx([1.0, 2.0, 4.0])
    d = distribution([1, 1, 1, 1, 2, 2, 2, 3])
    assert d == {"n": 8, "mean": 13 / 8, "median": 1.5, "p90": 3.0, "max": 3.0}
    assert distribution(list(range(1, 11)))["p90"] == 9.0  # inverted CDF: P(X <= 9) = 0.9
    with pytest.raises(ValueError):
        running_mean(pd.Series([0]), pd.Series([1.0]), 0)
