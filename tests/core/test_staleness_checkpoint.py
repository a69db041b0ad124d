"""The staleness rule's state saved with the controller (hdreplay.staleness.state): a resumed rule decides what the
uninterrupted one decides; a checkpoint without the state, or with a malformed one, is refused and changes nothing."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from hdreplay import (
    CheckpointError,
    GroupRecord,
    ReplayConfig,
    ReplayController,
    ReplayProtocolError,
    ReplayResumeWarning,
)
from hdreplay.staleness import AsyncReplay, StalenessConfig
from protocol import log_lines
from strategy_states import read_state, resign

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.staleness.FloorWarning")

FLOOR, DRIFT = 0.04, 0.045  # a diverted group passes tau = 0.01 only with the floor subtracted


def group(gid, birth, *, mixed=True, n=4):
    rewards = [float(i % 2) for i in range(n)] if mixed else [1.0] * n
    comps = [[3 + (i + j) % 5 for j in range(3 + i % 2)] for i in range(n)]
    return GroupRecord.from_responses(group_id=gid, prompt_ids=[5, 6, 7], completion_ids=comps,
                                      logprobs=[[-1.0] * len(c) for c in comps], rewards=rewards, birth_step=birth,
                                      advantages=[r - float(np.mean(rewards)) for r in rewards])


def make(diag=None, **kw):
    ctrl = ReplayController(ReplayConfig(k_rep=2, capacity=6, tau=0.01, scan_passes=1), diagnostics_dir=diag)
    return AsyncReplay(ctrl, StalenessConfig(fresh_bound=1, floor_min_groups=4), diagnostics_dir=diag, **kw)


def scorer(groups):  # every stored log-prob moved by sqrt(DRIFT): Drift (l2) = DRIFT on every group
    return [g.logprobs + math.sqrt(DRIFT) * g.loss_mask.float() for g in groups]


def update(ar, u, log):
    """Update u the TRL way: the groups that arrived are offered, the update is committed, then the next update's
    replay is selected (left open, like a checkpoint taken after the update)."""
    for i in range(3):  # 2 diverted (3 versions late, one of them zero-variance: dropped), 1 fresh
        ar.offer(group(f"u{u}-{i}", max(u - 3 + 2 * (i == 2), 0), mixed=i != 1), step=u)
    ar.observe_floor([FLOOR] * 2, [5, 5])
    log.append({"metrics": ar.commit(num_fresh_groups=1)})
    sel = ar.select(step=u + 1, scorer=scorer)
    log.append({"step": u + 1, "selected": [g.group_id for g in sel.groups], "pass": sel.scanned_pass.tolist(),
                "drift": sel.scanned_drift.tolist()})


def state(ar):
    t, meta = ar.controller.state_dict(allow_open_step=True)
    return {k: v.clone() for k, v in t.items()}, json.loads(json.dumps(meta))


def same_metrics(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]) or (a[k] != a[k] and b[k] != b[k]), k


def test_resumed_rule_selects_what_the_uninterrupted_one_selects(tmp_path):
    first, log = make(tmp_path / "a"), []
    for u in range(3, 6):
        update(first, u, log)
    assert any(e.get("selected") for e in log) and first.floor.ready
    first.controller.save(tmp_path / "ckpt", allow_open_step=True)  # after update 5, update 6's selection open
    saved = state(first)
    update(first, 6, log)  # the interrupted run got one update further (its ledger records included) ...
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # ... and the resumed run starts from its diagnostics
    for u in range(7, 9):
        update(first, u, log)
    resumed, rlog = make(tmp_path / "b"), []
    resumed.controller.load(tmp_path / "ckpt")
    t, meta = state(resumed)
    assert meta == saved[1] and all(torch.equal(t[k], saved[0][k]) for k in t)
    assert resumed.floor.ready and resumed.sampler_ref and resumed.tracked
    sel = resumed.select(step=6, scorer=scorer)  # the open selection, re-made from the restored state
    assert [g.group_id for g in sel.groups] == log[5]["selected"] and sel.scanned_pass.tolist() == log[5]["pass"]
    rlog.extend(log[:6])
    for u in range(6, 9):
        update(resumed, u, rlog)
    assert [e.get("selected") for e in rlog] == [e.get("selected") for e in log]
    np.testing.assert_array_equal(np.concatenate([e.get("drift", []) for e in rlog]),
                                  np.concatenate([e.get("drift", []) for e in log]))
    for a, b in zip(log, rlog):
        if "metrics" in a:
            same_metrics(a["metrics"], b["metrics"])
    ta, ma = state(first)
    tb, mb = state(resumed)
    assert ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert first.ledger.totals == resumed.ledger.totals and first.tracked == resumed.tracked
    for name in ("async.jsonl", "steps.jsonl"):  # the resumed run's logs: rewound to the checkpoint, then continued
        assert log_lines(tmp_path / "a" / name) == log_lines(tmp_path / "b" / name), name  # seconds aside


def test_checkpoint_without_staleness_state_is_refused_naming_the_option(tmp_path):
    plain = ReplayController(make().controller.config)
    plain.stage([group("g", 0)], step=0)
    plain.commit()
    plain.save(tmp_path / "ckpt")
    ar = make(resume_option="hdr.resume_without_state")
    with pytest.raises(CheckpointError, match=r"no staleness state .* set hdr.resume_without_state=True"):
        ar.controller.load(tmp_path / "ckpt")
    assert len(ar.controller.buffer) == 0 and ar.controller.last_step is None  # nothing changed
    ok = make(resume_without_state=True)
    with pytest.warns(ReplayResumeWarning, match=r"start empty \(resume_without_state=True\)"):
        ok.controller.load(tmp_path / "ckpt")
    assert len(ok.controller.buffer) == 1 and not ok.tracked and ok.ledger.totals["generated_groups"] == 0


def _corrupt(meta, how):
    s = meta["observers"]["staleness"]
    if how == "tracked":
        s["tracked"][0][1].pop("birth")
    elif how == "totals":
        s["totals"]["extra_groups"] = 1
    elif how == "floor":
        s["floor"]["estimate"] = -1.0
    elif how == "sampler_ref":
        s["sampler_ref"] = "all"
    elif how == "step":
        s["step"] = "five"
    elif how == "missing":
        del s["warned_floor"]
    elif how == "floor_key":  # an older layout of the floor ({estimate, groups}): refused, not a KeyError mid-install
        del s["floor"]["last_step_mean"]


@pytest.mark.parametrize("how", ["tracked", "totals", "floor", "sampler_ref", "step", "missing", "floor_key"])
def test_malformed_staleness_state_is_refused_and_changes_nothing(how, tmp_path):
    ar, log = make(), []
    for u in range(3, 5):
        update(ar, u, log)
    ar.commit()
    t, meta = state(ar)
    _corrupt(meta, how)
    other, olog = make(tmp_path), []
    update(other, 3, olog)
    other.commit()
    before = state(other)
    with pytest.raises(CheckpointError, match="staleness state"):
        other.controller.load_state_dict(t, meta)
    after = state(other)
    assert after[1] == before[1] and all(torch.equal(after[0][k], before[0][k]) for k in after[0])


def test_a_refused_load_leaves_the_diagnostics_files_alone(tmp_path):
    """The controller's steps / groups logs and the ledger's file are rewound to the checkpoint only once every
    check of the load passed: a checkpoint refused for its staleness state changes no file either."""
    plain = ReplayController(make().controller.config)
    plain.stage([group("g", 0)], step=0)
    plain.commit()
    plain.save(tmp_path / "ckpt")  # step 0, no staleness state
    ar, log = make(tmp_path / "diag"), []
    for u in range(3, 6):
        update(ar, u, log)
    ar.commit()
    files = {p: p.read_bytes() for p in sorted((tmp_path / "diag").rglob("*")) if p.is_file()}
    assert len(files) >= 2 and all(files.values())
    with pytest.raises(CheckpointError, match="no staleness state"):
        ar.controller.load(tmp_path / "ckpt")
    assert {p: p.read_bytes() for p in files} == files


def test_load_while_the_rule_has_an_open_update_is_refused(tmp_path):
    ar, log = make(), []
    update(ar, 3, log)
    ar.commit()
    ar.controller.save(tmp_path / "ckpt")
    other = make()
    other.offer(group("late", 0), step=4)  # opens the rule's update 4 (the controller opens it at commit)
    with pytest.raises(ReplayProtocolError, match="staleness rule's step 4 is open"):
        other.controller.load(tmp_path / "ckpt")
    assert other.controller.last_step is None and other._pending


# ------------------------------------------------------------------ issue 39, item 2: cross-checked against the
# controller
# Each case edits one field of a saved staleness state and re-signs the checkpoint (the checksums pass), as a hostile
# or careless edit would.  Before: 20 of 28 such edits loaded silently, and a step of null or 0 truncated the run's
# ``async.jsonl``.  Now each is refused with a CheckpointError naming the field, and nothing changes: not the rule,
# not the controller, not a byte of the diagnostics files.


def _saved(tmp_path):
    """A checkpoint after updates 3-5 (diverted groups tracked and sampler-referenced, a floor measured)."""
    ar, log = make(), []
    for u in range(3, 6):
        update(ar, u, log)
    ar.commit()
    s = ar.controller.state_dict()[1]["observers"]["staleness"]
    assert s["tracked"] and s["sampler_ref"] and s["floor"]["groups"] > 0 and s["step"] == 6
    ar.controller.save(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit(s, how):
    tracked_gid = s["tracked"][0][0]
    if how == "step +1":
        s["step"] += 1
    elif how == "step -1":
        s["step"] -= 1
    elif how == "step null":
        s["step"] = None
    elif how == "step 0":
        s["step"] = 0
    elif how == "tracked id not buffered":
        s["tracked"][0][0] = "never-buffered"
    elif how == "sampler_ref id not buffered":
        s["sampler_ref"].append("never-buffered")
    elif how == "tracked born after the step":
        s["tracked"][0][1]["birth"] = s["step"] + 3
    elif how == "floor estimate over 0 groups":
        s["floor"]["groups"] = 0
    elif how == "floor groups without an estimate":
        s["floor"]["estimate"] = None
    elif how == "generated != fresh + diverted + dropped":
        s["totals"]["generated_groups"] += 1
    elif how == "admitted > diverted":
        s["totals"]["admitted_tokens"] = s["totals"]["diverted_tokens"] + 1
    elif how == "tracked birth differs from the buffer's":
        s["tracked"][0][1]["birth"] = max(s["tracked"][0][1]["birth"] - 1, 0) if s["tracked"][0][1]["birth"] else 1
    elif how == "tracked tokens differ from the buffer's":
        s["tracked"][0][1]["tokens"] *= 100
    elif how == "more tracked than diverted":
        s["totals"]["evicted_unused_groups"] = s["totals"]["diverted_groups"]
        s["totals"]["evicted_unused_tokens"] = s["totals"]["diverted_tokens"]
    else:
        raise AssertionError(how)
    return tracked_gid


CASES = ["step +1", "step -1", "step null", "step 0", "tracked id not buffered", "sampler_ref id not buffered",
         "tracked born after the step", "floor estimate over 0 groups", "floor groups without an estimate",
         "generated != fresh + diverted + dropped", "admitted > diverted", "tracked birth differs from the buffer's",
         "tracked tokens differ from the buffer's", "more tracked than diverted"]
#: what each refusal must say (the check that caught it, not just a word every message has)
NAMES = {"step +1": "differs from the controller's last committed step", "step -1": "differs from the controller's",
         "step null": "step None differs", "step 0": "step 0 differs",
         "tracked id not buffered": "are not in the buffer",
         "sampler_ref id not buffered": "sampler-referenced group id(s)", "tracked born after the step": "born after",
         "floor estimate over 0 groups": "over 0 group(s)", "floor groups without an estimate": "floor estimate None",
         "generated != fresh + diverted + dropped": "generated_groups", "admitted > diverted": "admitted_tokens",
         "tracked birth differs from the buffer's": "the buffer holds it with birth",
         "tracked tokens differ from the buffer's": "the buffer holds it with birth",
         "more tracked than diverted": "tracked diverted groups"}


@pytest.mark.parametrize("how", CASES)
def test_a_re_signed_staleness_state_that_does_not_fit_its_controller_is_refused_and_changes_nothing(tmp_path, how):
    ckpt = _saved(tmp_path)
    st, _ = read_state(ckpt)
    meta = st["meta"]
    _edit(meta["observers"]["staleness"], how)
    resign(ckpt, meta)
    # a run that went further, with its diagnostics files (steps.jsonl, groups.jsonl, async.jsonl)
    other, log = make(tmp_path / "diag"), []
    for u in range(3, 9):
        update(other, u, log)
    other.commit()
    files = {p: p.read_bytes() for p in sorted((tmp_path / "diag").rglob("*")) if p.is_file()}
    assert len(files) >= 2 and all(files.values())
    before = state(other)
    with pytest.raises(CheckpointError, match=r"staleness state: .*") as e:
        other.controller.load(ckpt)
    assert NAMES[how] in str(e.value), (how, str(e.value))
    assert "resume from an intact checkpoint" in str(e.value)
    after = state(other)
    assert after[1] == before[1] and all(torch.equal(after[0][k], before[0][k]) for k in after[0])
    assert {p: p.read_bytes() for p in files} == files  # no line of any log lost


def test_the_unedited_state_loads_and_rewinds_the_ledger_to_its_own_step(tmp_path):
    ckpt = _saved(tmp_path)
    other, log = make(tmp_path / "diag"), []
    for u in range(3, 9):
        update(other, u, log)
    other.commit()
    before = (tmp_path / "diag" / "async.jsonl").read_text().splitlines()
    with pytest.warns(ReplayResumeWarning, match="async.rewound-from-step-7"):
        other.controller.load(ckpt)
    steps = [json.loads(line)["step"] for line in (tmp_path / "diag" / "async.jsonl").read_text().splitlines()]
    assert steps == [3, 4, 5, 6]  # rewound to the state's step, 6, and not below it
    (side,) = (tmp_path / "diag").glob("async.rewound-from-step-7.*.jsonl")  # issue 44: set aside, not deleted
    assert [json.loads(x)["step"] for x in side.read_text().splitlines()] == [7, 8, 9]
    assert (tmp_path / "diag" / "async.jsonl").read_text().splitlines() + side.read_text().splitlines() == before
    shutil.rmtree(ckpt)
