"""Issue 44 at the CLI: ``hdreplay report`` reads the logs a resume rewound and names the side files the rewind set
aside (item 3); the bare ``hdreplay`` / ``hdreplay calibrate`` say on stderr what to type, and ``explain`` says how a
random-order selector drew its replay (item 4: before, exit 2 with nothing on stderr, and adv_priority's draw
unexplained, as uniform's could be)."""

from __future__ import annotations

import json
import warnings

from hdreplay import ReplayConfig, ReplayController
from hdreplay_lab.cli import main
from protocol import run_steps


def _resumed_run(root):
    """A run of 8 steps, checkpoint after step 4, resumed from it (the rewind sets steps 5-7 aside), run to the end."""
    d = root / "run" / "replay"
    cfg = ReplayConfig(k_rep=2, tau=5e-3, capacity=6)
    ctrl = run_steps(ReplayController(cfg, diagnostics_dir=d), range(5))
    ctrl.save(root / "ck")
    run_steps(ctrl, range(5, 8))
    resumed = ReplayController(cfg, diagnostics_dir=d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.load(root / "ck")
    run_steps(resumed, range(5, 8))
    resumed.close()
    return root / "run", sorted(p.name for p in d.glob("*.rewound-from-step-5.*.jsonl"))


def test_the_report_reads_the_logs_and_names_the_side_files_of_a_rewind(tmp_path, capsys):
    run, side = _resumed_run(tmp_path)
    assert [n.split(".")[0] for n in side] == ["groups", "steps"]
    rc = main(["report", str(run), "--out", str(tmp_path / "out"), "--no-progress", "--no-figures"])
    err = capsys.readouterr().err
    assert rc == 0, err
    notes = [x for x in err.splitlines() if x.startswith("note:") and "set 2 file(s) of records aside" in x]
    assert len(notes) == 1 and all(n in notes[0] for n in side), err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    info = report["runs"]["run"]["info"]
    assert sorted(p.rsplit("/", 1)[1] for p in info["rewound"]) == side
    assert info["replay_steps"] == [0, 7] and not report["runs"]["run"]["problems"]  # no step twice in the log
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Records set aside by a resume" in md and all(n in md for n in side)


def test_no_command_and_calibrate_without_a_subcommand_say_what_to_type(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hdreplay: error: no command given; choose one of demo, compare, compare-async, report, calibrate, "
                   "explain (e.g. `hdreplay demo --help`)"]
    assert main(["calibrate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hdreplay calibrate: error: no subcommand given; choose one of run, summarize (e.g. `hdreplay "
                   "calibrate run --help`)"]


def test_explain_says_how_a_random_order_selector_draws_its_replay(capsys):
    assert main(["explain", "--selector", "adv_priority", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "adv_priority draws its replay at random, without replacement, each unit with probability proportional to " \
           "|A|^0.6" in out, out
    replayed = [x for x in out.splitlines() if x.strip().startswith("replayed [")]
    assert replayed[1:] and all("|A|=" in x for x in replayed[1:]), replayed
    assert main(["explain", "--selector", "uniform", "--steps", "2"]) == 0
    assert "uniform draws its replay at random: uniformly, without replacement" in capsys.readouterr().out
