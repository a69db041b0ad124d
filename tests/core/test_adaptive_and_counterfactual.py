import numpy as np
import pytest

from hdreplay import AdaptiveTau, ReplayConfig, ReplayConfigError, ReplayController, TauState, group_scores, update_tau
from functools import partial

from hdreplay_lab.synthetic import TablePolicy, fresh_groups
from hdreplay_lab.synthetic import drive as drive_steps
from protocol import fresh, policy_at, run_steps

CFG = AdaptiveTau(tau_min=1e-4, tau_max=1e-1, factor=2.0, accept_low=0.2, kl_rise=0.25, patience=2, warmup=2)


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
        ReplayConfig(tau=1.0, adaptive_tau=AdaptiveTau(tau_max=0.1))


def test_controller_loosens_a_starved_gate_and_checkpoints_the_schedule(tmp_path):
    cfg = ReplayConfig(k_rep=3, tau=1e-4, capacity=30, adaptive_tau=AdaptiveTau(tau_min=1e-5, tau_max=0.05,
                                                                               warmup=1, patience=0, accept_low=0.3))
    ctrl = run_steps(ReplayController(cfg, diagnostics_dir=tmp_path / "d"), range(8))
    assert ctrl.tau > 1e-4
    ctrl.save(tmp_path / "ck")
    back = ReplayController(cfg)
    back.load(tmp_path / "ck")
    assert back.tau == ctrl.tau and back.tau_state == ctrl.tau_state
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
    cfg = ReplayConfig(k_rep=3, tau=0.5, capacity=30, adaptive_tau=ad)
    ctrl = ReplayController(cfg, diagnostics_dir=tmp_path / "d")
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
    assert ctrl.tau_state == state


def test_counterfactual_scores_the_recency_subset_without_touching_the_buffer():
    cfg = ReplayConfig(k_rep=3, tau=5e-3, capacity=40, counterfactual=True)
    ctrl = run_steps(ReplayController(cfg), range(6))
    buf = ctrl.buffer
    ids = buf.insertion_ids()
    before = buf.slot_values("cached_headroom", ids)
    pol = policy_at(6)
    sel = ctrl.select(step=6, scorer=pol.scorer)
    assert len(sel.accepted) > 0
    assert sel.cf_ids.tolist() == buf.order_by_recency(len(sel.accepted)).tolist()
    groups = buf.get(sel.cf_ids.tolist())
    ref = group_scores(groups, pol.scorer(groups))
    assert np.allclose(sel.cf_drift, ref.drift.numpy()) and np.allclose(sel.cf_headroom, ref.headroom.numpy())
    ctrl.stage(fresh(6), step=6)
    ctrl.commit()
    after = buf.slot_values("cached_headroom", ids)
    scanned = set(sel.scanned.tolist())
    for i, b, a in zip(ids.tolist(), before, after):
        if i not in scanned:
            assert a == b  # counterfactual-only groups keep their cache
    rec = ctrl.last_record
    assert rec.cf_size == len(sel.accepted)
    assert rec.cf_drift_recency == pytest.approx(float(np.mean(sel.cf_drift)))
