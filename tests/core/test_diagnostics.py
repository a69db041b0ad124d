"""The observers of hdreplay.diagnostics: adaptive tau, the same-buffer counterfactual, the ungated diagnosis --
around the controller, never changing what it replays."""

from functools import partial

import numpy as np
import pytest

from hdreplay import ReplayConfig, ReplayConfigError, ReplayController, group_scores
from hdreplay.diagnostics import (
    AdaptiveTau,
    Counterfactual,
    DiagnosticsConfig,
    TauState,
    UngatedDiagnosis,
    observers,
    update_tau,
)
from hdreplay_lab.synthetic import TablePolicy, fresh_groups
from hdreplay_lab.synthetic import drive as drive_steps
from protocol import fresh, policy_at, run_steps

CFG = AdaptiveTau(tau_min=1e-4, tau_max=1e-1, factor=2.0, accept_low=0.2, kl_rise=0.25, patience=2, warmup=2)


def adaptive(cfg: ReplayConfig, schedule: AdaptiveTau, **kw) -> ReplayController:
    return ReplayController(cfg, observers=observers(DiagnosticsConfig(adaptive_tau=schedule), cfg), **kw)


def drive(records, tau=1e-3):
    s = TauState(tau=tau)
    out = []
    for r in records:
        s = update_tau(s, r, CFG)
        out.append((s.tau, s.last_action))
    return out


def test_starved_gate_is_loosened_up_to_the_bound():
    starved = [{"accept_rate": 0.02, "budget_fill": 0.1, "replay_kl": 1e-5}] * 40
    traj = drive(starved)
    assert traj[0] == (1e-3, "hold") and traj[1] == (1e-3, "hold")  # warmup
    assert traj[2] == (2e-3, "loosen") and traj[3][1] == traj[4][1] == "hold"  # patience
    assert traj[-1][0] == pytest.approx(0.1)  # clamped at tau_max
    assert all(t <= 0.1 for t, _ in traj)


def test_rising_replay_kl_tightens_and_flat_kl_holds():
    rising = [{"accept_rate": 0.95, "budget_fill": 1.0, "replay_kl": 0.002 * 1.3 ** i} for i in range(30)]
    traj = drive(rising, tau=0.05)
    assert any(a == "tighten" for _, a in traj) and traj[-1][0] < 0.05
    assert all(t >= 1e-4 for t, _ in traj)
    flat = [{"accept_rate": 0.5, "budget_fill": 1.0, "replay_kl": 0.002}] * 30
    assert all(a == "hold" for _, a in drive(flat, tau=0.01))


def test_adaptive_tau_bad_settings_and_bounds():
    with pytest.raises(ReplayConfigError):
        AdaptiveTau(tau_min=0.1, tau_max=0.01)
    with pytest.raises(ReplayConfigError):
        AdaptiveTau(factor=1.0)
    with pytest.raises(ReplayConfigError, match="within adaptive_tau's bounds"):
        observers(DiagnosticsConfig(adaptive_tau=AdaptiveTau(tau_max=0.1)), ReplayConfig(tau=1.0))
    with pytest.raises(ReplayConfigError, match="adaptive_tau: not valid JSON"):
        DiagnosticsConfig(adaptive_tau="{tau_min")
    assert DiagnosticsConfig(adaptive_tau='{"tau_min": 1e-5}').adaptive_tau == AdaptiveTau(tau_min=1e-5)
    with pytest.raises(ReplayConfigError, match="unique str `name`"):
        ReplayController(ReplayConfig(), observers=[Counterfactual(), Counterfactual()])


def test_controller_loosens_a_starved_gate_and_checkpoints_the_schedule(tmp_path):
    cfg = ReplayConfig(k_rep=3, tau=1e-4, capacity=30)
    schedule = AdaptiveTau(tau_min=1e-5, tau_max=0.05, warmup=1, patience=0, accept_low=0.3)
    ctrl = run_steps(adaptive(cfg, schedule, diagnostics_dir=tmp_path / "d"), range(8))
    assert ctrl.tau > 1e-4
    ctrl.save(tmp_path / "ck")
    back = adaptive(cfg, schedule)
    back.load(tmp_path / "ck")
    assert back.tau == ctrl.tau and back.observers[0].state == ctrl.observers[0].state
    plain = ReplayController(cfg)  # without the observer, a resumed run gates with the configured tau
    plain.load(tmp_path / "ck")
    assert plain.tau == 1e-4
    import json

    recs = [json.loads(x) for x in open(tmp_path / "d" / "steps.jsonl")]
    assert [r["tau_next"] for r in recs[:-1]] == [r["tau"] for r in recs[1:]]
    assert any(r["tau_action"] == "loosen" for r in recs)


def accelerating(t: int) -> TablePolicy:
    """A policy that moves further each step (step size 0.01 x 1.35^s): older stored groups drift away ever faster."""
    pol = TablePolicy(seed=1)
    for s in range(1, t + 1):
        pol = pol.perturbed(0.01 * 1.35 ** s, seed=1000 + s)
    return pol


def test_controller_tightens_when_replay_kl_rises(tmp_path):
    """The tighten branch through the real controller: a loose gate admits most scanned groups while the policy
    moves faster each step, so the replay KL of what it replays rises.  The controller halves tau (not below
    tau_min), the next select gates with the tightened tau, steps.jsonl logs each decision, and replaying
    update_tau over the logged records gives the same schedule."""
    import json

    ad = AdaptiveTau(tau_min=1e-3, tau_max=1.0, accept_low=0.0, warmup=2, patience=1)
    cfg = ReplayConfig(k_rep=3, tau=0.5, capacity=30)
    ctrl = adaptive(cfg, ad, diagnostics_dir=tmp_path / "d")
    steps = list(drive_steps(ctrl, range(14), policy_at=accelerating, fresh=partial(fresh_groups, per_step=5)))
    recs = [json.loads(x) for x in open(tmp_path / "d" / "steps.jsonl")]
    actions = [r["tau_action"] for r in recs]
    assert "tighten" in actions and "loosen" not in actions, actions
    first = actions.index("tighten")
    kls = [r["replay_kl"] for r in recs if r["replay_kl"] is not None]
    assert recs[first]["replay_kl"] > 1.25 * kls[0]  # the KL did rise before the first tightening
    assert recs[first]["tau_next"] == pytest.approx(recs[first]["tau"] / 2)
    assert [r["tau_next"] for r in recs[:-1]] == [r["tau"] for r in recs[1:]]  # each step gates with the last decision
    assert 1e-3 <= ctrl.tau < 0.5
    for st, r in zip(steps, recs):  # what the gate accepted passes the tau of its step
        sel = st.selection
        assert sel.tau == r["tau"] and (sel.scanned_drift[sel.scanned_pass] <= r["tau"]).all()
    state = TauState(tau=0.5)
    for r in recs:
        state = update_tau(state, r, ad)
        assert (state.tau, state.last_action) == (r["tau_next"], r["tau_action"])
    assert ctrl.observers[0].state == state


def test_counterfactual_scores_the_recency_subset_without_touching_the_buffer():
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=40)
    ctrl = run_steps(ReplayController(cfg, observers=[Counterfactual()]), range(6))
    buf = ctrl.buffer
    ids = buf.insertion_ids()
    before = buf.slot_values("cached_headroom", ids)
    pol = policy_at(6)
    sel = ctrl.select(step=6, scorer=pol.scorer)
    assert len(sel.accepted) > 0
    recent = buf.order_by_recency(len(sel.accepted)).tolist()
    groups = buf.get(recent)
    ref = group_scores(groups, pol.scorer(groups))
    rows_before = sel.rescored_rows
    ctrl.stage(fresh(6), step=6)
    ctrl.commit()
    after = buf.slot_values("cached_headroom", ids)
    scanned = set(sel.scanned.tolist())
    for i, b, a in zip(ids.tolist(), before, after):
        if i not in scanned:
            assert a == b  # counterfactual-only groups keep their cache
    rec = ctrl.last_record
    assert rec.extras["cf_size"] == len(sel.accepted) == len(recent)
    assert rec.extras["cf_drift_recency"] == pytest.approx(float(ref.drift.mean()))
    assert rec.extras["cf_headroom_recency"] == pytest.approx(float(ref.headroom.mean()), abs=1e-6)
    chosen = [list(sel.scanned).index(i) for i in sel.accepted.tolist()]
    assert rec.extras["cf_drift_selected"] == pytest.approx(float(sel.scanned_drift[chosen].mean()))
    missing = [g for g, i in zip(groups, recent) if i not in set(sel.scanned[sel.scanned_exact].tolist())]
    assert rec.rescored_rows == rows_before + sum(g.num_responses for g in missing)  # its forward is counted
    assert rec.to_json()["cf_size"] == len(recent)  # flat in steps.jsonl, as before


def test_a_fixed_tau_is_the_controllers_own_zero_included_and_the_schedule_refuses_zero(tmp_path):
    from hdreplay import ReplayInputError
    from hdreplay.diagnostics import advance_tau

    fixed = ReplayController(ReplayConfig(k_rep=2, tau=0.0, capacity=8))
    assert fixed.tau == 0.0
    run_steps(fixed, range(3))
    unchanged = fixed.select(step=3, scorer=lambda gs: [g.logprobs for g in gs])  # Drift exactly 0 passes tau = 0
    assert len(unchanged.groups) == 2 and unchanged.tau == 0.0
    fixed.stage(fresh(3), step=3)
    fixed.commit()
    moved = fixed.select(step=4, scorer=policy_at(9).scorer)  # any policy change fails it
    assert len(moved.groups) == 0 and (moved.scanned_drift > 0).all()
    fixed.stage(fresh(4), step=4)
    fixed.commit()
    with pytest.raises(ReplayInputError, match="tau"):
        fixed.tau = -1.0
    assert fixed.tau == 0.0
    with pytest.raises(ReplayInputError, match="state.tau"):  # the schedule, not TauState, refuses a tau of 0
        advance_tau(TauState(tau=0.0), CFG, accept_rate=0.0, budget_fill=0.0, replay_kl=None)
    ad = adaptive(ReplayConfig(k_rep=2, tau=1e-3, capacity=8), CFG)
    run_steps(ad, range(8))
    obs = ad.observers[0]
    assert ad.tau == obs.state.tau and obs.state.steps == 8
    assert ad.checkpoint_state()[1]["observers"]["adaptive_tau"] == obs.state.to_dict()


def test_ungated_diagnosis_scores_recency_without_changing_it():
    cfg = ReplayConfig(selector="recency", k_rep=3, tau=1e-3, capacity=40)
    plain, seen = ReplayController(cfg), ReplayController(cfg, observers=[UngatedDiagnosis()])
    for t in range(6):
        run_steps(plain, [t])
        run_steps(seen, [t])
    pol = policy_at(6)
    a, b = plain.select(step=6, scorer=pol.scorer), seen.select(step=6, scorer=pol.scorer)
    assert not a.scored and b.scored and a.accepted.tolist() == b.accepted.tolist() == b.scanned.tolist()
    ref = group_scores(b.groups, pol.scorer(b.groups))
    np.testing.assert_allclose(b.scanned_drift, ref.drift.numpy(), rtol=1e-12)
    for c in (plain, seen):
        c.stage(fresh(6), step=6)
        c.commit()
    assert plain.last_record.replay_kl is None and seen.last_record.replay_kl is not None


class _Rogue:
    name = "rogue"

    def on_select(self, controller, sel, scorer):
        import dataclasses
        return dataclasses.replace(sel, accepted=sel.accepted[:0], groups=[])


def test_an_observer_cannot_change_the_decisions():
    from hdreplay import ReplayProtocolError

    ctrl = run_steps(ReplayController(ReplayConfig(k_rep=2, tau=1.0, capacity=8)), range(3))
    ctrl.observers.append(_Rogue())
    with pytest.raises(ReplayProtocolError, match="same accepted groups"):
        ctrl.select(step=3, scorer=policy_at(3).scorer)
