"""The eight inputs of issue 39 (item 4) that ``hdreplay`` took without a word (exit 0): each now exits 2 with one
line per problem naming the file / field / option and the fix, nothing written -- or, where the input is usable,
runs and says on stderr what it left out."""

from __future__ import annotations

import json
import shutil

from hdreplay_lab.cli import main

R, G = "replay/steps.jsonl", "replay/groups.jsonl"


def report(run, out, capsys, *args):
    rc = main(["report", str(run), "--out", str(out), "--no-progress", "--no-figures", *map(str, args)])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, [x for x in cap.err.splitlines() if x.strip()]


def edit_line(path, i, **change):
    """Line ``i`` (0-based) of a JSONL file with ``change`` merged in (NaN / inf written as json.dumps writes them)."""
    lines = path.read_text().splitlines()
    lines[i] = json.dumps({**json.loads(lines[i]), **change})
    path.write_text("\n".join(lines) + "\n")


def refused(rc, err, out, *needles):
    """Exit 2, nothing written, every line an error, and for each needle a line holding it."""
    assert rc == 2 and not out.exists(), err
    assert err[0].startswith("hdreplay report: error:") and not any(x.startswith(("warning:", "note:")) for x in err)
    for needle in needles:
        assert any(needle in x for x in err), (needle, err)


def test_nan_and_infinity_literals_in_steps_jsonl_exit_2_naming_line_and_field(real_run, tmp_path, capsys):
    steps = real_run / R
    edit_line(steps, 3, tau=float("nan"))
    edit_line(steps, 6, budget_fill=float("inf"), drift_accepted=float("-inf"))
    recs = [json.loads(x) for x in steps.read_text().splitlines()]
    i = next(i for i, r in enumerate(recs) if i > 6 and r["scan_drift"])  # a step that scanned groups
    edit_line(steps, i, scan_drift=[float("nan")] * len(recs[i]["scan_drift"]))
    rc, err = report(real_run, tmp_path / "o", capsys)
    refused(rc, err, tmp_path / "o", "3 malformed record(s)", f"{steps}:4: 'tau' is NaN",
            f"{steps}:7: 'budget_fill' is Infinity", f"{steps}:{i + 1}: 'scan_drift'")
    assert all("null" in x for x in err[1:]), err  # the fix: hdreplay writes a non-finite value as null


def test_steps_records_holding_only_step_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "replay").mkdir(parents=True)
    (run / R).write_text("".join(json.dumps({"step": i}) + "\n" for i in range(3)))
    rc, err = report(run, tmp_path / "o", capsys)
    refused(rc, err, tmp_path / "o", "3 malformed record(s)", *(f"{run / R}:{i}: holds only 'step'" for i in (1, 2, 3)))


def test_run_with_only_a_training_log_reports_and_says_it_has_no_replay_diagnostics(real_run, tmp_path, capsys):
    shutil.rmtree(real_run / "replay")
    (real_run / "run.json").unlink()
    rc, err = report(real_run, tmp_path / "o", capsys)
    assert rc == 0 and (tmp_path / "o" / "report.md").exists(), err
    assert len(err) == 1 and err[0].startswith(f"note: {real_run}: no replay diagnostics"), err
    assert "replay/steps.jsonl" in err[0] and "trainer log" in err[0]


def test_groups_jsonl_exposure_of_the_wrong_type_exits_2(real_run, tmp_path, capsys):
    edit_line(real_run / G, 2, exposure="x")
    rc, err = report(real_run, tmp_path / "o", capsys)
    refused(rc, err, tmp_path / "o", f"{real_run / G}:3: 'exposure' must be a number or null, got 'x'")


def test_metrics_json_with_wrong_types_exits_2_naming_each_field(real_run, tmp_path, capsys):
    metrics = {"format": "hdreplay.sandbox.metrics/2", "method": "headroom_drift", "seed": "0", "n": 4,
               "macro_mean_at_n": "high", "macro_best_at_n": [0.5], "benchmarks": {}}
    (real_run / "metrics.json").write_text(json.dumps(metrics))
    rc, err = report(real_run, tmp_path / "o", capsys)
    m = real_run / "metrics.json"
    refused(rc, err, tmp_path / "o", f"{m}: 'seed' must be an int", f"{m}: 'macro_mean_at_n' must be a number",
            f"{m}: 'macro_best_at_n' must be a number")
    # a metrics.json the lab did not write: usable, its values that are not numbers are named as left out
    (real_run / "metrics.json").write_text(json.dumps({"mean@8": "0.42", "best@8": [1, 2], "acc": 0.5, "x": None}))
    rc, err = report(real_run, tmp_path / "o", capsys)
    assert rc == 0 and len(err) == 1 and err[0].startswith(f"note: {m}: left out of the final-metrics table"), err
    assert "'mean@8' (a string)" in err[0] and "'best@8' (a list)" in err[0] and "'acc'" not in err[0]


def test_more_phases_than_replay_steps_exits_2(real_run, tmp_path, capsys):
    rc, err = report(real_run, tmp_path / "o", capsys, "--phases", "1000")
    refused(rc, err, tmp_path / "o", "--phases 1000", "30 replay step records")
    assert len(err) == 1 and "--phases 30 or fewer" in err[0], err


def test_score_key_no_log_entry_has_exits_2_listing_the_keys(real_run, tmp_path, capsys):
    rc, err = report(real_run, tmp_path / "o", capsys, "--score-key", "nope")
    refused(rc, err, tmp_path / "o", "--score-key nope", f"{real_run / 'train_log.jsonl'}")
    assert len(err) == 1 and "'reward'" in err[0] and "'entropy'" in err[0], err
    rc, err = report(real_run, tmp_path / "o", capsys, "--entropy-key", "H")
    refused(rc, err, tmp_path / "o", "--entropy-key H")


def test_explain_adv_priority_says_it_replays_single_rollouts(capsys):
    assert main(["explain", "--selector", "adv_priority", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "adv_priority stores single rollouts" in out and "tau is not used" in out, out
    assert "step 1: buffer holds 12 rollouts (3 groups' worth)" in out, out
    assert "actor batch = 12 replayed rollouts (3 groups' worth) + 4 fresh groups" in out, out
