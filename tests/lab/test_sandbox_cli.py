"""``hdreplay compare`` / ``demo`` end to end in a subprocess, and their bad input."""

import json
import os
import subprocess
import sys

import pytest

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
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == {"onpolicy_matched", "headroom_drift"}
    for name, m in summary["methods"].items():
        assert m["seeds"] == 2 and m["fresh_responses"] == 3 * 4 * 4
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
    assert "Headroom-Drift (b+r)" in md and "Fresh responses" in md and "±" in md
    for section in ("## What did the gate do?", "## Regime", "## Paired differences", "## Efficiency curves",
                    "## Environment"):
        assert section in md
    op, hdr = summary["methods"]["onpolicy_matched"], summary["methods"]["headroom_drift"]
    assert summary["reference"] == "headroom_drift" and "paired" in op and "paired" not in hdr
    assert op["paired"]["seeds"] == 2 and op["paired"]["lo"] <= op["paired"]["diff"] <= op["paired"]["hi"]
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
    assert sig["counterfactual"]["available"] and sig["ablation"]["available"] is False  # not all three methods
    assert "## tau decade sweep" in (out / "signatures.md").read_text()
    assert (out / sig["tau_sweep"]["figure"]).stat().st_size > 1000
    assert all((out / "plots" / n).stat().st_size > 1000 for n in pngs)
    assert sorted(summary["plots"]) == [f"plots/{n}" for n in pngs], "plot paths relative to the comparison dir"
    # the same comparison again reuses the finished runs
    again = cli("compare", "--methods", "onpolicy_matched,headroom_drift", "--seeds", "2", "--model", tiny_model,
                "--out", out, "--tau", "10", *TINY)
    assert again.returncode == 0 and "summary:" in again.stdout


def test_demo_says_what_the_gate_did_and_that_one_seed_is_not_a_verdict(tiny_model, tmp_path):
    p = cli("demo", "--model", tiny_model, "--out", tmp_path / "demo", "--tau", "10", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "not which method wins" in p.stdout
    assert "plot:" in p.stdout and (tmp_path / "demo" / "summary.md").exists()
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    gate = summary["gate"]
    assert set(gate) == {"headroom_drift", "recency_matched"}
    assert gate["recency_matched"]["replay_kl"] is not None, "recency records its (ungated) replay KL"
    assert gate["headroom_drift"]["acceptance"] is not None
    assert "What did the gate do?" in p.stdout and "Replay KL, gated vs ungated" in p.stdout
    assert "paired.png" not in {q.split("/")[-1] for q in summary["plots"]}, "no seed intervals with one seed"


@pytest.mark.parametrize("args, needle", [
    (["--methods", "onpolicy_matched,per"], "valid methods"),
    (["--task", "algebra"], "valid tasks"),
    (["--prompts-per-step", "5"], "even"),
    (["--seeds", "0"], "--seeds"),
])
def test_bad_input_is_refused_with_the_valid_choices(tmp_path, args, needle):
    p = cli("compare", "--out", tmp_path / "x", *args)
    assert p.returncode == 2 and needle in p.stderr
    assert not (tmp_path / "x").exists()


def test_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text(json.dumps({"model_type": "bert",
                                                                      "architectures": ["BertModel"]}))
    p = cli("compare", "--model", tmp_path / "notamodel", "--out", tmp_path / "o", *TINY)
    assert p.returncode == 2 and "not a causal LM" in p.stderr
    p = cli("compare", "--model", tmp_path / "missing", "--out", tmp_path / "o2", *TINY)
    assert p.returncode == 2 and "config.json" in p.stderr


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
            "--out", out, "--tau", "10", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    hdr, rec = out / "runs" / "headroom_drift" / "seed0", out / "runs" / "recency_matched" / "seed0"
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
    cal = cli("calibrate", "--model", tiny_model, "--out", tmp_path / "cal", "--steps", "3",
              "--prompts-per-step", "4", "--eval-n", "2", "--taus", "1e-3,1e-1")
    assert cal.returncode == 0, cal.stderr[-4000:]
    assert "recommendation" in cal.stdout
    runs = sorted(p for p in (tmp_path / "cal" / "runs").iterdir())
    assert [p.name for p in runs] == ["adaptive", "tau=0.001", "tau=0.1"]
    # flags may come before --summarize; everything after `calibrate` belongs to the summary
    again = cli("calibrate", "--out", tmp_path / "cal2", "--summarize", *runs[1:], "--run", "adapt", runs[0],
                "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((tmp_path / "cal2" / "calibration.json").read_text())
    assert set(summary["runs"]) == {"tau=0.001", "tau=0.1", "adapt"}
    assert summary["runs"]["adapt"]["adaptive"] and not summary["runs"]["tau=0.1"]["adaptive"]
    assert summary["recommendation"]["label"] in {"tau=0.001", "tau=0.1", None}  # never the adaptive run
    assert f"markdown: {tmp_path / 'cal2' / 'calibration.md'}" in again.stdout
    mixed = cli("calibrate", "--summarize", *runs, "--taus", "1e-2", "--out", tmp_path / "cal3")
    assert mixed.returncode == 2 and "--taus configure a new sweep" in mixed.stderr
    abbrev = cli("calibrate", "--summ", *runs, "--out", tmp_path / "cal4")
    assert abbrev.returncode == 2 and not (tmp_path / "cal4").exists(), "an abbreviation must not start training"
    summary = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert len(summary["runs"]) == 3  # two fixed taus + adaptive


def test_compare_search_reports_the_step_time_table(tmp_path):
    from hdreplay_lab.sandbox.model import build_tiny_model
    from hdreplay_lab.sandbox.search import VOCAB as SEARCH_VOCAB

    model = build_tiny_model(tmp_path / "m", chars=SEARCH_VOCAB, hidden=32, layers=1, max_positions=512)
    out = tmp_path / "s"
    p = cli("compare", "--task", "search", "--methods", "onpolicy_larger,headroom_drift", "--seeds", "1",
            "--model", model, "--out", out, "--latency-ms", "1", *TINY)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for m in summary["methods"].values():
        assert m["env_latency_ms"] == 1.0 and m["env_calls_per_step"]["mean"] is not None
        assert m["mean_step_s"]["mean"] > 0 and m["macro_mean_at_n"]["mean"] is not None
    md = (out / "summary.md").read_text()
    assert "Tool calls / step" in md and "environment latency 1 ms" in md


@pytest.mark.parametrize("taus, needle", [
    ("1e-2,abc", "expected comma-separated numbers"),
    ("-1e-2", "distinct positive finite"),
    ("1e-2,1e-2", "distinct positive finite"),
    ("nan", "distinct positive finite"),
])
def test_calibrate_refuses_bad_taus_before_training(tmp_path, taus, needle):
    p = cli("calibrate", f"--taus={taus}", "--out", tmp_path / "cal")
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "cal").exists()
