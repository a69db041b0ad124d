"""``hdreplay compare`` / ``demo`` / ``report`` / ``calibrate`` end to end in a subprocess on a tiny model (bad
flags, which need no training, are in test_cli.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hdreplay_lab.sandbox.methods import DEMO_METHODS

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

TINY = ["--steps", "3", "--prompts-per-step", "4", "--generations", "4", "--eval-n", "2", "--no-progress",
        "--curve-prompts", "3", "--curve-n", "1", "--eval-every", "2"]


def cli(*args, timeout=600):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "hdreplay_lab.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model
    from hdreplay_lab.sandbox.tasks import VOCAB

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", chars=VOCAB, hidden=32, layers=1)


def test_compare_writes_every_output(tiny_model, tmp_path):
    out = tmp_path / "cmp"
    p = cli("compare", "--methods", "onpolicy_matched,headroom_drift", "--seeds", "2", "--model", tiny_model,
            "--out", out, "--tau", "10", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)  # strict JSON
    assert set(summary["methods"]) == {"onpolicy_matched", "headroom_drift"}
    for name, m in summary["methods"].items():
        assert m["seeds"] == 2 and m["fresh_responses"]["mean"] == 3 * 4 * 4
        assert 0 <= m["macro_mean_at_n"]["mean"] <= m["macro_best_at_n"]["mean"] <= 1
        assert m["macro_mean_at_n"]["std"] is not None and m["mean_step_s"]["mean"] > 0
        for s in (0, 1):
            run = out / "runs" / name / f"seed{s}"
            for f in ("run.json", "metrics.json"):
                json.loads((run / f).read_text())
            logs = [json.loads(x) for x in open(run / "train_log.jsonl")]
            assert [r["step"] for r in logs] == [1, 2, 3] and all("reward" in r for r in logs)
            assert list((run / "trl").rglob("events.out.tfevents*")), "TensorBoard logs through TRL's report_to"
    steps = [json.loads(x) for x in open(out / "runs" / "headroom_drift" / "seed0" / "replay" / "steps.jsonl")]
    assert [s["step"] for s in steps] == [0, 1, 2]
    md = (out / "summary.md").read_text()
    assert "Headroom-Drift (b+r)" in md and "Fresh responses" in md and "±" in md and "Rows re-scored to select" in md
    for section in ("## What did the gate do?", "## Regime", "## Paired differences", "## Efficiency curves",
                    "## Environment", "Excludes 0"):
        assert section in md
    op, hdr = summary["methods"]["onpolicy_matched"], summary["methods"]["headroom_drift"]
    assert summary["reference"] == "headroom_drift" and "paired" in op and "paired" not in hdr
    assert op["paired"]["seeds"] == 2 and op["paired"]["lo"] <= op["paired"]["diff"] <= op["paired"]["hi"]
    c = op["paired"]["corrected"]  # one comparison: the Bonferroni interval is the 95 % one
    assert c["comparisons"] == 1 and (c["lo"], c["hi"]) == (op["paired"]["lo"], op["paired"]["hi"])
    # the random tiny model answers nothing right: every group zero-variance, nothing enters the buffer
    assert op["regime"]["zero_variance_share"] == hdr["regime"]["zero_variance_share"] == 1.0
    assert "acceptance" in hdr["regime"] and "acceptance" not in op["regime"]
    assert [p for p in hdr["curve"]["step"]] == [0, 2, 3] and "to_target" in hdr["curve"]
    assert summary["environment"]["workers"] == 2 and summary["environment"]["runs_trained"] == 4 + 5  # + signatures
    assert summary["prompt_order"] == {"same_order": True, "seeds": 2, "methods": 2, "mismatches": []}
    pngs = sorted(p.name for p in (out / "plots").glob("*.png") if not p.name.startswith("sig_"))
    assert pngs == ["curves.png", "heldout.png", "paired.png", "regime.png", "train_score.png"]
    sig = json.loads((out / "signatures.json").read_text())
    assert sig["tau_sweep"]["available"] and len(sig["tau_sweep"]["runs"]) == 3
    assert sig["ablation"]["available"] is False  # not all three methods
    # the counterfactual run re-scores recency's subset only on steps that replay something; with every group
    # zero-variance nothing does, so the quadrant is reported unavailable rather than made up
    cf_run = json.loads((out / "signatures" / "counterfactual" / "run.json").read_text())
    assert cf_run["replay"]["counterfactual"] is True and sig["counterfactual"]["available"] is False
    assert "## tau decade sweep" in (out / "signatures.md").read_text()
    assert (out / sig["tau_sweep"]["figure"]).stat().st_size > 1000
    assert all((out / "plots" / n).stat().st_size > 1000 for n in pngs)
    assert sorted(summary["plots"]) == [f"plots/{n}" for n in pngs], "plot paths relative to the comparison dir"
    # the same comparison again reuses the finished runs
    again = cli("compare", "--methods", "onpolicy_matched,headroom_drift", "--seeds", "2", "--model", tiny_model,
                "--out", out, "--tau", "10", *TINY)
    assert again.returncode == 0 and "summary:" in again.stdout


def test_demo_runs_the_three_demo_methods_once_and_says_what_the_gate_did(tiny_model, tmp_path):
    p = cli("demo", "--model", tiny_model, "--out", tmp_path / "demo", "--tau", "10", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "not which method wins" in p.stdout
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert list(summary["methods"]) == list(DEMO_METHODS) and summary["config"]["seeds"] == 1
    assert all(m["seeds"] == 1 for m in summary["methods"].values())
    plots = [line.split("plot:", 1)[1].strip() for line in p.stdout.splitlines() if line.startswith("plot:")]
    # one seed: no seed intervals (paired.png), no signature runs
    assert sorted(Path(x).name for x in plots) == ["curves.png", "heldout.png", "regime.png", "train_score.png"]
    assert all(Path(x).is_file() for x in plots) and not (tmp_path / "demo" / "signatures").exists()
    assert set(summary["gate"]) == {"headroom_drift", "recency_matched"} and "What did the gate do?" in p.stdout
    md = (tmp_path / "demo" / "summary.md").read_text()
    assert "Excludes 0" not in md, "one seed: no paired-interval table (the compare test checks it is there)"
    runs = tmp_path / "demo" / "runs"
    replay = {m: json.loads((runs / m / "seed0" / "run.json").read_text())["replay"] for m in DEMO_METHODS}
    assert replay["recency_matched"]["diagnose_ungated"] is True, "recency records its (ungated) replay KL"
    assert replay["headroom_drift"]["diagnose_ungated"] is False


def test_output_dir_with_a_different_run_is_refused_unless_overwrite(tiny_model, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    p = cli("compare", "--model", tiny_model, "--out", out, "--methods", "onpolicy_matched", "--seeds", "1", *TINY)
    assert p.returncode == 2 and "--overwrite" in p.stderr
    assert (out / "precious.txt").read_text() == "keep me"
    ok = cli("compare", "--model", tiny_model, "--out", tmp_path / "c", "--methods", "onpolicy_matched",
             "--seeds", "1", *TINY)
    assert ok.returncode == 0
    before = (tmp_path / "c" / "summary.json").read_text()
    other = cli("compare", "--model", tiny_model, "--out", tmp_path / "c", "--methods", "onpolicy_matched",
                "--seeds", "1", "--lr", "0.5", *TINY)
    assert other.returncode == 2 and "differs in ['lr']" in other.stderr
    assert (tmp_path / "c" / "summary.json").read_text() == before


def test_report_and_calibrate_on_real_sandbox_runs(tiny_model, tmp_path):
    """hdreplay report on real TRL sandbox runs (one and two side by side) and a tiny calibrate sweep."""
    out = tmp_path / "cmp"
    p = cli("compare", "--methods", "recency_matched,headroom_drift", "--seeds", "1", "--model", tiny_model,
            "--out", out, "--tau", "10", "--no-signatures", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    assert not (out / "signatures").exists(), "--no-signatures: no signature runs"
    hdr, rec = out / "runs" / "headroom_drift" / "seed0", out / "runs" / "recency_matched" / "seed0"
    # nothing was replayed (every group zero-variance): no age mixture to compare, and no invented one
    sig = json.loads((out / "signatures.json").read_text())  # written from the main runs alone here
    assert sig["ages"]["available"] is False and sig["tau_sweep"]["available"] is False
    r = cli("report", hdr, "--out", tmp_path / "rep1", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "rep1" / "report.json").read_text())
    (label, run), = rep["runs"].items()
    assert run["acceptance"]["available"] and run["acceptance"]["n_steps"] == 3
    assert (tmp_path / "rep1" / "report.md").read_text().startswith("#")
    assert list((tmp_path / "rep1" / "figures").glob("*.png"))
    both = cli("report", hdr, rec, "--out", tmp_path / "rep2", "--no-progress")
    assert both.returncode == 0, both.stderr[-3000:]
    assert len(json.loads((tmp_path / "rep2" / "report.json").read_text())["runs"]) == 2
    bad = cli("report", tmp_path / "nothing-here")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    cal = cli("calibrate", "run", "--model", tiny_model, "--out", tmp_path / "cal", "--steps", "3",
              "--prompts-per-step", "4", "--eval-n", "2", "--taus", "1e-3,1e-1", "--no-progress")
    assert cal.returncode == 0, cal.stderr[-4000:]
    runs = sorted(p for p in (tmp_path / "cal" / "runs").iterdir())
    assert [p.name for p in runs] == ["adaptive", "tau=0.001", "tau=0.1"]
    summary = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert {k: (r["tau"], r["adaptive"]) for k, r in summary["runs"].items()} == {
        "tau=0.001": (1e-3, False), "tau=0.1": (1e-1, False), "adaptive": (1e-1, True)}  # starts mid-sweep
    assert summary["runs"]["adaptive"]["tau_trajectory"]["min"] >= 1e-3  # adaptive stays within the tested taus
    assert summary["runs"]["adaptive"]["tau_trajectory"]["max"] <= 1e-1
    check_recommendation(summary)
    printed = [line for line in cal.stdout.splitlines() if line.startswith("recommendation: ")]
    assert len(printed) == 1 and printed[0].split()[1] == summary["recommendation"]["status"]
    # the gate's noise floor on the calibrated model, per bf16 precision, against the smallest tau
    floor = json.loads((tmp_path / "cal" / "drift_floor.json").read_text())
    assert set(floor["drift"]) == {"bf16_autocast", "bf16_weights"} and floor["taus"] == [1e-3, 1e-1]
    lines = [line for line in cal.stdout.splitlines() if line.startswith("drift floor: ")]
    assert [line.split()[2] for line in lines] == ["bf16_autocast:", "bf16_weights:"] and lines == [
        f"drift floor: {x}" for x in floor["report"]]
    assert all("x tau 0.001" in line for line in lines)
    for by_norm in floor["drift"].values():
        assert set(by_norm["l2"]) == {"batch", "padding", "chunking", "shared_prompt"}
        assert max(max(v) for v in by_norm["l2"].values()) > 0  # bf16 re-layouts are not bit-identical
    # the summary of finished runs, labelled; the same decision rule
    again = cli("calibrate", "summarize", *runs, "--label", "adapt", "--label", "tau=0.001", "--label", "tau=0.1",
                "--out", tmp_path / "cal2", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    summary2 = json.loads((tmp_path / "cal2" / "calibration.json").read_text())
    assert set(summary2["runs"]) == {"tau=0.001", "tau=0.1", "adapt"} and summary2["runs"]["adapt"]["adaptive"]
    check_recommendation(summary2)
    assert f"markdown: {tmp_path / 'cal2' / 'calibration.md'}" in again.stdout
    abbrev = cli("calibrate", "summ", *runs, "--out", tmp_path / "cal4")
    assert abbrev.returncode == 2 and not (tmp_path / "cal4").exists(), "an abbreviation must not start anything"


def check_recommendation(summary):
    """The decision is consistent with the runs' statuses: a viable fixed-tau run is chosen when there is one, the
    adaptive run never, and every other fixed run is ruled out with its status."""
    rec, runs = summary["recommendation"], summary["runs"]
    fixed = {k: r for k, r in runs.items() if not r["adaptive"]}
    viable = [k for k, r in fixed.items() if r["status"] == "viable"]
    assert rec["ruled_out"] == {k: r["status"] for k, r in fixed.items() if r["status"] != "viable"}
    if viable:
        assert rec["status"] == "selected" and rec["label"] in viable and rec["viable"] == viable
        assert rec["tau"] == fixed[rec["label"]]["tau"]
    else:
        assert rec["status"] != "selected" and rec["label"] is None


def test_compare_runs_the_peer_strategies_and_reports_their_costs(tiny_model, tmp_path):
    from hdreplay_lab.sandbox.methods import STRATEGY_METHODS

    helptext = cli("compare", "--help").stdout
    assert all(name in helptext for name in STRATEGY_METHODS)
    out = tmp_path / "strategies"
    p = cli("compare", "--methods", "uniform_fifo,adv_priority,dapo_dynamic,bapo,popo", "--seeds", "1",
            "--model", tiny_model, "--out", out, *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    ms = json.loads((out / "summary.json").read_text())["methods"]
    logs = {k: [json.loads(x) for x in open(out / "runs" / k / "seed0" / "train_log.jsonl")] for k in ms}
    # b = 4 groups of n = 4 per step, 3 steps; uniform FIFO (ingress all) replays r = 2 groups from step 1 on
    assert ms["uniform_fifo"]["fresh_responses"]["mean"] == 48
    assert ms["uniform_fifo"]["replayed_groups"]["mean"] == 2 * 2
    assert ms["uniform_fifo"]["rescored_rows"]["mean"] == 0
    # dynamic sampling: every generation round counted (the untrained tiny model's groups are often all-zero)
    gen = sum(r["dynamic/generated_rows"] for r in logs["dapo_dynamic"])
    assert ms["dapo_dynamic"]["fresh_responses"]["mean"] == gen >= 48
    assert gen == 16 * sum(r["dynamic/rounds"] for r in logs["dapo_dynamic"])
    # the held-out curve's cost axis counts the discarded rounds too (its last point is after step 3)
    curves = {k: [json.loads(x) for x in open(out / "runs" / k / "seed0" / "curve.jsonl")] for k in ms}
    assert curves["dapo_dynamic"][-1]["step"] == 3 and curves["dapo_dynamic"][-1]["fresh_responses"] == gen
    assert ([c["fresh_responses"] for c in curves["uniform_fifo"]]
            == [48 * c["step"] // 3 for c in curves["uniform_fifo"]])
    replayed = sum(r.get("replay/replayed_rows") or 0 for r in logs["adv_priority"])
    assert ms["adv_priority"]["replayed_groups"]["mean"] == replayed / 4
    # BAPO: every generated response counted (the b groups, plus n per re-evaluated prompt on even steps)
    bapo = logs["bapo"]
    assert [r["dynamic/generated_rows"] for r in bapo] == [16 + 4 * r["bapo/reeval_prompts"] for r in bapo]
    assert bapo[0]["bapo/reeval_prompts"] == bapo[2]["bapo/reeval_prompts"] == 0  # BAPO's steps 1 and 3
    assert ms["bapo"]["fresh_responses"]["mean"] == sum(r["dynamic/generated_rows"] for r in bapo)
    assert ms["bapo"]["replayed_groups"]["mean"] == sum(r["replay/replayed_rows"] for r in bapo) / 4
    # POPO: no extra generation; it replays (and re-scores, for the proximal log-probs) as many stored groups as it
    # swaps out zero-variance fresh groups, never more than it has stored (nothing at step 0)
    popo = logs["popo"]
    assert ms["popo"]["fresh_responses"]["mean"] == 48
    assert popo[0]["replay/accepted"] == 0 and all(r["replay/accepted"] <= r["popo/ineffective"] for r in popo)
    assert ms["popo"]["replayed_groups"]["mean"] == sum(r["replay/replayed_rows"] for r in popo) / 4
    assert ms["popo"]["rescored_rows"]["mean"] == sum(r["replay/replayed_rows"] for r in popo)
    assert "Groups replayed" in (out / "summary.md").read_text()


def _refuse(token):
    raise ValueError(f"summary.json holds the non-standard JSON token {token}")
