"""``hdreplay report`` on inputs it cannot read as a run: exit 2, one line per problem (naming the file, the line or
field, and what to do), nothing written -- and, beside them, the inputs that are legitimately readable (a torn last
line, a plain TRL output directory, TensorBoard events, an empty groups.jsonl after a rewind, an on-policy run, a
bare diagnostics directory, a run of the policy-lag sandbox without replay) still exit 0.

Each bad input was found by fuzzing the command with damaged copies of a real run directory (missing, empty,
foreign, truncated files; wrong types; non-JSON; directories, FIFOs and dangling links in place of files)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hdreplay_lab.cli import main

R, G = "replay/steps.jsonl", "replay/groups.jsonl"


def report(run, out, capsys):
    rc = main(["report", str(run), "--out", str(out), "--no-progress", "--no-figures"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, [x for x in err.splitlines() if x.strip()]


def w(p, s):
    p.parent.mkdir(parents=True, exist_ok=True)
    (p.write_bytes if isinstance(s, bytes) else p.write_text)(s)


def rm(p):
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def keep_only(d, *names):
    for x in list(d.iterdir()):
        if x.name not in names:
            rm(x)


def plain_trl(d, state):
    """A plain TRL output directory: only trainer_state.json (``state``: its text)."""
    keep_only(d)
    w(d / "trainer_state.json", state)


def first_step_line(d):
    return (d / R).read_text().splitlines()[0]


def insert_line(path, i, line):
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(i, line + "\n")
    path.write_text("".join(lines))


def edit_run_json(d, **change):
    meta = json.loads((d / "run.json").read_text())
    for k, v in change.items():
        if "." in k:
            meta["replay"][k.split(".")[1]] = v
        else:
            meta[k] = v
    w(d / "run.json", json.dumps(meta))


# name -> (damage, text one error line must hold).  The comment after each says what the old code did:
# "silent" = exit 0 without a word, "warn" = exit 0 with warnings only, "trace" = a traceback, "vague" = exit 2 with
# an OS message that names neither what is wrong nor the fix.
BAD = {
    # a run directory holding no data at all
    "run_json_only": (lambda d: (rm(d / "replay"), rm(d / "train_log.jsonl")),  # silent
                      "nothing to analyse"),
    # empty files and files with no complete record
    "steps_empty": (lambda d: w(d / R, ""), "steps.jsonl: holds no record"),  # silent
    "steps_blank_lines": (lambda d: w(d / R, "\n\n  \n"), "steps.jsonl: holds no record"),  # silent
    "steps_only_torn_line": (lambda d: w(d / R, first_step_line(d)[:30]), "steps.jsonl: holds no record"),  # warn
    "bare_diagnostics_steps_empty": (lambda d: (keep_only(d, "replay"), w(d / R, "")),  # silent
                                     "steps.jsonl: holds no record"),
    "train_log_empty": (lambda d: w(d / "train_log.jsonl", ""), "train_log.jsonl: holds no record"),  # silent
    "fresh_groups_empty": (lambda d: w(d / "fresh_groups.jsonl", ""), "fresh_groups.jsonl: holds no record"),  # silent
    "async_empty": (lambda d: w(d / "async.jsonl", ""), "async.jsonl: holds no record"),  # silent
    # lines that are not JSON objects (not what a crash leaves: a crash leaves a record cut short)
    "steps_json_arrays": (lambda d: w(d / R, "[1,2]\n3\n\"x\"\n"), "steps.jsonl:1: expected a JSON object"),  # warn
    "steps_not_json": (lambda d: w(d / R, "hello\nworld\n"), "steps.jsonl:1: not a JSON object"),  # warn
    "steps_binary": (lambda d: w(d / R, bytes(range(256)) * 8), "steps.jsonl:1: not a JSON object"),  # warn
    "steps_array_line_inside": (lambda d: insert_line(d / R, 3, "[1]"),  # warn
                                "steps.jsonl:4: expected a JSON object"),
    "steps_garbage_line_inside": (lambda d: insert_line(d / R, 3, "garbage"),  # warn
                                  "steps.jsonl:4: not a JSON object"),
    "groups_json_array": (lambda d: w(d / G, "[1]\n"), "groups.jsonl:1: expected a JSON object"),  # warn
    "groups_not_json": (lambda d: w(d / G, "xx\n"), "groups.jsonl:1: not a JSON object"),  # warn
    "train_log_arrays": (lambda d: w(d / "train_log.jsonl", "[1]\n[2]\n"),  # warn
                         "train_log.jsonl:1: expected a JSON object"),
    "train_log_not_json": (lambda d: w(d / "train_log.jsonl", "a\nb\n"),  # warn
                           "train_log.jsonl:1: not a JSON object"),
    "fresh_groups_not_json": (lambda d: w(d / "fresh_groups.jsonl", "x\n"),  # warn
                              "fresh_groups.jsonl:1: not a JSON object"),
    "async_not_json": (lambda d: w(d / "async.jsonl", "x\n"), "async.jsonl:1: not a JSON object"),  # silent
    "steps_nested_too_deep": (lambda d: w(d / R, (d / R).read_text() + "[" * 100_000 + "]" * 100_000 + "\n"),  # trace
                              "steps.jsonl:31: nested too deeply"),
    # foreign records: JSON objects of the wrong shape
    "train_log_foreign": (lambda d: w(d / "train_log.jsonl", '{"foo": 1}\n{"bar": 2}\n'),  # silent
                          "train_log.jsonl:1: 'step' must be an int >= 0"),
    "train_log_step_str": (lambda d: w(d / "train_log.jsonl", '{"step": "a", "reward": 1}\n'),  # silent
                           "train_log.jsonl:1: 'step' must be an int >= 0"),
    "train_log_reward_str": (lambda d: w(d / "train_log.jsonl",  # silent
                                         '{"step": 1, "reward": "x", "entropy": 0.5}\n'),
                             "train_log.jsonl:1: 'reward' must be a number or null"),
    "async_foreign": (lambda d: w(d / "async.jsonl", '{"a": 1}\n'),  # silent
                      "async.jsonl:1: 'step' must be an int >= 0"),
    "async_wrong_types": (lambda d: w(d / "async.jsonl",  # trace
                                      '{"step": 1, "totals": {"generated_groups": "x"}, "ages": 3}\n'),
                          "async.jsonl:1: 'totals' must be an object of numbers"),
    # whole-file JSON that is unreadable or of the wrong shape
    "run_json_not_json": (lambda d: w(d / "run.json", "{nope"), "run.json: not valid JSON"),  # warn
    "run_json_empty": (lambda d: w(d / "run.json", ""), "run.json: not valid JSON"),  # warn
    "run_json_list": (lambda d: w(d / "run.json", "[1, 2]"), "run.json: expected a JSON object, got list"),  # warn
    "run_json_nested_too_deep": (lambda d: w(d / "run.json", "[" * 100_000 + "]" * 100_000),  # trace
                                 "run.json: nested too deeply"),
    "run_json_replay_str": (lambda d: edit_run_json(d, replay="yes"),  # silent
                            "run.json: 'replay' must be an object or null"),
    "run_json_replay_field_types": (lambda d: edit_run_json(d, **{"replay.capacity": "big"}),  # silent
                                    "run.json: 'replay.capacity' must be an int or null"),
    "run_json_method_int": (lambda d: edit_run_json(d, method=5),  # silent
                            "run.json: 'method' must be a string or null"),
    "metrics_not_json": (lambda d: w(d / "metrics.json", "{x"), "metrics.json: not valid JSON"),  # warn
    "metrics_list": (lambda d: w(d / "metrics.json", "[1]"), "metrics.json: expected a JSON object, got list"),  # warn
    "trainer_state_no_history": (lambda d: plain_trl(d, '{"global_step": 3}'),  # silent
                                 "trainer_state.json: 'log_history' must be a list"),
    "trainer_state_history_not_list": (lambda d: plain_trl(d, '{"log_history": {"a": 1}}'),  # silent
                                       "trainer_state.json: 'log_history' must be a list"),
    "trainer_state_history_empty": (lambda d: plain_trl(d, '{"log_history": []}'),  # silent
                                    "nothing to analyse: no trainer log entry in"),
    "trainer_state_history_not_objects": (lambda d: plain_trl(d, '{"log_history": [1, "x"]}'),  # silent
                                          "trainer_state.json: log_history[0]: expected a JSON object"),
    "trainer_state_step_str": (lambda d: plain_trl(d,  # silent
                                                   json.dumps({"log_history": [{"step": "a", "reward": 1}]})),
                               "trainer_state.json: log_history[0]: 'step' must be an int >= 0"),
    "trainer_state_not_json": (lambda d: plain_trl(d, "{x"), "trainer_state.json: not valid JSON"),  # warn
    "trainer_state_list": (lambda d: plain_trl(d, "[1]"),  # warn
                           "trainer_state.json: expected a JSON object, got list"),
    "checkpoint_state_not_json": (lambda d: (keep_only(d), w(d / "checkpoint-5" / "trainer_state.json", "{x")),  # warn
                                  "checkpoint-5/trainer_state.json: not valid JSON"),
    # TensorBoard event files that hold no scalar
    "tensorboard_garbage": (lambda d: (keep_only(d),  # silent
                                       w(d / "runs" / "x" / "events.out.tfevents.1.host", bytes(500))),
                            "hold no TensorBoard scalar"),
    "tensorboard_empty": (lambda d: (keep_only(d), w(d / "runs" / "x" / "events.out.tfevents.1.host", b"")),  # silent
                          "hold no TensorBoard scalar"),
    # something other than a regular file where a file belongs
    "steps_dangling_link": (lambda d: (rm(d / R), os.symlink(d / "nowhere", d / R)),  # silent
                            "steps.jsonl: a dangling symbolic link"),
    "run_json_dangling_link": (lambda d: (rm(d / "run.json"), os.symlink(d / "nowhere", d / "run.json")),  # silent
                               "run.json: a dangling symbolic link"),
    "steps_fifo": (lambda d: (rm(d / R), os.mkfifo(d / R)), "steps.jsonl: expected a file, found a FIFO"),  # vague
    "async_directory": (lambda d: (d / "async.jsonl").mkdir(),  # silent
                        "async.jsonl: expected a file, found a directory"),
    "checkpoint_state_directory": (lambda d: (keep_only(d),  # vague
                                              (d / "checkpoint-5" / "trainer_state.json").mkdir(parents=True)),
                                   "checkpoint-5/trainer_state.json: expected a file, found a directory"),
    "tensorboard_directory": (lambda d: (keep_only(d),  # vague
                                         (d / "runs" / "x" / "events.out.tfevents.1.host").mkdir(parents=True)),
                              "events.out.tfevents.1.host: expected a file, found a directory"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_unreadable_input_exits_2_with_one_line_per_problem_and_writes_nothing(name, real_run, tmp_path, capsys):
    damage, needle = BAD[name]
    damage(real_run)
    rc, err = report(real_run, tmp_path / "o", capsys)
    assert rc == 2, err
    assert not (tmp_path / "o").exists()
    assert err[0].startswith("hdreplay report: error:"), err
    assert not any(x.startswith("warning:") for x in err), err  # a refusal, not a warning
    assert any(needle in x for x in err), (needle, err)
    # each line names the path it is about (inside the run directory) and says what to do
    problems = err[1:] if len(err) > 1 else [err[0]]
    assert all(str(real_run) in x for x in problems), err
    assert all(any(v in x for v in ("restore", "remove", "fix", "delete", "rerun", "replace", "set "))
               for x in problems), err


def test_every_problem_of_every_run_is_listed_not_just_the_first(real_run, tmp_path, capsys):
    other = shutil.copytree(real_run, tmp_path / "other")
    w(real_run / "run.json", "[1]")
    w(real_run / "train_log.jsonl", "")
    insert_line(real_run / R, 2, "[3]")
    w(other / "metrics.json", "{x")
    rc = main(["report", str(real_run), str(other), "--out", str(tmp_path / "o"), "--no-progress", "--no-figures"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and not (tmp_path / "o").exists()
    for needle in (f"{real_run / 'run.json'}: expected a JSON object",
                   f"{real_run / 'train_log.jsonl'}: holds no record",
                   f"{real_run / R}:3: expected a JSON object", f"{other / 'metrics.json'}: not valid JSON"):
        assert sum(needle in x for x in err) == 1, (needle, err)


# -- what stays readable -------------------------------------------------------------------------------------------

def test_a_torn_last_line_is_a_warning_and_the_rest_is_reported(real_run, tmp_path, capsys):
    """What a crash mid-write leaves (a record cut short, also fused with the next record after a resume)."""
    steps = real_run / R
    torn = first_step_line(real_run)[:40]
    insert_line(steps, 5, torn + first_step_line(real_run))  # crash, then a resumed writer appended
    with open(steps, "a") as f:
        f.write(torn)
    rc, err = report(real_run, tmp_path / "o", capsys)
    assert rc == 0, err
    assert [x.split(": ", 2)[1] for x in err] == [f"{steps}:6", f"{steps}:32"] and all("line skipped" in x for x in err)
    assert json.loads((tmp_path / "o" / "report.json").read_text())["runs"]["hdr"]["acceptance"]["n_steps"] == 30


@pytest.mark.parametrize("shape", ["plain_trl_state", "checkpoint_state", "tensorboard", "empty_groups", "on_policy",
                                   "bare_diagnostics", "lag_run_without_replay", "symlinked_files",
                                   "async_trainer_layout"])
def test_legitimately_readable_runs_still_report(shape, real_run, tmp_path, capsys):
    d = real_run
    history = [{"step": s, "reward": 0.1 * s, "entropy": 0.5, "epoch": 0.1 * s} for s in (1, 2, 3)]
    history.append({"step": 3, "train_runtime": 1.5, "total_flos": 0.0, "train_loss": 0.2})
    if shape == "plain_trl_state":
        plain_trl(d, json.dumps({"global_step": 3, "log_history": history}))
    elif shape == "checkpoint_state":
        keep_only(d)
        w(d / "checkpoint-2" / "trainer_state.json", json.dumps({"log_history": history[:2]}))
        w(d / "checkpoint-3" / "trainer_state.json", json.dumps({"log_history": history}))
    elif shape == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        keep_only(d)
        with SummaryWriter(str(d / "runs" / "x")) as tb:
            for s in (1, 2, 3):
                tb.add_scalar("train/reward", 0.1 * s, s)
    elif shape == "empty_groups":  # DiagnosticsWriter.rewind on a resume before any eviction leaves it empty
        w(d / G, "")
    elif shape == "on_policy":
        rm(d / "replay")
        edit_run_json(d, replay=None, method="grpo")
    elif shape == "bare_diagnostics":
        keep_only(d, "replay")
    elif shape == "lag_run_without_replay":  # hdreplay compare-async, an age-drop method: run.json + the ledger
        keep_only(d, "run.json")
        rec = {"step": 0, "drift_divert": [], "drift_admit": [None], "ages": {"fresh": {"0": 4}},
               "lengths": {"trained": {"5": 4}}, "totals": {"generated_groups": 4, "fresh_groups": 4}}
        w(d / "async.jsonl", json.dumps(rec) + "\n" + json.dumps({**rec, "step": 1, "floor": None}) + "\n")
        w(d / "pipeline.jsonl", '{"step": 0}\n')
    elif shape == "symlinked_files":
        for name in ("run.json", "train_log.jsonl"):
            shutil.move(d / name, tmp_path / name)
            os.symlink(tmp_path / name, d / name)
    elif shape == "async_trainer_layout":  # HDRAsyncGRPOTrainer: diagnostics in <output_dir>/hdreplay
        (d / "replay").rename(d / "hdreplay")
    rc, err = report(d, tmp_path / "o", capsys)
    log_only = shape in ("plain_trl_state", "checkpoint_state", "tensorboard")  # said in one note (issue 39)
    assert rc == 0 and len(err) == log_only and all(x.startswith(f"note: {d}: no replay diagnostics") for x in err), err
    a = json.loads((tmp_path / "o" / "report.json").read_text())["runs"]["hdr"]
    if log_only:
        assert a["training"]["score"]["step"] == [1, 2, 3]
    if shape in ("empty_groups", "bare_diagnostics", "symlinked_files", "async_trainer_layout"):
        assert a["acceptance"]["n_steps"] == 30
    if shape == "lag_run_without_replay":
        assert a["async_ledger"]["available"] and a["async_ledger"]["updates"] == 2
