"""The API fuzz extended to the CLI subcommands: each option of demo / compare / calibrate run / report / calibrate
summarize / explain given a bad value, and ``report`` given step records whose fields are fuzzed, must end in exit
status 2 with one line per problem on stderr -- never a traceback, never a run started on bad input."""

import json
import random

import pytest

from hdreplay.records import STEP_FIELDS
from hdreplay_lab import cli
from hdreplay_lab.cli import main

#: (command, option) -> bad values: the options each command documents (--help)
OPTIONS = {
    ("demo",): {"--seeds": ["0", "-1", "x"], "--steps": ["0", "x"], "--generations": ["1", "x"],
                "--prompts-per-step": ["3", "0"], "--lr": ["0", "nan", "-1", "x"], "--eval-n": ["0", "x"],
                "--tau": ["-1", "nan", "x"], "--capacity": ["0", "x", "1e11"], "--replay.k_rep": ["-1", "x"],
                "--replay.selector": ["nope"], "--task": ["nope"], "--out": ["<file>"], "--workers": ["0", "x"],
                "--eval-every": ["-1"], "--curve-prompts": ["0", "x"]},
    ("compare",): {"--seeds": ["0"], "--methods": ["nope", ","], "--replay.acceptance_ema": ["0", "2"],
                   "--replay.adaptive_tau": ["{bad json", "[1]", '{"tau_min": -1}'], "--out": ["<file>"],
                   "--replay.max_age": ["0", "x"]},
    ("calibrate", "run"): {"--taus": ["", "0", "-1,1", "x", "1e-3,1e-3", "nan"], "--steps": ["0"],
                           "--out": ["<file>"], "--replay.k_rep": ["x"]},
    ("report", "<run>"): {"--label": ["<two>"], "--on-bad-line": ["ignore", ""], "--kl-window": ["0", "x"],
                          "--phases": ["-1", "x"], "--phase-bounds": ["20,10", "x"], "--out": ["<file>"],
                          "--score-anchor": ["nan", "x"], "--deciles": ["0", "x"]},
    ("report",): {"<path>": ["<missing>", "<file>", "<empty>"]},
    ("calibrate", "summarize", "<run>"): {"--out": ["<file>"], "--starved-accept": ["x", "nan"],
                                          "--kl-window": ["0"], "--label": ["a", "a"]},
    ("explain",): {"--steps": ["0", "-1", "x", "1.5", "nan"], "--selector": ["nope", ""]},
}


@pytest.fixture
def no_runs(monkeypatch):
    """A command that passed its checks would start training: record it instead of running."""
    started = []
    for cls in (cli.CompareArgs, cli.DemoArgs, cli.CalibrateArgs):
        monkeypatch.setattr(cls, "run", lambda self, c=cls: started.append(c.__name__) or 0)
    return started


def test_every_bad_option_value_is_one_line_and_exit_2(real_run, tmp_path, capsys, no_runs):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    paths = {"<run>": str(real_run), "<file>": str(tmp_path / "file"), "<missing>": str(tmp_path / "missing"),
             "<empty>": str(tmp_path / "empty")}
    problems, n = [], 0
    for cmd, opts in OPTIONS.items():
        for opt, values in opts.items():
            for v in values:
                argv = [paths.get(c, c) for c in cmd] + ([paths.get(v, v)] if opt == "<path>"
                                                          else [opt, paths.get(v, v)])
                if opt == "--label" and cmd[0] == "calibrate":  # two runs, one label each, both "a"
                    argv = [*argv[:3], str(real_run), "--label", "a", "--label", "a"]
                if v == "<two>":  # two labels for one run
                    argv = [*argv[:-1], "a", "--label", "b"]
                if cmd[0] == "report" and opt != "<path>":
                    argv += ["--no-figures", "--no-progress"]
                try:
                    rc = main(argv)
                except SystemExit as e:  # noqa: PERF203 - a usage error that escaped main
                    rc = f"SystemExit({e.code})"
                except Exception as e:  # noqa: BLE001 - a traceback is what this test counts
                    rc = f"raised {type(e).__name__}: {e}"
                err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("warning:")]
                n += 1
                if rc != 2 or len(err) != 1 or "error" not in err[0] or "Traceback" in "".join(err):
                    problems.append(f"{' '.join(argv)} -> {rc}, stderr {err[:3]}")
    assert not problems, problems[:10]
    assert not no_runs, no_runs  # nothing was started on bad input
    assert n > 80


def _record_values(field, typ_value):
    """Wrong-typed values for a steps.jsonl field whose good value is ``typ_value``."""
    if isinstance(typ_value, bool):
        return [1, "true", None]
    if isinstance(typ_value, int):
        return ["3", 1.5, [3], {"a": 1}, True]
    if isinstance(typ_value, float):
        return ["0.5", [0.5], True]
    if isinstance(typ_value, str):
        return [3, ["x"], None]
    if isinstance(typ_value, list):
        return ["x", 3, [[1]], [{"a": 1}]]
    return [[1]]


def test_report_on_fuzzed_step_records_exits_2_with_one_line_per_malformed_record(real_run, tmp_path, capsys):
    steps = real_run / "replay" / "steps.jsonl"
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    rng = random.Random(0)
    edits = {}
    for i, rec in enumerate(lines):
        fields = [k for k in STEP_FIELDS if k in rec and k != "step" and rec[k] is not None]
        k = rng.choice(fields)
        if i % 3 == 0:
            edits[i] = (k, rng.choice(_record_values(k, rec[k])))
    for i, (k, v) in edits.items():
        lines[i][k] = v
    steps.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = main(["report", str(real_run), "--out", str(tmp_path / "o"), "--no-progress", "--no-figures"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and not (tmp_path / "o").exists(), err
    assert err[0].startswith("hdreplay report: error:") and f"{len(edits)} malformed record(s)" in err[0]
    assert [x.split(": ", 1)[0] for x in err[1:]] == [f"{steps}:{i + 1}" for i in sorted(edits)], err
    assert all(f"'{k}'" in x for x, (k, _) in zip(err[1:], (edits[i] for i in sorted(edits))))


def test_report_on_right_typed_but_odd_records_never_tracebacks(real_run, tmp_path, capsys):
    """Values of the right type the analyses may not expect (zeros, negatives, empty scans, huge numbers): a report,
    or exit 2 with one line -- never a traceback."""
    steps = real_run / "replay" / "steps.jsonl"
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    odd = {"accepted": [0, -3, 10**9], "k_rep": [0, -1], "scanned": [0, 10**9], "buffer_size": [0, -1],
           "tau": [0.0, None, 1e300], "accept_rate": [None, -1.0, 5.0], "budget_fill": [None, 1e9],
           "replay_kl": [None, -1.0], "drift_accepted": [None, 1e300], "mean_age": [None, -5.0],
           "accepted_ages": [[], [-1], [10**9]], "num_fresh_groups": [0, -1]}
    rng = random.Random(1)
    outcomes = []
    for trial in range(4):
        recs = [dict(x) for x in lines]
        for rec in recs:
            for k, vals in odd.items():
                if k in rec and rng.random() < 0.3:
                    rec[k] = rng.choice(vals)
        steps.write_text("".join(json.dumps(x) + "\n" for x in recs))
        try:
            rc = main(["report", str(real_run), "--out", str(tmp_path / f"o{trial}"), "--no-progress",
                       "--no-figures"])
        except Exception as e:  # noqa: BLE001 - the failure this test looks for
            rc = f"raised {type(e).__name__}: {e}"
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith(("warning", "note"))]
        outcomes.append((rc, err[:2]))
    assert all(rc in (0, 2) and (rc == 0 or len(err) == 1) for rc, err in outcomes), outcomes
