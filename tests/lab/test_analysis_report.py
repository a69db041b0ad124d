"""``main_report`` end to end on REAL run directories written by the core ReplayController (TablePolicy,
counterfactual=True) with a hand-written trainer log: one run, runs side by side, a run without replay."""

import json

import pytest

from analysis_runs import make_plain_run, make_real_run, read_jsonl
from hdreplay_lab.analysis import main_report
from hdreplay_lab.analysis.report import REPLAY_SECTIONS

FIGURES = ("acceptance", "replay_kl", "scan", "age", "headroom_deciles", "multiplicity", "counterfactual",
           "entropy_timing", "phases")
SECTIONS = ("info", "problems", "training", "final_metrics", "entropy_timing", *REPLAY_SECTIONS)


def run_report(args, capsys):
    rc = main_report([*map(str, args), "--no-progress"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out


def test_report_on_a_real_run(real_run, tmp_path, capsys):
    out = tmp_path / "rep"
    rc, printed = run_report([real_run, "--out", out], capsys)
    assert rc == 0
    assert f"report: {out / 'report.md'}" in printed.out and f"json:   {out / 'report.json'}" in printed.out
    for name in FIGURES:
        assert (out / "figures" / f"{name}.png").stat().st_size > 1000, name
        assert f"figure: {out / 'figures' / (name + '.png')}" in printed.out
    rep = json.loads((out / "report.json").read_text())
    assert rep["format"] == "hdreplay.report" and rep["version"] == 1
    assert rep["figures"] == {n: f"figures/{n}.png" for n in FIGURES}
    a = rep["runs"]["hdr"]
    assert set(SECTIONS) <= set(a) and all(a[k].get("available", True) for k in REPLAY_SECTIONS)
    assert a["problems"] == [] and rep["comparison"]["mismatches"] == []

    # numbers against the raw logs the controller wrote
    steps = read_jsonl(real_run / "replay" / "steps.jsonl")
    groups = read_jsonl(real_run / "replay" / "groups.jsonl")
    rates = [s["accept_rate"] for s in steps if s["accept_rate"] is not None]
    replayed = sum(s["accepted"] for s in steps)
    assert a["acceptance"]["n_steps"] == 30 and a["acceptance"]["n_updates"] == 29
    assert a["acceptance"]["mean_accept_rate"] == pytest.approx(sum(rates) / len(rates))
    assert a["acceptance"]["mean_rejections"] == pytest.approx(
        sum(s["scanned"] - s["accepted_gate"] for s in steps[1:]) / 29)
    assert a["scan"]["mean_scan_depth"] == pytest.approx(sum(s["scanned"] for s in steps[1:]) / 29)
    assert a["scan"]["prefix"]["n_accepted"] == replayed
    # every replay event is in some group's lifetime record; the reconstructed pool matches buffer_size
    assert a["multiplicity"]["total_replay_events"] == replayed
    assert a["multiplicity"]["n_groups"] == len(groups) == 150
    assert a["staleness"]["pool_size_mismatch_steps"] == []
    assert a["staleness"]["used"]["n"] == replayed
    assert a["staleness"]["pool"]["n"] == sum(s["buffer_size"] for s in steps)
    assert sum(b["n"] for b in a["headroom_deciles"]["bins"]) == 150 and len(a["headroom_deciles"]["bins"]) == 10
    assert a["counterfactual"]["n_steps"] == sum(1 for s in steps if s["accepted"] > 0)
    assert sum(a["counterfactual"]["quadrant_share"].values()) == pytest.approx(1.0)
    assert a["replay_kl"]["mean"] == pytest.approx(sum(s["replay_kl"] for s in steps[1:]) / 29)
    assert [p["n_steps"] for p in a["phases"]["phases"]] == [8, 8, 7, 7]
    e = a["entropy_timing"]  # hand-written log in conftest
    assert (e["t_first"], e["t_entry"], e["t_rebound"], e["delta_entry"], e["delta_rebound"]) == (16, 24, 44, 8, 20)
    md = (out / "report.md").read_text()
    for head in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## 8.", "## 9."):
        assert head in md
    assert "![acceptance](figures/acceptance.png)" in md and "| hdr |" in md


def test_report_default_out_dir_and_no_figures(real_run, capsys):
    rc, printed = run_report([real_run, "--no-figures"], capsys)
    assert rc == 0 and (real_run / "report" / "report.md").exists()
    assert not (real_run / "report" / "figures").exists() and "figure:" not in printed.out
    assert json.loads((real_run / "report" / "report.json").read_text())["figures"] == {}


def test_runs_side_by_side_with_mismatches(tmp_path, capsys):
    hdr = make_real_run(tmp_path, "hdr")
    rec = make_real_run(tmp_path, "recency", selector="recency", counterfactual=False)
    plain = make_plain_run(tmp_path, "onpolicy")
    out = tmp_path / "cmp"
    rc, printed = run_report([hdr, rec, plain, "--out", out, "--phases", "3"], capsys)
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["comparison"]["labels"] == ["hdr", "recency", "onpolicy"]
    mm = " ".join(rep["comparison"]["mismatches"])
    assert "selector differs" in mm and "runs without replay diagnostics (onpolicy)" in mm
    assert "only some runs logged the same-buffer counterfactual" in mm
    assert "note: selector differs" in printed.err
    r, p = rep["runs"]["recency"], rep["runs"]["onpolicy"]
    # recency replay ("GRPO + replay") takes the newest groups: every used source is one step old
    assert r["staleness"]["used"]["share_age_ge2"] == 0 and r["mixing"]["mean_distinct_ages"] == 1
    assert not r["scan"]["available"] and "recency" in r["scan"]["reason"]
    assert not r["counterfactual"]["available"] and r["acceptance"]["mean_budget_fill"] == 1
    assert all(not p[k]["available"] and "without replay" in p[k]["reason"] for k in REPLAY_SECTIONS)
    assert p["entropy_timing"]["t_entry"] == 24 and p["final_metrics"] == {"mean@8": 0.42}
    assert len(rep["runs"]["hdr"]["phases"]["phases"]) == 3
    for name in FIGURES:  # every figure has at least the hdr run
        assert (out / "figures" / f"{name}.png").exists()
    md = (out / "report.md").read_text()
    assert "## Comparability" in md and "| metric | hdr | recency | onpolicy |" in md
    assert "onpolicy: run without replay diagnostics" in md and "### metrics.json" in md


def test_run_without_replay_alone(tmp_path, capsys):
    plain = make_plain_run(tmp_path, "onpolicy")
    rc, _ = run_report([plain, "--out", tmp_path / "o"], capsys)
    assert rc == 0
    figs = {p.stem for p in (tmp_path / "o" / "figures").iterdir()}
    assert figs == {"entropy_timing"}
    md = (tmp_path / "o" / "report.md").read_text()
    assert "n/a: run without replay diagnostics" in md


def test_same_directory_names_get_unique_labels(tmp_path, capsys):
    a = make_real_run(tmp_path / "seed1", "run", seed=1)
    b = make_real_run(tmp_path / "seed2", "run", seed=2)
    rc, _ = run_report([a, b, "--out", tmp_path / "o", "--no-figures"], capsys)
    assert rc == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert list(rep["runs"]) == ["run", "run#2"]
    rc, _ = run_report([a, b, "--label", "s1", "--label", "s2", "--out", tmp_path / "p", "--no-figures"], capsys)
    assert rc == 0 and list(json.loads((tmp_path / "p" / "report.json").read_text())["runs"]) == ["s1", "s2"]
