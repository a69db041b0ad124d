"""``hdreplay report`` end to end on REAL run directories written by the core ReplayController (TablePolicy,
counterfactual=True) with a hand-written trainer log: one run, runs side by side, a run without replay.  The
numbers are checked against plain-Python recomputations from the raw JSONL (no pandas, no analysis code)."""

import json
import statistics

import pytest

from analysis_runs import make_plain_run, make_real_run, read_jsonl
from hdreplay_lab.analysis.report import REPLAY_SECTIONS
from hdreplay_lab.cli import main

FIGURES = ("acceptance", "replay_kl", "scan", "age", "headroom_deciles", "multiplicity", "counterfactual",
           "entropy_timing", "phases")
SECTIONS = ("info", "problems", "training", "final_metrics", "entropy_timing", *REPLAY_SECTIONS)


def run_report(args, capsys):
    rc = main(["report", *map(str, args), "--no-progress"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out


def thirds(xs):
    """Means of three contiguous pieces, the first ones one longer when the count does not divide."""
    n, k = len(xs), [len(xs) // 3 + (i < len(xs) % 3) for i in range(3)]
    cut = [0, k[0], k[0] + k[1], n]
    return [sum(xs[a:b]) / (b - a) for a, b in zip(cut, cut[1:])]


def oracle(steps, groups):
    """The report's key numbers, recomputed with loops over the raw records."""
    upd = [s for s in steps if s["buffer_size"] > 0]
    used = [a for s in steps for a in s["accepted_ages"]]
    pool = [s["step"] - g["birth_step"] for s in upd for g in groups
            if g["birth_step"] < s["step"] and (g["evicted_step"] is None or g["evicted_step"] >= s["step"])]
    rel = []
    for s in upd:
        passes = [i + 1 for i, ok in enumerate(s["scan_pass"]) if ok][:s["accepted"]]
        rel += [r / s["buffer_size"] for r in passes]
    order = sorted(groups, key=lambda g: (g["ref_headroom"], g["insertion_id"]))
    bins = [order[i * 15:(i + 1) * 15] for i in range(10)]  # 150 groups, 10 bins
    cf = [(s["cf_drift_recency"] - s["cf_drift_selected"], s["cf_headroom_selected"] - s["cf_headroom_recency"])
          for s in steps if s.get("cf_drift_selected") is not None]
    return {
        "accept_thirds": thirds([s["accept_rate"] for s in upd]),
        "pooled": sum(s["accepted_gate"] for s in upd) / sum(s["scanned"] for s in upd),
        "fill": statistics.mean(s["budget_fill"] for s in upd),
        "kl_thirds": thirds([s["replay_kl"] for s in upd]),
        "used_mean": statistics.mean(used), "pool_mean": statistics.mean(pool), "pool_n": len(pool),
        "pool_ge2": sum(a >= 2 for a in pool) / len(pool),
        "prefix_25": sum(r <= 0.25 for r in rel) / len(rel),
        "deciles": [statistics.mean(g["replay_count"] for g in b) for b in bins],
        "never": sum(g["replay_count"] == 0 for g in groups) / len(groups),
        "both": sum(x > 0 and y > 0 for x, y in cf) / len(cf),
        "distinct": statistics.mean(len(set(s["accepted_ages"])) for s in steps if s["accepted_ages"]),
    }


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

    steps = read_jsonl(real_run / "replay" / "steps.jsonl")
    groups = read_jsonl(real_run / "replay" / "groups.jsonl")
    o = oracle(steps, groups)
    assert a["acceptance"]["n_steps"] == 30 and a["acceptance"]["n_updates"] == 29
    assert list(a["acceptance"]["by_interval"]["accept_rate"].values()) == pytest.approx(o["accept_thirds"])
    assert a["acceptance"]["pooled_accept_rate"] == pytest.approx(o["pooled"])
    assert a["acceptance"]["mean_budget_fill"] == pytest.approx(o["fill"])
    assert list(a["replay_kl"]["by_interval"].values()) == pytest.approx(o["kl_thirds"])
    assert a["staleness"]["used"]["mean"] == pytest.approx(o["used_mean"])
    assert (a["staleness"]["pool"]["n"], a["staleness"]["pool"]["mean"]) == (o["pool_n"], pytest.approx(o["pool_mean"]))
    assert a["staleness"]["pool"]["share_age_ge2"] == pytest.approx(o["pool_ge2"])
    assert a["staleness"]["pool_size_mismatch_steps"] == []  # the reconstructed pool matches buffer_size
    assert a["scan"]["prefix"]["share_at"]["0.25"] == pytest.approx(o["prefix_25"])
    assert [b["mean_replay_count"] for b in a["headroom_deciles"]["bins"]] == pytest.approx(o["deciles"])
    assert a["multiplicity"]["share_never_replayed"] == pytest.approx(o["never"])
    assert a["multiplicity"]["total_replay_events"] == sum(s["accepted"] for s in steps)
    assert a["counterfactual"]["quadrant_share"]["both"] == pytest.approx(o["both"])
    assert a["mixing"]["mean_distinct_ages"] == pytest.approx(o["distinct"])
    assert [p["n_steps"] for p in a["phases"]["phases"]] == [8, 8, 7, 7]
    e = a["entropy_timing"]  # hand-written log in analysis_runs.py
    assert (e["t_first"], e["t_entry"], e["t_rebound"], e["delta_entry"], e["delta_rebound"]) == (16, 24, 44, 8, 20)
    assert a["info"]["selector"] == "headroom_drift" and a["info"]["capacity"] == 12 and a["info"]["k_rep"] == 3

    md = (out / "report.md").read_text()
    for head in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## 8.", "## 9."):
        assert head in md
    assert "![acceptance](figures/acceptance.png)" in md
    # the markdown shows the JSON's numbers: the pooled acceptance row of section 1
    row = next(x for x in md.splitlines() if x.startswith("| pooled acceptance rate"))
    assert [c.strip() for c in row.strip("|").split("|")] == ["pooled acceptance rate", f"{100 * o['pooled']:.1f}%"]


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
    header = next(x for x in md.splitlines() if x.startswith("| metric") and "onpolicy" in x)
    assert [c.strip() for c in header.strip("|").split("|")] == ["metric", "hdr", "recency", "onpolicy"]
    assert "## Comparability" in md and "onpolicy: run without replay diagnostics" in md and "### metrics.json" in md


def test_run_without_replay_alone(tmp_path, capsys):
    plain = make_plain_run(tmp_path, "onpolicy")
    rc, _ = run_report([plain, "--out", tmp_path / "o"], capsys)
    assert rc == 0
    assert {p.stem for p in (tmp_path / "o" / "figures").iterdir()} == {"entropy_timing"}
    assert "n/a: run without replay diagnostics" in (tmp_path / "o" / "report.md").read_text()


def test_same_directory_names_get_unique_labels(tmp_path, capsys):
    a = make_real_run(tmp_path / "seed1", "run", seed=1)
    b = make_real_run(tmp_path / "seed2", "run", seed=2)
    rc, _ = run_report([a, b, "--out", tmp_path / "o", "--no-figures"], capsys)
    assert rc == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert list(rep["runs"]) == ["run", "run#2"]
    rc, _ = run_report([a, b, "--label", "s1", "--label", "s2", "--out", tmp_path / "p", "--no-figures"], capsys)
    assert rc == 0 and list(json.loads((tmp_path / "p" / "report.json").read_text())["runs"]) == ["s1", "s2"]
