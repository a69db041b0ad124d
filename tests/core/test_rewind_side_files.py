"""A resume's rewind never deletes a record (issue 44, item 3): the records of the steps after the resumed one move
from ``steps.jsonl`` / ``groups.jsonl`` (and an observer's log, the staleness ledger) to side files beside them,
named with the first step moved and the time, listed in a warning; the resumed run then writes those steps again into
the logs themselves.  Before: they were dropped for good (``steps.jsonl`` [0..7] -> [0..4] and nothing else)."""

import json
import re

import pytest

from hdreplay import ReplayConfig, ReplayController, ReplayResumeWarning, records
from hdreplay.records import rewound_files
from protocol import run_steps, untimed

CFG = ReplayConfig(k_rep=2, tau=5e-3, capacity=6)
SIDE = re.compile(r"(steps|groups)\.rewound-from-step-5\.\d{8}T\d{6}\.\d{6}Z\.jsonl")


def _lines(path):
    return path.read_text().splitlines()


@pytest.fixture
def interrupted(tmp_path):
    """A run of 8 steps whose checkpoint was taken after step 4 (then steps 5-7 ran and it stopped)."""
    d = tmp_path / "diag"
    ctrl = run_steps(ReplayController(CFG, diagnostics_dir=d), range(5))
    ctrl.save(tmp_path / "ck", identity={"run_id": "r", "global_step": 5})
    run_steps(ctrl, range(5, 8))
    ctrl.close()
    return d, tmp_path / "ck"


def test_a_resume_moves_the_later_records_to_side_files_named_with_the_step_and_time(interrupted):
    d, ck = interrupted
    steps, groups = _lines(d / "steps.jsonl"), _lines(d / "groups.jsonl")
    with open(d / "steps.jsonl", "a") as f:
        f.write('{"step": 8, "scann')  # a torn last line (a crash mid-write): moved too, not dropped
    resumed = ReplayController(CFG, diagnostics_dir=d)
    with pytest.warns(ReplayResumeWarning, match=r"resumed after step 4: the records of later steps were moved") as w:
        resumed.load(ck, expect={"run_id": "r", "global_step": 5})
    side = rewound_files(d / "steps.jsonl") + rewound_files(d / "groups.jsonl")
    assert [p.name.split(".")[0] for p in side] == ["steps", "groups"] and all(SIDE.fullmatch(p.name) for p in side)
    assert len({p.name.split(".", 1)[1] for p in side}) == 1  # one time names the whole rewind
    assert all(str(p) in str(w[0].message) for p in side)  # the warning lists them
    kept, moved = _lines(d / "steps.jsonl"), _lines(side[0])
    assert [json.loads(x)["step"] for x in kept] == [0, 1, 2, 3, 4]
    assert kept + moved == steps + ['{"step": 8, "scann']  # every line, in order: none deleted
    g_kept, g_moved = _lines(d / "groups.jsonl"), _lines(side[1])
    assert sorted(g_kept + g_moved) == sorted(groups) and g_moved  # evicted after step 4 or written at close
    assert all(json.loads(x)["evicted_step"] is not None and json.loads(x)["evicted_step"] <= 4 for x in g_kept)
    run_steps(resumed, range(5, 8))  # the resumed run writes steps 5-7 again: each step once in the log
    assert untimed([json.loads(x) for x in _lines(d / "steps.jsonl")]) == untimed([json.loads(x) for x in steps])
    assert side[0].exists()


def test_rewind_logs_without_a_state_sets_the_logs_back_to_the_given_step(interrupted):
    """What a resume with ``resume_without_state`` does (integrations.common.restore): the logs back to the
    checkpoint's step, so that no step is written twice; None (nothing committed) sets every record aside."""
    d, _ = interrupted
    steps = _lines(d / "steps.jsonl")
    ctrl = ReplayController(CFG, diagnostics_dir=d)
    with pytest.warns(ReplayResumeWarning, match="resumed after step 2"):
        moved = ctrl.rewind_logs(2)
    assert [json.loads(x)["step"] for x in _lines(d / "steps.jsonl")] == [0, 1, 2]
    assert moved[0].name.startswith("steps.rewound-from-step-3.") and _lines(moved[0]) == steps[3:]
    with pytest.warns(ReplayResumeWarning, match="resumed before any committed step"):
        moved = ctrl.rewind_logs(None)
    assert _lines(d / "steps.jsonl") == [] and _lines(moved[0]) == steps[:3]
    assert ctrl.rewind_logs(None) == []  # nothing left to move: no empty side file
    assert len(rewound_files(d / "steps.jsonl")) == 2


def test_a_crash_between_the_side_file_and_the_log_loses_no_record(interrupted, monkeypatch):
    """The side file is complete before the log is rewritten: a crash in between leaves the records in both, and the
    next resume sets them aside again."""
    d, ck = interrupted
    steps = _lines(d / "steps.jsonl")
    real, calls = records.atomic_write_text, []

    def crash_on_the_log(path, text):
        calls.append(path)
        if len(calls) == 2:  # the side file was written; the log's rewrite dies
            raise KeyboardInterrupt("killed")
        return real(path, text)

    monkeypatch.setattr(records, "atomic_write_text", crash_on_the_log)
    with pytest.raises(KeyboardInterrupt):
        ReplayController(CFG, diagnostics_dir=d).load(ck)
    monkeypatch.setattr(records, "atomic_write_text", real)
    (side,) = rewound_files(d / "steps.jsonl")
    assert _lines(d / "steps.jsonl") == steps and _lines(side) == steps[5:]
    with pytest.warns(ReplayResumeWarning):
        ReplayController(CFG, diagnostics_dir=d).load(ck)
    assert _lines(d / "steps.jsonl") == steps[:5]
    assert all(_lines(p) == steps[5:] for p in rewound_files(d / "steps.jsonl"))
