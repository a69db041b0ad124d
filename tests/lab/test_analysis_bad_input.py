"""Bad input: JSONL lines cut short (skip or stop, naming file:line) and malformed ones (refused), empty and non-run
directories, a directory where a log belongs, runs without usable replay records, bad settings (more unreadable
inputs: test_report_unreadable.py).  Never a
traceback from the entry point: one line on stderr and exit status 2."""

import json
import shutil

import pytest

from hdreplay_lab.analysis import AnalysisInputError, BadLineWarning, load_run, read_jsonl
from hdreplay_lab.cli import main


def run_report(args, capsys):
    rc = main(["report", *map(str, args), "--no-progress", "--no-figures"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out


def one_error_line(err: str, needle: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("hdreplay report: error:") and needle in lines[0], err


def test_truncated_line_is_skipped_with_a_warning_naming_file_and_line(real_run, tmp_path, capsys):
    steps = real_run / "replay" / "steps.jsonl"
    with open(steps, "a") as f:
        f.write('{"step": 30, "selector": "headr')  # a crash mid-write: no closing brace, no newline
    rc, out = run_report([real_run, "--out", tmp_path / "o"], capsys)
    assert rc == 0
    assert f"warning: {steps}:31: not valid JSON" in out.err and "line skipped" in out.err
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["runs"]["hdr"]["acceptance"]["n_steps"] == 30  # the good lines are all used
    assert any(f"{steps}:31" in p for p in rep["runs"]["hdr"]["problems"])
    assert "## Data problems" in (tmp_path / "o" / "report.md").read_text()


def test_stop_on_bad_line_exits_2_with_file_and_line(real_run, tmp_path, capsys):
    groups = real_run / "replay" / "groups.jsonl"
    lines = groups.read_text().splitlines(keepends=True)
    lines[4] = lines[4][:25] + "\n"  # a record cut short (a crash, then a resumed writer on a new line)
    groups.write_text("".join(lines))
    rc, out = run_report([real_run, "--out", tmp_path / "o", "--on-bad-line", "stop"], capsys)
    assert rc == 2 and f"{groups}:5: not valid JSON" in out.err and "--on-bad-line skip" in out.err
    assert not (tmp_path / "o" / "report.md").exists()
    rc, out = run_report([real_run, "--out", tmp_path / "o"], capsys)
    assert rc == 0 and f"{groups}:5" in out.err
    # a line that is no record cut short is refused whatever the policy
    lines[4] = "this is not json\n"
    groups.write_text("".join(lines))
    for policy in ("skip", "stop"):
        rc, out = run_report([real_run, "--out", tmp_path / "o2", "--on-bad-line", policy], capsys)
        assert rc == 2 and f"{groups}:5: not a JSON object" in out.err and not (tmp_path / "o2").exists()


def test_empty_missing_file_and_non_run_directories(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    (tmp_path / "file.jsonl").write_text("{}\n")
    for path, msg in ((tmp_path / "empty", "the directory is empty"), (tmp_path / "missing", "no such directory"),
                      (tmp_path / "other", "not a run directory"), (tmp_path / "file.jsonl", "not a directory")):
        rc, out = run_report([path], capsys)
        assert rc == 2, (path, out.err)
        one_error_line(out.err, msg)


def test_a_directory_where_a_log_belongs_is_an_error_not_a_run_without_replay(real_run, tmp_path, capsys):
    steps = real_run / "replay" / "steps.jsonl"
    steps.unlink()
    steps.mkdir()
    rc, out = run_report([real_run, "--out", tmp_path / "o"], capsys)
    assert rc == 2 and not (tmp_path / "o").exists()
    one_error_line(out.err, f"{steps}: expected a file, found a directory")


def test_output_path_that_is_a_file_is_refused_before_anything_is_written(real_run, tmp_path, capsys):
    (tmp_path / "taken").write_text("keep")
    rc, out = run_report([real_run, "--out", tmp_path / "taken"], capsys)
    assert rc == 2 and (tmp_path / "taken").read_text() == "keep"
    one_error_line(out.err, "is a file")


def test_replay_dir_without_usable_records_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "replay").mkdir(parents=True)
    steps = run / "replay" / "steps.jsonl"
    steps.write_text('[1, 2]\n{"step": 0, "selec')  # no object, a crash mid-write
    rc, out = run_report([run, "--out", tmp_path / "o"], capsys)
    err = [x for x in out.err.splitlines() if x.strip()]
    assert rc == 2 and not (tmp_path / "o").exists()
    assert "1 malformed record(s)" in err[0] and err[1:] == [f"{steps}:1: expected a JSON object, got list; fix or "
                                                             "remove this line"]
    steps.write_text('{"step": 0, "selec')  # only a record cut short: nothing to analyse
    rc, out = run_report([run, "--out", tmp_path / "o"], capsys)
    one_error_line(out.err, f"{steps}: holds no record (1 line(s) cut short)")


def test_records_with_wrong_typed_fields_exit_2_with_one_line_each_and_nothing_written(real_run, tmp_path, capsys):
    steps = real_run / "replay" / "steps.jsonl"
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    edits = {2: ("step", "seven"), 5: ("accepted", "three"), 7: ("tau", [1]), 9: ("buffer_size", None),
             11: ("scan_drift", ["x"]), 13: ("scan_capped", 1), 15: ("selector", 3)}
    for i, (k, v) in edits.items():
        lines[i][k] = v
    steps.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, out = run_report([real_run, "--out", tmp_path / "o"], capsys)
    err = [x for x in out.err.splitlines() if x.strip()]
    assert rc == 2 and not (tmp_path / "o").exists()
    assert err[0].startswith("hdreplay report: error:") and "7 malformed record(s)" in err[0]
    assert [x.split(": ", 1)[0] for x in err[1:]] == [f"{steps}:{i + 1}" for i in edits]
    for x, (k, _) in zip(err[1:], edits.values()):
        assert f"'{k}' must be" in x, x


def test_bad_settings_and_labels_exit_2(real_run, capsys):
    for args, needle in ((["--entropy-low", "0.05", "--entropy-high", "0.04"], "H_L"),
                         (["--label", "a", "--label", "b"], "2 --label values for 1 run"),
                         (["--phase-bounds", "20,10"], "--phase-bounds"), (["--phase-bounds", "x"], "--phase-bounds"),
                         (["--kl-window", "0"], "--kl-window"), (["--phases", "-1"], "--phases"),
                         (["--score-anchor", "nan"], "--score-anchor"), (["--on-bad-line", "ignore"], "'skip'"),
                         (["--no-such-flag"], "--no-such-flag")):
        rc, out = run_report([real_run, *args], capsys)
        assert rc == 2, args
        one_error_line(out.err, needle)
    assert not (real_run / "report").exists()


def test_read_jsonl_checks_records_and_policy(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"step": 0, "accepted": 1}\n\n[1, 2]\n{"step": 1, "scan_age": [1, 2], "scan_pass": [true]}\n'
                 '{"step": 2, "accepted": 0}\n{"step": 3}\n')
    problems = []
    from hdreplay_lab.analysis.load import check_step_record
    recs = read_jsonl(p, check=check_step_record, problems=problems)
    assert recs["step"].tolist() == [0, 2]
    assert problems[0].startswith(f"{p}:3: expected a JSON object, got list")
    assert problems[1].startswith(f"{p}:4: scan lists have different lengths")
    assert problems[2].startswith(f"{p}:6: holds only 'step'")  # no StepRecord field: not a step record
    with pytest.raises(AnalysisInputError, match=f"{p}:3"):
        read_jsonl(p, check=check_step_record, on_bad_line="stop")
    with pytest.raises(AnalysisInputError, match="on_bad_line"):
        read_jsonl(p, on_bad_line="ignore")


def test_load_run_details(real_run, tmp_path):
    # repeated step records (a resumed run without rewind): the last one wins, noted as a problem
    steps = real_run / "replay" / "steps.jsonl"
    lines = steps.read_text().splitlines(keepends=True)
    steps.write_text("".join(lines + [lines[-1].replace('"budget_fill":1.0', '"budget_fill":0.5'), lines[0][:20]]))
    with pytest.warns(BadLineWarning) as caught:
        run = load_run(real_run)
    assert sorted(str(w.message).split(": ")[0].rsplit("/", 1)[1] for w in caught) == [
        "steps.jsonl", "steps.jsonl:32"]  # the repeated record, the line cut short
    assert len(run.steps) == 30 and run.steps["budget_fill"].iloc[-1] == 0.5 and run.meta["method"] == "headroom_drift"
    assert any("repeated step record" in p for p in run.problems)
    with pytest.raises(AnalysisInputError, match="steps.jsonl:32"):
        load_run(real_run, on_bad_line="stop")
    # a JSON file that does not parse is refused, not ignored, under either policy
    steps.write_text("".join(lines))
    (real_run / "run.json").write_text("{not json")
    for policy in ("skip", "stop"):
        with pytest.raises(AnalysisInputError, match="run.json: not valid JSON"):
            load_run(real_run, on_bad_line=policy)
    # a bare diagnostics directory (what ReplayController(diagnostics_dir=...) writes) is a run too
    bare = tmp_path / "bare"
    shutil.copytree(real_run / "replay", bare)
    run = load_run(bare, warn=False)
    assert run.has_replay and run.replay_dir == bare and run.label == "bare" and len(run.groups) == 150


def test_unique_labels_skip_taken_suffixes():
    from hdreplay_lab.analysis.load import unique_labels
    assert unique_labels(["a", "a#2", "a", "b", "a"]) == ["a", "a#2", "a#3", "b", "a#4"]
