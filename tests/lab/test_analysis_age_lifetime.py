"""Sections 4-7 and 9 (age, staleness, mixing, phases, Headroom deciles, multiplicity, counterfactual)
on hand-made logs with hand-computed numbers."""

import pytest

from analysis_runs import groups_frame, life, step_rec, steps_frame
from hdreplay_lab.analysis import (
    age_gate,
    counterfactual,
    headroom_deciles,
    mixing,
    multiplicity,
    phase_mixture,
    pool_ages,
    staleness,
)


def scanned(step, ages, passes):
    n = len(ages)
    return step_rec(step, buffer_size=n, scanned=n, scan_age=ages, scan_pass=passes, scan_drift=[0.0] * n,
                    scan_cached_headroom=[0.5] * n, scan_headroom=[0.5] * n)


def test_age_gate_histograms_cdfs_and_rate_by_age():
    steps = steps_frame(scanned(1, [1, 1, 2], [True, False, True]), scanned(2, [3, 1, 2], [False, True, False]))
    a = age_gate(steps)
    # accepted ages [1, 2, 1], rejected [1, 3, 2]
    assert a["ages"] == [1, 2, 3]
    assert a["hist_accepted"] == pytest.approx([2 / 3, 1 / 3, 0])
    assert a["hist_rejected"] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert a["cdf_accepted"] == pytest.approx([2 / 3, 1, 1])
    assert a["cdf_rejected"] == pytest.approx([1 / 3, 2 / 3, 1])
    assert a["scanned_by_age"] == [3, 2, 1]
    assert a["accept_rate_by_age"] == pytest.approx([2 / 3, 1 / 2, 0])
    assert a["accepted"]["mean"] == pytest.approx(4 / 3) and a["rejected"]["mean"] == pytest.approx(2.0)
    assert a["reject_share_youngest"] == {"age": 1, "share": pytest.approx(1 / 3)}
    assert age_gate(steps_frame(scanned(0, [], [])))["available"] is False


# groups: A born 0 evicted at 2, B born 0 never evicted, C born 1 evicted at 3, D born 2 never evicted
GROUPS = groups_frame(life(birth_step=0, evicted_step=2), life(birth_step=0, evicted_step=None),
                      life(birth_step=1, evicted_step=3), life(birth_step=2, evicted_step=None))
STEPS = steps_frame(step_rec(0, buffer_size=0), step_rec(1, buffer_size=2, accepted_ages=[1, 1]),
                    step_rec(2, buffer_size=3, accepted_ages=[1, 2]),
                    step_rec(3, buffer_size=3, accepted_ages=[1, 3, 2]))


def test_pool_reconstruction_matches_buffer_residence():
    ages, mismatch = pool_ages(STEPS, GROUPS)
    # t=1: A, B -> [1, 1];  t=2: A (evicted at 2, still there before the step), B, C -> [2, 2, 1];
    # t=3: B, C, D -> [3, 2, 1]
    assert sorted(ages) == [1, 1, 1, 1, 2, 2, 2, 3] and mismatch == []
    bad = steps_frame(step_rec(3, buffer_size=4, accepted_ages=[1, 3, 2]))
    assert pool_ages(bad, GROUPS)[1] == [3]


def test_staleness_of_pool_and_used_subset():
    s = staleness(STEPS, GROUPS)
    assert s["pool"] == pytest.approx({"n": 8, "mean": 13 / 8, "median": 1.5, "p90": 3.0, "max": 3.0,
                                       "share_age_ge2": 0.5, "share_age_ge3": 1 / 8})
    # used: [1, 1, 1, 2, 1, 3, 2]
    assert s["used"] == pytest.approx({"n": 7, "mean": 11 / 7, "median": 1.0, "p90": 3.0, "max": 3.0,
                                       "share_age_ge2": 3 / 7, "share_age_ge3": 1 / 7})
    assert staleness(STEPS, groups_frame())["pool"]["available"] is False


def test_mixing_structure():
    m = mixing(STEPS)
    assert m["n_replay_updates"] == 3 and m["n_replay_groups"] == 7
    assert m["mean_age"] == pytest.approx(11 / 7)
    assert m["share_age1"] == pytest.approx(4 / 7) and m["share_age_ge3"] == pytest.approx(1 / 7)
    assert m["mean_distinct_ages"] == pytest.approx(2.0)  # {1}, {1, 2}, {1, 2, 3}
    assert m["share_updates_ge3_ages"] == pytest.approx(1 / 3)
    assert m["share_updates_age1_and_ge3"] == pytest.approx(1 / 3)
    assert mixing(steps_frame(step_rec(0)))["mean_age"] is None


def test_phase_mixture_equal_count_and_explicit_bounds():
    p = phase_mixture(STEPS, n_phases=2)["phases"]
    assert [(x["first_step"], x["last_step"]) for x in p] == [(0, 1), (2, 3)]
    assert p[0]["mean_age"] == 1.0 and p[0]["mean_distinct_ages"] == 1.0
    assert p[1]["mean_age"] == pytest.approx(9 / 5) and p[1]["share_age1"] == pytest.approx(2 / 5)
    assert p[1]["share_age_ge3"] == pytest.approx(1 / 5) and p[1]["mean_distinct_ages"] == pytest.approx(2.5)
    assert p[1]["share_updates_ge3_ages"] == 0.5 and p[1]["share_updates_age1_and_ge3"] == 0.5
    b = phase_mixture(STEPS, bounds=[1, 3])["phases"]
    assert [x["n_steps"] for x in b] == [1, 2, 1] and b[0]["n_replay_updates"] == 0
    with pytest.raises(ValueError, match="increase"):
        phase_mixture(STEPS, bounds=[3, 1])


LIFE = [  # ref_headroom, replay_count, exposure, insertion_id 0..5
    (0.9, 3, 0.5), (0.1, 0, 0.1), (0.5, 1, 0.2), (0.3, 0, 0.1), (0.7, 2, 0.4), (0.2, 1, 0.2),
]


def groups():
    return groups_frame(*(life(insertion_id=i, birth_step=i, ref_headroom=h, replay_count=n, exposure=w,
                               evicted_step=None if i == 5 else 10) for i, (h, n, w) in enumerate(LIFE)))


def test_headroom_deciles_by_hand():
    d = headroom_deciles(groups(), n_bins=4)
    # sorted by H: 0.1(0) 0.2(1) | 0.3(0) 0.5(1) | 0.7(2) | 0.9(3)
    assert [b["n"] for b in d["bins"]] == [2, 2, 1, 1]
    assert [b["mean_replay_count"] for b in d["bins"]] == [0.5, 0.5, 2.0, 3.0]
    assert [b["p_replayed"] for b in d["bins"]] == [0.5, 0.5, 1.0, 1.0]
    assert (d["bins"][0]["headroom_min"], d["bins"][0]["headroom_max"]) == (0.1, 0.2)
    assert d["n_groups"] == 6 and d["n_still_buffered"] == 1
    assert len(headroom_deciles(groups())["bins"]) == 6  # fewer groups than deciles


def test_headroom_ties_are_ordered_by_insertion_id():
    g = groups_frame(*(life(insertion_id=i, ref_headroom=0.5, replay_count=i, birth_step=0, evicted_step=None)
                       for i in (3, 1, 2, 0)))
    d = headroom_deciles(g, n_bins=2)
    assert [b["mean_replay_count"] for b in d["bins"]] == [0.5, 2.5]


def test_multiplicity_cohorts_events_and_exposure():
    m = multiplicity(groups())
    c = m["cohorts"]
    assert [x["n_groups"] for x in c] == [2, 2, 1, 1]
    assert [x["cohort_share"] for x in c] == pytest.approx([1 / 3, 1 / 3, 1 / 6, 1 / 6])
    assert [x["replay_events"] for x in c] == [0, 2, 2, 3] and m["total_replay_events"] == 7
    assert [x["replay_event_share"] for x in c] == pytest.approx([0, 2 / 7, 2 / 7, 3 / 7])
    assert [x["exposure_share"] for x in c] == pytest.approx([0.2 / 1.5, 0.4 / 1.5, 0.4 / 1.5, 0.5 / 1.5])
    assert m["share_never_replayed"] == pytest.approx(1 / 3)
    assert multiplicity(groups_frame())["available"] is False


def cf(step, ds, dr, hs, hr):
    return step_rec(step, cf_size=2, cf_drift_selected=ds, cf_drift_recency=dr, cf_headroom_selected=hs,
                    cf_headroom_recency=hr)


def test_counterfactual_quadrants_and_gains():
    steps = steps_frame(cf(1, 0.001, 0.003, 0.6, 0.5),   # x +0.002, y +0.1  both
                        cf(2, 0.002, 0.001, 0.7, 0.4),   # x -0.001, y +0.3  value only
                        cf(3, 0.001, 0.002, 0.3, 0.5),   # x +0.001, y -0.2  compatibility only
                        cf(4, 0.001, 0.001, 0.5, 0.5),   # tie
                        cf(5, 0.003, 0.001, 0.2, 0.5),   # x -0.002, y -0.3  neither
                        step_rec(6, accepted=0))          # no cf keys: skipped
    c = counterfactual(steps)
    assert c["n_steps"] == 5 and c["series"]["step"] == [1, 2, 3, 4, 5]
    assert c["series"]["quadrant"] == ["both", "value_only", "compatibility_only", "tie", "neither"]
    assert c["quadrant_share"] == pytest.approx({q: 0.2 for q in c["quadrant_share"]})
    assert c["series"]["compat_gain"] == pytest.approx([0.002, -0.001, 0.001, 0.0, -0.002])
    assert c["mean_compat_gain"] == pytest.approx(0.0, abs=1e-12)
    assert c["mean_value_gain"] == pytest.approx(-0.02)
    assert c["share_compat_positive"] == pytest.approx(0.4) and c["share_value_positive"] == pytest.approx(0.4)
    assert c["by_interval"]["value_gain"] == pytest.approx({"early": 0.2, "middle": -0.1, "final": -0.3})
    missing = counterfactual(steps_frame(step_rec(1, accepted=2)))
    assert missing["available"] is False and "replay_counterfactual" in missing["reason"]
