"""tau calibration: starved / too-loose flags, the recommendation, adaptive vs fixed, the sweep driver
and the summary entry point, on synthetic step logs (and one sweep through the real controller)."""

import json

import pytest

from hdreplay import AdaptiveTau, ReplayConfig, ReplayController
from hdreplay_lab.analysis import (
    AnalysisInputError, CalibrationCriteria, compare_adaptive, diagnose, main_calibrate_summary, recommend,
    run_calibration, summarize_calibration,
)
from hdreplay_lab.synthetic import TablePolicy, make_group


def third(i, a, b, c):
    """a for updates 1-10, b for 11-20, c for 21-30."""
    return a if i <= 10 else b if i <= 20 else c


def steps_log(accept=0.4, kl=0.002, fill=1.0, tau=0.01, n=30, adaptive_taus=None):
    """Step 0 (empty buffer) + n updates; accept / kl / fill are constants or callables of the update index."""
    val = lambda f, i: f(i) if callable(f) else f  # noqa: E731
    out = [{"step": 0, "selector": "headroom_drift", "k_rep": 4, "tau": tau, "buffer_size": 0, "scanned": 0,
            "accepted_gate": 0, "accepted": 0, "accept_rate": None, "budget_fill": 0.0, "replay_kl": None}]
    for i in range(1, n + 1):
        a = val(accept, i)
        rec = {"step": i, "selector": "headroom_drift", "k_rep": 4, "tau": tau, "buffer_size": 100, "scanned": 100,
               "accepted_gate": round(100 * a), "accepted": round(4 * val(fill, i)), "accept_rate": a,
               "budget_fill": val(fill, i), "replay_kl": val(kl, i)}
        if adaptive_taus is not None:
            rec["tau"], rec["tau_next"], rec["tau_action"] = adaptive_taus(i)
        out.append(rec)
    return out


RISING = lambda i: third(i, 0.0045, 0.009, 0.017)  # noqa: E731  (the paper's loose gate)


def diag(steps, label="run", tau=0.01, adaptive=False, **kw):
    return diagnose(steps, label=label, tau=tau, adaptive=adaptive, criteria=CalibrationCriteria(**kw))


def test_starved_by_low_final_acceptance():
    d = diag(steps_log(accept=0.05), tau=1e-3)
    assert d.starved and d.status == "starved" and not d.too_loose
    assert d.mean_accept == pytest.approx(0.05) and d.mean_rejections == pytest.approx(95)
    assert "final-third acceptance 5.0% < 10%" in d.reasons[0]


def test_starved_by_collapse_from_the_first_third():
    d = diag(steps_log(accept=lambda i: third(i, 0.8, 0.5, 0.15)))
    assert d.accept_by_interval == pytest.approx({"early": 0.8, "middle": 0.5, "final": 0.15})
    assert d.status == "starved" and "collapsed from 80.0%" in d.reasons[0]
    # a fall to 0.25 (less than 75 % of 0.8) is contraction, not starvation
    assert diag(steps_log(accept=lambda i: third(i, 0.8, 0.5, 0.25))).status == "viable"


def test_too_loose_needs_rising_kl_and_high_acceptance():
    d = diag(steps_log(accept=0.95, kl=RISING), tau=0.1)
    assert d.replay_kl_by_interval == pytest.approx({"early": 0.0045, "middle": 0.009, "final": 0.017})
    assert d.kl_final_over_early == pytest.approx(0.017 / 0.0045)
    assert d.too_loose and d.status == "too_loose" and d.gate_inactive
    assert "rose 3.78x" in d.reasons[0]
    # the same KL rise under a selective gate is not flagged (the gate is doing its job)
    assert diag(steps_log(accept=0.5, kl=RISING)).status == "viable"
    # the ratio must exceed the factor strictly
    assert diag(steps_log(accept=0.9, kl=lambda i: third(i, 0.002, 0.003, 0.004))).status == "viable"
    assert diag(steps_log(accept=0.9, kl=lambda i: third(i, 0.002, 0.003, 0.0041))).status == "too_loose"


def test_moderate_is_viable_and_no_data_is_reported():
    d = diag(steps_log(accept=0.4, kl=0.002))
    assert d.status == "viable" and d.reasons == [] and d.kl_final_over_early == pytest.approx(1.0)
    empty = diag(steps_log(n=0))
    assert empty.status == "no_data" and "no gate acceptance" in empty.reasons[0]


def test_criteria_are_validated():
    with pytest.raises(AnalysisInputError, match="loose_kl_ratio"):
        CalibrationCriteria(loose_kl_ratio=1.0)
    with pytest.raises(AnalysisInputError, match="starved_accept"):
        CalibrationCriteria(starved_accept=1.5)


def sweep(**spec):
    """{tau: steps_log kwargs} -> diagnostics labelled tau=<tau>."""
    return [diag(steps_log(tau=t, **kw), label=f"tau={t:g}", tau=t) for t, kw in spec.items()]


def test_recommendation_picks_the_remaining_regime():
    ds = [diag(steps_log(accept=0.05), label="tight", tau=1e-3),
          diag(steps_log(accept=0.4), label="moderate", tau=1e-2),
          diag(steps_log(accept=0.95, kl=RISING), label="loose", tau=1e-1)]
    r = recommend(ds)
    assert (r.status, r.label, r.tau, r.viable) == ("selected", "moderate", 1e-2, ["moderate"])
    assert "ruled out: tight (starved), loose (too loose)" in r.reason


def test_recommendation_tie_breaks():
    a = diag(steps_log(accept=0.4), label="a", tau=1e-2)
    b = diag(steps_log(accept=0.6), label="b", tau=3e-2)
    assert recommend([b, a]).label == "a"  # same budget fill: the smaller tau
    a_half = diag(steps_log(accept=0.4, fill=0.5), label="a", tau=1e-2)
    assert recommend([a_half, b]).label == "b"  # a budget that fills before a smaller tau
    a_near = diag(steps_log(accept=0.4, fill=0.97), label="a", tau=1e-2)
    r = recommend([a_near, b])  # 97% vs 100%: both fill the budget, so the tighter gate wins
    assert r.label == "a" and "within 5 points of the best" in r.reason
    assert recommend([a_near, b], CalibrationCriteria(fill_tolerance=0.01)).label == "b"
    a_short, b_short = (diag(steps_log(accept=0.4, fill=f), label=lab, tau=t)
                        for f, lab, t in ((0.6, "a", 1e-2), (0.7, "b", 3e-2)))
    assert recommend([a_short, b_short, diag(steps_log(accept=0.5, fill=0.9), label="c", tau=1e-1)]).label == "c"
    assert recommend([a_short, b_short]).label == "b"  # 0.6 is more than 5 points short of 0.7
    inactive = diag(steps_log(accept=0.95), label="c", tau=3e-2)
    r = recommend([a_half, inactive])
    assert r.label == "a" and "also viable: c" in r.reason  # a selective gate before an inactive one
    assert "leaves replay budget unfilled (50.0%, against 100.0%" in r.reason
    assert "unfilled" not in recommend([a_near, b]).reason
    a_edge = diag(steps_log(accept=0.4, fill=0.95), label="a", tau=1e-2)
    assert recommend([a_edge, b]).label == "a"  # exactly 5 points short still counts as full


def test_recommendation_without_recorded_budget_fill():
    a = diag(steps_log(accept=0.4), label="a", tau=1e-2)
    a.mean_budget_fill = None  # e.g. a log from a tool that does not record it
    b = diag(steps_log(accept=0.6), label="b", tau=3e-2)
    r = recommend([b, a])
    assert r.label == "a" and "not compared" in r.reason  # an unknown fill is not ranked as an empty one
    r = recommend([a])
    assert "budget fill n/a" in r.reason and "points" not in r.reason


def test_fill_tolerance_is_a_fraction():
    with pytest.raises(AnalysisInputError, match=r"--fill-tolerance\) is a fraction .*0.05 = 5 points"):
        CalibrationCriteria(fill_tolerance=5)


def test_recommendation_when_nothing_is_viable():
    starved = dict(accept=0.05)
    loose = dict(accept=0.95, kl=RISING)
    r = recommend([diag(steps_log(**starved), tau=t, label=str(t)) for t in (1e-3, 1e-2)])
    assert (r.status, r.tau) == ("extend_up", pytest.approx(0.1))
    r = recommend([diag(steps_log(**loose), tau=t, label=str(t)) for t in (1e-2, 1e-1)])
    assert (r.status, r.tau) == ("extend_down", pytest.approx(1e-3))
    r = recommend([diag(steps_log(**starved), tau=1e-3, label="t"), diag(steps_log(**loose), tau=1e-2, label="l")])
    assert r.status == "bracket" and r.tau == pytest.approx((1e-3 * 1e-2) ** 0.5) and r.label is None
    assert recommend([diag(steps_log(), adaptive=True)]).status == "none"


def adaptive_path(i):
    """tau 0.01 until update 15, then tightened once to 0.005."""
    return (0.01, 0.01, "hold") if i < 15 else (0.01, 0.005, "tighten") if i == 15 else (0.005, 0.005, "hold")


def test_adaptive_is_compared_with_the_recommended_fixed_tau():
    ds = [diag(steps_log(accept=0.4), label="tau=0.01", tau=1e-2),
          diag(steps_log(accept=0.5, adaptive_taus=adaptive_path), label="adaptive", tau=1e-2, adaptive=True)]
    r = recommend(ds)
    assert r.label == "tau=0.01"  # the adaptive run is never the recommended fixed tau
    (a,) = compare_adaptive(ds, r)
    assert a["tau_trajectory"] == {"start": 0.01, "final": 0.005, "min": 0.005, "max": 0.01,
                                   "n_loosen": 0, "n_tighten": 1}
    assert a["reference"] == "tau=0.01"
    assert "tau 0.01 -> 0.005 (0 loosen, 1 tighten)" in a["text"] and "acceptance 40.0%" in a["text"]


def write_run(root, name, steps, *, run_json=True, tau=None):
    d = root / name
    (d / "replay").mkdir(parents=True)
    (d / "replay" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    if run_json:
        (d / "run.json").write_text(json.dumps({"method": "hdr", "seed": 0, "task": "t",
                                                "replay": {"tau": tau, "selector": "headroom_drift"}}))
    return d


def test_summarize_calibration_writes_markdown_json_and_figure(tmp_path):
    runs = {
        "tau=1e-3": write_run(tmp_path, "a", steps_log(accept=0.05, tau=1e-3)),
        "tau=1e-2": write_run(tmp_path, "b", [{k: v for k, v in s.items() if k != "tau"}
                                              for s in steps_log(accept=0.4)], run_json=False),  # tau from label
        "tau=1e-1": write_run(tmp_path, "c", steps_log(accept=0.95, kl=RISING, tau=0.1)),
        "adaptive": write_run(tmp_path, "d", steps_log(accept=0.5, adaptive_taus=adaptive_path)),
    }
    s = summarize_calibration(runs, out_dir=tmp_path / "out")
    assert {k: d.status for k, d in s.runs.items()} == {
        "tau=1e-3": "starved", "tau=1e-2": "viable", "tau=1e-1": "too_loose", "adaptive": "viable"}
    assert s.runs["tau=1e-2"].tau == 1e-2 and s.runs["adaptive"].adaptive
    assert (s.recommendation.label, s.recommendation.tau) == ("tau=1e-2", 1e-2)
    assert set(s.paths) == {"json", "markdown", "figure"}
    data = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert data["recommendation"]["label"] == "tau=1e-2" and data["runs"]["tau=1e-3"]["starved"] is True
    assert data["runs"]["tau=1e-1"]["replay_kl_by_interval"]["final"] == pytest.approx(0.017)
    md = (tmp_path / "out" / "calibration.md").read_text()
    assert "**selected**: tau = 0.01" in md and "Adaptive tau vs fixed tau" in md and "calibration.png" in md
    assert (tmp_path / "out" / "calibration.png").stat().st_size > 1000


def test_run_calibration_drives_the_sweep(tmp_path):
    calls = []
    behaviour = {1e-3: dict(accept=0.05), 1e-2: dict(accept=0.4), 1e-1: dict(accept=0.95, kl=RISING)}

    def train_fn(label, tau, adaptive, run_dir):
        calls.append((label, tau, adaptive, run_dir.name))
        kw = dict(accept=0.45, adaptive_taus=adaptive_path) if adaptive else behaviour[tau]
        return write_run(run_dir.parent, run_dir.name, steps_log(tau=tau, **kw), tau=tau)

    s = run_calibration(train_fn, out_dir=tmp_path / "cal", show_progress=False)
    assert calls == [("tau=0.001", 1e-3, False, "tau=0.001"), ("tau=0.01", 1e-2, False, "tau=0.01"),
                     ("tau=0.1", 1e-1, False, "tau=0.1"), ("adaptive", 1e-2, True, "adaptive")]
    assert s.recommendation.label == "tau=0.01" and len(s.adaptive) == 1
    assert (tmp_path / "cal" / "calibration.md").exists()
    with pytest.raises(AnalysisInputError, match="distinct positive"):
        run_calibration(train_fn, taus=(1e-3, 1e-3), out_dir=tmp_path / "x")
    with pytest.raises(AnalysisInputError, match="not an existing run directory"):
        run_calibration(lambda *a: None, taus=(1e-2,), adaptive=False, out_dir=tmp_path / "y", show_progress=False)


def real_train_fn(steps=24):
    """Short runs of the real controller on the moving TablePolicy (everything but tau fixed)."""
    def train(label, tau, adaptive, run_dir):
        ad = AdaptiveTau(tau_min=1e-5, tau_max=1.0, warmup=2, patience=2) if adaptive else None
        ctrl = ReplayController(ReplayConfig(k_rep=3, tau=tau, capacity=15, adaptive_tau=ad),
                                diagnostics_dir=run_dir / "replay")
        pol = TablePolicy(seed=3)
        for t in range(steps):
            pol = pol.perturbed(0.05, seed=500 + t) if t else pol
            ctrl.select(step=t, scorer=pol.scorer)
            ctrl.stage([make_group(f"{t}-{i}", policy=pol, step=t, seed=11 * t + i) for i in range(5)], step=t)
            ctrl.commit()
        ctrl.close()
        return run_dir
    return train


def test_calibration_sweep_through_the_real_controller(tmp_path):
    s = run_calibration(real_train_fn(), taus=(1e-5, 1e-2, 1.0), out_dir=tmp_path / "cal", show_progress=False)
    assert s.runs["tau=1e-05"].status == "starved"  # nothing passes a gate this tight
    assert s.runs["tau=1"].gate_inactive and s.runs["tau=1"].mean_accept == 1.0
    assert s.recommendation.label in {"tau=0.01", "tau=1"} and s.runs["adaptive"].adaptive
    assert s.runs["adaptive"].tau_trajectory["start"] == 1e-2
    json.loads((tmp_path / "cal" / "calibration.json").read_text())


def test_main_calibrate_summary(tmp_path, capsys):
    a = write_run(tmp_path, "tau=0.001", steps_log(accept=0.05, tau=1e-3))
    b = write_run(tmp_path, "other", steps_log(accept=0.4, tau=1e-2))
    out = tmp_path / "out"
    assert main_calibrate_summary([str(a), "--run", "tau=0.01", str(b), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"markdown: {out / 'calibration.md'}" in text and "recommendation: selected tau=0.01" in text
    assert main_calibrate_summary(["--out", str(out)]) == 2
    assert main_calibrate_summary([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert main_calibrate_summary([str(a), "--run", "tau=0.001", str(b), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and "labels must be unique" in err and "Traceback" not in err
