"""The gate-waste section (issue 27) on hand-made StepRecords, numbers by hand, and on a real controller run."""

import pytest

from analysis_runs import make_real_run, step_rec, steps_frame
from hdreplay_lab.analysis.load import load_run
from hdreplay_lab.analysis.markdown import render_report
from hdreplay_lab.analysis.report import build_report
from hdreplay_lab.analysis.waste import gate_waste


def rec(step, scan_pass, drift, exact, streak, *, rows, toks, rep_rows, rep_toks, rej_toks, unused=0, unused_toks=0,
        skipped=0, tau=0.01):
    n, passed = len(scan_pass), sum(scan_pass)
    rejected = [not p for p in scan_pass]
    return step_rec(step, tau=tau, buffer_size=10, scanned=n, accepted_gate=passed, accepted=passed,
                    scan_pass=list(scan_pass), scan_drift=list(drift), scan_exact=list(exact),
                    scan_streak=list(streak), rescored_rows=rows, rescored_tokens=toks, replayed_rows=rep_rows,
                    replayed_tokens=rep_toks, rescored_tokens_rejected=rej_toks, rescored_tokens_unused=unused_toks,
                    scored_unused=unused, early_rejected=sum(r and not e for r, e in zip(rejected, exact)),
                    rejected_again=sum(r and s > 0 for r, s in zip(rejected, streak)), skipped=skipped)


# step 1: 2 pass, 2 rejected (Drift 4 tau exact, >= 12 tau early); step 2: 1 pass, 3 rejected (>= 6 tau early and
# again, 2 tau exact, >= 20 tau early and its 5th rejection in a row), one group beyond the stopping index
STEPS = steps_frame(
    step_rec(0, buffer_size=0),
    rec(1, [True, False, True, False], [0.001, 0.04, 0.002, 0.12], [True, True, True, False], [0, 0, 0, 0],
        rows=26, toks=260, rep_rows=16, rep_toks=160, rej_toks=100),
    rec(2, [False, False, True, False], [0.06, 0.02, 0.005, 0.2], [False, True, True, False], [1, 0, 0, 4],
        rows=20, toks=200, rep_rows=8, rep_toks=80, rej_toks=100, unused=1, unused_toks=20, skipped=3),
)


def test_waste_numbers_by_hand():
    w = gate_waste(STEPS)
    assert w["rows_per_admitted_row"] == pytest.approx(46 / 24)
    assert w["tokens_per_admitted_token"] == pytest.approx(460 / 240)
    assert w["groups_touched_per_admitted"] == pytest.approx(9 / 3)
    assert w["groups_scanned_per_admitted"] == pytest.approx(8 / 3)
    assert w["share_rejected"] == pytest.approx(200 / 460) and w["share_unused"] == pytest.approx(20 / 460)
    assert w["rejected"]["n"] == 5 and w["rejected"]["median_over_tau"] == pytest.approx(6)
    assert w["rejected"]["share_gt"] == pytest.approx({"3": 4 / 5, "5": 3 / 5, "10": 2 / 5})
    assert w["rejected"]["exact_share"] == pytest.approx(2 / 5) and w["early_rejected_share"] == pytest.approx(3 / 5)
    assert w["rejected_again_share"] == pytest.approx(2 / 5)
    assert w["streaks"] == pytest.approx({"1": 3 / 5, "2": 1 / 5, "3": 0, "4": 0, ">=5": 1 / 5})
    assert w["mean_skipped"] == pytest.approx(3 / 2)  # over the 2 updates (step 0 had an empty buffer)


def test_old_records_give_what_they_can():
    old = steps_frame(step_rec(1, buffer_size=4, scanned=2, accepted_gate=1, accepted=1, scan_pass=[True, False],
                               scan_drift=[0.001, 0.05], rescored_rows=16, replayed_rows=8))
    for frame in (old, old.drop(columns=[c for c in ("replayed_tokens", "scan_exact", "scan_streak") if c in old])):
        w = gate_waste(frame)  # as loaded (the new lists empty) and without the new columns at all
        assert w["rows_per_admitted_row"] == 2
        assert w["rejected"]["median_over_tau"] == pytest.approx(5)
    assert w["tokens_per_admitted_token"] is None


def test_report_has_the_section(tmp_path):
    run = make_real_run(tmp_path, "hd", steps=20, scan_passes=4)
    rep = build_report([load_run(run)])
    w = rep["runs"]["hd"]["waste"]
    assert w["available"] and w["early_rejected_share"] > 0 and 1 <= w["rows_per_admitted_row"]
    assert "re-scored tokens per admitted token" in render_report(rep)
