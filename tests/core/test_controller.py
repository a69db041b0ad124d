"""The one-step protocol: no same-step replay, cache refresh scope, lifetime counters, exact resume."""

import json

import numpy as np
import pytest
import torch

from hdreplay import (
    AnswerBased,
    CheckpointError,
    MixedOutcome,
    ReplayConfig,
    ReplayConfigError,
    ReplayController,
    ReplayInputError,
    ReplayProtocolError,
)
from hdreplay_lab.synthetic import make_group
from protocol import fresh, policy_at, run_steps, untimed


def test_no_same_step_replay_even_when_staged_first():
    ctrl = ReplayController(ReplayConfig(selector="recency", k_rep=50, capacity=100))
    for t in range(4):
        groups = fresh(t)
        ctrl.stage(groups, step=t)  # stage BEFORE select
        sel = ctrl.select(step=t)
        assert all(g.birth_step < t for g in sel.groups)
        assert {g.group_id for g in sel.groups}.isdisjoint({g.group_id for g in groups})
        ctrl.commit()


def test_cache_refreshed_for_scanned_groups_only():
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=40)
    ctrl = run_steps(ReplayController(cfg), range(6))
    buf = ctrl.buffer
    ids = buf.insertion_ids()
    before = dict(zip(ids.tolist(), buf.slot_values("cached_headroom", ids)))
    sel = ctrl.select(step=6, scorer=policy_at(6).scorer)
    ctrl.stage(fresh(6), step=6)
    ctrl.commit()
    after = dict(zip(ids.tolist(), buf.slot_values("cached_headroom", ids)))
    scanned = set(sel.scanned.tolist())
    assert scanned, "the scenario must scan something"
    for i in ids.tolist():
        if i in scanned:
            j = sel.scanned.tolist().index(i)
            assert after[i] == pytest.approx(sel.scanned_headroom[j])
            assert buf.slot_values("refresh_step", [i])[0] == 6
        else:
            assert after[i] == before[i]


def test_lifetime_counters_and_exposure():
    cfg = ReplayConfig(selector="recency", k_rep=2, capacity=10)
    ctrl = ReplayController(cfg)
    ctrl.select(step=0)
    ctrl.stage(fresh(0, k=3), step=0)  # |A_0| = 3 fresh
    ctrl.commit()
    sel = ctrl.select(step=1)  # replays the 2 newest: 0-2, 0-1
    assert [g.group_id for g in sel.groups] == ["0-2", "0-1"]
    ctrl.stage(fresh(1, k=4), step=1)
    ctrl.commit()  # |A_1| = 4 + 2 = 6
    rec = {r["group_id"]: r for r in (ctrl.buffer.lifetime_record(int(i)) for i in ctrl.buffer.insertion_ids())}
    assert rec["0-0"]["replay_count"] == 0 and rec["0-0"]["exposure"] == pytest.approx(1 / 3)
    assert rec["0-1"]["replay_count"] == 1 and rec["0-1"]["exposure"] == pytest.approx(1 / 3 + 1 / 6)
    assert rec["1-0"]["replay_count"] == 0 and rec["1-0"]["exposure"] == pytest.approx(1 / 6)


def test_ingress_rules_mixed_vs_answer_based_on_multireward():
    pol = policy_at(0)
    rewards = {
        "format_only": [0.0, 0.1, 0.1, 0.0],   # mixed reward, no answer variation
        "answer_mixed": [0.1, 0.9, 1.0, 0.0],
        "all_correct": [0.9, 1.0, 1.0, 0.9],    # mixed reward, all answers right
        "all_same": [1.0, 1.0, 1.0, 1.0],
    }
    gs = [make_group(k, policy=pol, step=0, rewards=v) for k, v in rewards.items()]
    assert [MixedOutcome()(g) for g in gs] == [True, True, True, False]
    assert [AnswerBased(0.9)(g) for g in gs] == [False, True, False, False]
    ctrl = ReplayController(ReplayConfig(ingress="answer", answer_threshold=0.9))
    assert ctrl.stage(gs, step=0) == [False, True, False, False]
    m = ctrl.commit()
    assert m["replay/ingress_admitted"] == 1 and len(ctrl.buffer) == 1
    custom = ReplayController(ReplayConfig(ingress=lambda g: g.group_id == "all_same"))
    assert custom.stage(gs, step=0) == [False, False, False, True]
    with pytest.raises(ReplayConfigError, match="answer_threshold"):
        ReplayConfig(ingress="answer")


def test_protocol_misuse_is_reported():
    ctrl = ReplayController(ReplayConfig())
    with pytest.raises(ReplayProtocolError, match="without an open step"):
        ctrl.commit()
    ctrl.select(step=0, scorer=policy_at(0).scorer)
    with pytest.raises(ReplayProtocolError, match="twice"):
        ctrl.select(step=0, scorer=policy_at(0).scorer)
    with pytest.raises(ReplayProtocolError, match="step 0 is open"):
        ctrl.stage(fresh(1), step=1)
    with pytest.raises(ReplayProtocolError, match="checkpoint after commit"):
        ctrl.state_dict()
    ctrl.commit()
    with pytest.raises(ReplayProtocolError, match="already committed"):
        ctrl.select(step=0, scorer=policy_at(0).scorer)


def test_a_refused_call_never_opens_a_step():
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=3, tau=1.0, capacity=20)), range(3))
    for bad in (lambda: ctrl.select(step=2**63, scorer=policy_at(3).scorer),  # used to open step 2**63
                lambda: ctrl.stage(fresh(3) + [None], step=3),
                lambda: ctrl.stage(fresh(4), step=3),
                lambda: ctrl.select(step=5, scorer=lambda gs: [g.logprobs.abs() + 0.5 for g in gs])):
        with pytest.raises(ReplayInputError):
            bad()
        assert ctrl._open_step is None
    run_steps(ctrl, [4])  # a later step still runs: nothing was left open


def test_stage_rejects_bad_groups_and_stages_nothing():
    ctrl = ReplayController(ReplayConfig(group_size=5))
    with pytest.raises(ReplayInputError, match="birth_step 0 but is staged at step 1"):
        ctrl.stage(fresh(0), step=1)
    ctrl2 = ReplayController(ReplayConfig(group_size=4))
    good = fresh(0, k=2, n=4)
    bad = fresh(0, k=3, n=3)[2:]
    with pytest.raises(ReplayInputError, match="group_size=4"):
        ctrl2.stage(good + bad, step=0)
    ctrl2.stage(good, step=0)
    with pytest.raises(ReplayInputError, match="duplicate group_id"):
        ctrl2.stage(good[:1], step=0)
    ctrl2.commit()
    assert [ctrl2.buffer.group_id(int(i)) for i in ctrl2.buffer.insertion_ids()] == ["0-0", "0-1"]


@pytest.mark.parametrize("selector", ["headroom_drift", "headroom_only", "drift_only", "recency"])
def test_checkpoint_resume_makes_identical_selections(tmp_path, selector):
    cfg = ReplayConfig(selector=selector, k_rep=3, tau=5e-3, capacity=12, scan_chunk=None)
    ref_log, res_log = [], []
    ref = run_steps(ReplayController(cfg), range(12), log=ref_log)
    part = run_steps(ReplayController(cfg), range(6))
    part.save(tmp_path / "ck")
    resumed = ReplayController(cfg)
    resumed.load(tmp_path / "ck")
    run_steps(resumed, range(6, 12), log=res_log)
    assert res_log == ref_log[6:]
    a, b = ref.state_dict(), resumed.state_dict()
    assert a[1] == b[1]
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def test_resume_rejects_foreign_and_mismatched_checkpoints(tmp_path):
    ctrl = run_steps(ReplayController(ReplayConfig(capacity=12)), range(3))
    ctrl.save(tmp_path / "ck")
    ctrl.buffer.save(tmp_path / "buffer_only")
    other = ReplayController(ReplayConfig(capacity=13))
    with pytest.raises(CheckpointError, match="capacity"):
        other.load(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="holds format 'hdreplay.buffer'"):
        ReplayController(ReplayConfig(capacity=12)).load(tmp_path / "buffer_only")
    assert len(other.buffer) == 0 and other.last_step is None


def test_diagnostics_jsonl_and_rewind_on_resume(tmp_path):
    cfg = ReplayConfig(k_rep=2, tau=5e-3, capacity=6)
    d = tmp_path / "diag"
    ctrl = run_steps(ReplayController(cfg, diagnostics_dir=d), range(5))
    ctrl.save(tmp_path / "ck")
    run_steps(ctrl, range(5, 8))
    steps = [json.loads(line) for line in open(d / "steps.jsonl")]
    assert [s["step"] for s in steps] == list(range(8))
    s4 = steps[4]
    assert s4["scanned"] == len(s4["scan_drift"]) == len(s4["scan_age"]) == len(s4["scan_pass"])
    assert s4["accepted"] == len(s4["accepted_ages"]) <= 2
    assert all(dd <= 5e-3 for dd, ok in zip(s4["scan_drift"], s4["scan_pass"]) if ok)
    groups = [json.loads(line) for line in open(d / "groups.jsonl")]
    assert groups and all(g["evicted_step"] is not None for g in groups)
    # resume at step 4: later records are dropped, then re-written by the resumed run
    resumed = ReplayController(cfg, diagnostics_dir=d)
    resumed.load(tmp_path / "ck")
    assert [json.loads(x)["step"] for x in open(d / "steps.jsonl")] == list(range(5))
    assert all(json.loads(x)["evicted_step"] <= 4 for x in open(d / "groups.jsonl"))
    run_steps(resumed, range(5, 8))
    resumed.close()
    again = [json.loads(line) for line in open(d / "steps.jsonl")]
    assert [s["step"] for s in again] == list(range(8))
    assert untimed(again) == untimed(steps)  # identical records after resume (wall-clock seconds aside)
    final = [json.loads(x) for x in open(d / "groups.jsonl")]
    assert sum(g["evicted_step"] is None for g in final) == len(resumed.buffer)


def test_metrics_are_namespaced_and_consistent():
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=20)
    log = []
    run_steps(ReplayController(cfg), range(6), log=log)
    for acc, scanned, m in log:
        m = {k: float("nan") if v is None else v for k, v in m.items()}
        assert all(k.startswith("replay/") for k in m)
        assert m["replay/accepted"] == len(acc) <= 3
        assert m["replay/scanned"] == len(scanned)
        assert m["replay/budget_fill"] == pytest.approx(len(acc) / 3)
        if scanned:
            assert m["replay/accept_rate"] == pytest.approx(len(acc) / len(scanned))
    assert any(0 < m["replay/accept_rate"] < 1 for _, s, m in log if s), "scenario should have rejections"


@pytest.mark.parametrize("kw, needle", [
    (dict(tau=-1e-3), "tau"), (dict(tau=float("nan")), "tau"), (dict(k_rep=-1), "k_rep"),
    (dict(capacity=0), "capacity"), (dict(truncate_multiple=0), "truncate_multiple"),
    (dict(drift_norm="linf"), "drift_norm"), (dict(headroom_weighting="abs"), "headroom_weighting"),
    (dict(ingress="positive"), "ingress"), (dict(scan_chunk=0), "scan_chunk"),
    (dict(acceptance_ema=0.0), "acceptance_ema"), (dict(k_rep=2.0), "k_rep"),
])
def test_config_errors_name_the_field(kw, needle):
    with pytest.raises(ReplayConfigError, match=needle):
        ReplayConfig(**kw)


def _stored(ctrl):
    """group id -> every stored tensor of the group (cloned)."""
    out = {}
    for g in ctrl.buffer.get(ctrl.buffer.insertion_ids()):
        out[g.group_id] = [t.clone() for t in (g.prompt_ids, g.completion_ids, g.response_lengths, g.loss_mask,
                                               g.logprobs, g.advantages, g.rewards)]
    return out


def _unchanged(before, after):
    return all(k in after and all(torch.equal(a, b) for a, b in zip(v, after[k])) for k, v in before.items())


def _run_editing_replayed_groups(ctrl, steps):
    """The driver loop with a caller that edits what it is handed in place (normalises advantages,
    scales log-probs, masks tokens), as trainers do with their own batches."""
    for t in steps:
        pol = policy_at(t)
        sel = ctrl.select(step=t, scorer=lambda gs: [lp.mul_(1.0) for lp in pol.scorer(gs)])
        for g in sel.groups:
            g.advantages.sub_(g.advantages.mean()).div_(3.0)
            g.logprobs.mul_(2.0)
            g.loss_mask.fill_(False)
        ctrl.stage(fresh(t), step=t)
        ctrl.commit()
    return sel


def test_stored_groups_never_change_through_replay_or_what_the_caller_does_with_them(monkeypatch):
    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=3, tau=1.0, capacity=60)), range(3))
    before = _stored(ctrl)
    last = _run_editing_replayed_groups(ctrl, range(3, 7))
    assert len(last.groups) == 3  # groups were replayed (and edited by the caller) every step
    assert _unchanged(before, _stored(ctrl))
    assert np.all(ctrl.buffer.slot_values("ref_headroom", ctrl.buffer.insertion_ids()) >= 0)
    # the check is able to fail: a buffer that scales the stored log-probs of replayed groups is caught
    from hdreplay.store.buffer import ReplayBuffer

    real = ReplayBuffer.record_use

    def scaling_record_use(self, ids, *, weight):
        for i in ids:
            blk, j = self._locate(int(i))
            blk.logprobs[int(blk.tok_off[j]):int(blk.tok_off[j + 1])] *= 1.5
        real(self, ids, weight=weight)

    monkeypatch.setattr(ReplayBuffer, "record_use", scaling_record_use)
    before = _stored(ctrl)
    run_steps(ctrl, range(7, 9))
    assert not _unchanged(before, _stored(ctrl))
