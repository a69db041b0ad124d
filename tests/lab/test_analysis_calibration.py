"""tau calibration: starved / too-loose flags, the recommendation, adaptive vs fixed, the sweep driver
and the summary entry point, on synthetic step logs (and one sweep through the real controller)."""

import json

import pytest

from analysis_runs import step_rec, steps_frame
from hdreplay import ReplayConfig, ReplayController
from hdreplay.diagnostics import AdaptiveTau, DiagnosticsConfig, observers
from hdreplay_lab.analysis import (
    AnalysisInputError,
    CalibrationCriteria,
    compare_adaptive,
    diagnose,
    recommend,
    run_calibration,
    summarize_calibration,
)
from hdreplay_lab.cli import main
from hdreplay_lab.synthetic import TablePolicy, make_group


def third(i, a, b, c):
    """a for updates 1-10, b for 11-20, c for 21-30."""
    return a if i <= 10 else b if i <= 20 else c


def steps_log(accept=0.4, kl=0.002, fill=1.0, tau=0.01, n=30, adaptive_taus=None):
    """StepRecords: step 0 (empty buffer) + n updates; accept / kl / fill are constants or callables of the update."""
    val = lambda f, i: f(i) if callable(f) else f  # noqa: E731
    out = [step_rec(0, k_rep=4, tau=tau, budget_fill=0.0)]
    for i in range(1, n + 1):
        a, f = val(accept, i), val(fill, i)
        t, t_next, action = adaptive_taus(i) if adaptive_taus else (tau, None, None)
        out.append(step_rec(i, k_rep=4, tau=t, buffer_size=100, scanned=100, accepted_gate=round(100 * a),
                            accepted=round(4 * f), accept_rate=a, budget_fill=f, replay_kl=val(kl, i), tau_next=t_next,
                            tau_action=action))
    return out


RISING = lambda i: third(i, 0.0045, 0.009, 0.017)  # noqa: E731  (the paper's loose gate)


def diag(steps, label="run", tau=0.01, adaptive=False, **kw):
    return diagnose(steps_frame(*steps), label=label, tau=tau, adaptive=adaptive, criteria=CalibrationCriteria(**kw))


def test_starved_by_low_final_acceptance():
    d = diag(steps_log(accept=0.05), tau=1e-3)
    assert d.starved and d.status == "starved" and not d.too_loose
    assert d.mean_accept == pytest.approx(0.05) and d.mean_rejections == pytest.approx(95)
    assert d.accept_by_interval["final"] == pytest.approx(0.05) and len(d.reasons) == 1


def test_starved_by_collapse_from_the_first_third():
    d = diag(steps_log(accept=lambda i: third(i, 0.8, 0.5, 0.15)))
    assert d.accept_by_interval == pytest.approx({"early": 0.8, "middle": 0.5, "final": 0.15})
    assert d.status == "starved" and d.starved and not d.too_loose
    # a fall to 0.25 (less than 75 % of 0.8) is contraction, not starvation
    assert diag(steps_log(accept=lambda i: third(i, 0.8, 0.5, 0.25))).status == "viable"


def test_too_loose_needs_rising_kl_and_high_acceptance():
    d = diag(steps_log(accept=0.95, kl=RISING), tau=0.1)
    assert d.replay_kl_by_interval == pytest.approx({"early": 0.0045, "middle": 0.009, "final": 0.017})
    assert d.kl_final_over_early == pytest.approx(0.017 / 0.0045)
    assert d.too_loose and d.status == "too_loose" and d.gate_inactive and not d.starved
    # the same KL rise under a selective gate is not flagged (the gate is doing its job)
    assert diag(steps_log(accept=0.5, kl=RISING)).status == "viable"
    # the ratio must exceed the factor strictly
    assert diag(steps_log(accept=0.9, kl=lambda i: third(i, 0.002, 0.003, 0.004))).status == "viable"
    assert diag(steps_log(accept=0.9, kl=lambda i: third(i, 0.002, 0.003, 0.0041))).status == "too_loose"


def test_moderate_is_viable_and_no_data_is_reported():
    d = diag(steps_log(accept=0.4, kl=0.002))
    assert d.status == "viable" and d.reasons == [] and d.kl_final_over_early == pytest.approx(1.0)
    empty = diag(steps_log(n=0))
    assert empty.status == "no_data" and not (empty.starved or empty.too_loose) and empty.mean_accept is None


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
    assert r.ruled_out == {"tight": "starved", "loose": "too_loose"}


def test_recommendation_tie_breaks():
    def pick(*runs, **crit):
        r = recommend(runs, CalibrationCriteria(**crit))
        return r.label, r.unfilled, r.inactive

    a = diag(steps_log(accept=0.4), label="a", tau=1e-2)
    b = diag(steps_log(accept=0.6), label="b", tau=3e-2)
    assert pick(b, a) == ("a", False, False)  # same budget fill: the smaller tau
    a_half = diag(steps_log(accept=0.4, fill=0.5), label="a", tau=1e-2)
    assert pick(a_half, b) == ("b", False, False)  # a budget that fills before a smaller tau
    a_near = diag(steps_log(accept=0.4, fill=0.97), label="a", tau=1e-2)
    assert pick(a_near, b) == ("a", False, False)  # 97% vs 100%: both fill the budget, the tighter gate wins
    assert pick(a_near, b, fill_tolerance=0.01) == ("b", False, False)
    a_edge = diag(steps_log(accept=0.4, fill=0.95), label="a", tau=1e-2)
    assert pick(a_edge, b) == ("a", False, False)  # exactly 5 points short still counts as full
    a_short, b_short = (diag(steps_log(accept=0.4, fill=f), label=lab, tau=t)
                        for f, lab, t in ((0.6, "a", 1e-2), (0.7, "b", 3e-2)))
    c = diag(steps_log(accept=0.5, fill=0.9), label="c", tau=1e-1)
    assert pick(a_short, b_short, c) == ("c", False, False)
    assert pick(a_short, b_short) == ("b", False, False)  # 0.6 is more than 5 points short of 0.7
    # a selective gate wins over an inactive one even when it fills less; the decision records the shortfall
    inactive = diag(steps_log(accept=0.95), label="c", tau=3e-2)
    r = recommend([a_half, inactive])
    assert (r.label, r.viable, r.fill_compared, r.unfilled, r.inactive) == ("a", ["a", "c"], True, True, False)
    # only inactive gates: the smallest tau, flagged
    assert pick(inactive, diag(steps_log(accept=0.97), label="d", tau=1e-1)) == ("c", False, True)


def test_recommendation_without_recorded_budget_fill():
    a = diag(steps_log(accept=0.4), label="a", tau=1e-2)
    a.mean_budget_fill = None  # e.g. a log from a tool that does not record it
    b = diag(steps_log(accept=0.6), label="b", tau=3e-2)
    r = recommend([b, a])
    assert (r.label, r.fill_compared, r.unfilled) == ("a", False, False)  # an unknown fill is not ranked as empty
    assert recommend([a]).label == "a"
    a_half = diag(steps_log(accept=0.4, fill=0.5), label="a", tau=1e-2)
    a_half.mean_budget_fill = None
    assert recommend([a_half, b]).label == "a"  # with a fill unknown, fill does not decide


def test_fill_tolerance_is_a_fraction():
    with pytest.raises(AnalysisInputError,
                       match=r"fill_tolerance \(--fill-tolerance\) must be a fraction in \[0, 1\], got 5"):
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
    assert a["reference"] == "tau=0.01" and a["mean_accept"] == pytest.approx(0.5) and a["status"] == "viable"


def write_run(root, name, steps, *, run_json=True, tau=None, drop=()):
    d = root / name
    (d / "replay").mkdir(parents=True)
    recs = [{k: v for k, v in s.to_json().items() if k not in drop} for s in steps]
    (d / "replay" / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if run_json:
        (d / "run.json").write_text(json.dumps({"method": "hdr", "seed": 0, "task": "t",
                                                "replay": {"tau": tau, "selector": "headroom_drift"}}))
    return d


def test_summarize_calibration_writes_markdown_json_and_figure(tmp_path):
    runs = {
        "tau=1e-3": write_run(tmp_path, "a", steps_log(accept=0.05, tau=1e-3)),
        "tau=1e-2": write_run(tmp_path, "b", steps_log(accept=0.4), run_json=False, drop=("tau",)),  # tau from label
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
    assert data["recommendation"]["ruled_out"] == {"tau=1e-3": "starved", "tau=1e-1": "too_loose"}
    assert [a["label"] for a in data["adaptive"]] == ["adaptive"] and data["adaptive"][0]["reference"] == "tau=1e-2"
    md = (tmp_path / "out" / "calibration.md").read_text()
    assert "**selected**: tau = 0.01" in md and "![calibration](calibration.png)" in md
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
        cfg = ReplayConfig(k_rep=3, tau=tau, capacity=15)
        ctrl = ReplayController(cfg, diagnostics_dir=run_dir / "replay",
                                observers=observers(DiagnosticsConfig(adaptive_tau=ad), cfg))
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
    s = run_calibration(real_train_fn(), taus=(1e-5, 3e-3, 1.0), out_dir=tmp_path / "cal", show_progress=False)
    assert s.runs["tau=1e-05"].status == "starved" and s.runs["tau=1e-05"].mean_accept == 0.0  # nothing passes
    assert s.runs["tau=1"].gate_inactive and s.runs["tau=1"].mean_accept == 1.0
    # tau=3e-3 gates this policy walk (about half the scanned groups pass) and still fills the budget within
    # 5 points of tau=1: the selective gate is the decision, tau=1 (filters nothing) the other viable run
    mid = s.runs["tau=0.003"]
    assert mid.status == "viable" and not mid.gate_inactive and 0.2 < mid.mean_accept < 0.8
    assert mid.mean_budget_fill > s.runs["tau=1"].mean_budget_fill - 0.05
    r = s.recommendation
    assert (r.status, r.label, r.viable, r.ruled_out, r.unfilled, r.inactive) == (
        "selected", "tau=0.003", ["tau=0.003", "tau=1"], {"tau=1e-05": "starved"}, False, False)
    assert s.runs["adaptive"].adaptive and s.runs["adaptive"].tau_trajectory["start"] == 3e-3
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["recommendation"]["label"] == "tau=0.003"


def test_calibrate_summarize_command(tmp_path, capsys):
    a = write_run(tmp_path, "tau=0.001", steps_log(accept=0.05, tau=1e-3))
    b = write_run(tmp_path, "other", steps_log(accept=0.4, tau=1e-2))
    out = tmp_path / "out"
    assert main(["calibrate", "summarize", str(a), str(b), "--label", "tau=0.001", "--label", "tau=0.01",
                 "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"markdown: {out / 'calibration.md'}" in text and "recommendation: selected tau=0.01" in text
    rec = json.loads((out / "calibration.json").read_text())["recommendation"]
    assert (rec["label"], rec["ruled_out"]) == ("tau=0.01", {"tau=0.001": "starved"})
    (tmp_path / "file").write_text("x")
    for args, needle in (([], "give one or more run directories"), ([str(tmp_path / "missing")], "no such directory"),
                         ([str(a), str(b), "--label", "x", "--label", "x"], "labels must be unique"),
                         ([str(a), "--label", "x", "--label", "y"], "2 --label values"),
                         ([str(a), "--fill-tolerance", "5"], "fraction in [0, 1]"),
                         ([str(a), "--loose-kl-ratio", "nan"], "--loose-kl-ratio"),
                         ([str(a), "--out", str(tmp_path / "file")], "is a file")):
        assert main(["calibrate", "summarize", *args, "--no-progress"]) == 2, args
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith("hdreplay calibrate summarize: error:") and needle in err[0], err
