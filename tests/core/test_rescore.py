"""Exact early rejection (hdreplay.rescore), targeted: the bound's denominator is the whole group's loss-token count
(a bound off by one token in either direction fails here), its float64 slack, per-group thresholds, the paper's
refresh over a whole run, and the counterfactual of a sliced scan.  The differential test against a plain rendering
of Algorithm 1 for every setting is tests/core/test_algorithm1.py."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hdreplay import ReplayConfig, ReplayController, select_replay
from hdreplay.rescore import response_slices, sub_group
from hdreplay.scores import drift_rejects, drift_term_sums
from hdreplay.store.record import GroupRecord
from hdreplay_lab.synthetic import drive, make_group, policy_walk
from protocol import reference_scan, run_steps

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.ReplayStarvedWarning")
GATED = ("headroom_drift", "drift_only")


def _controller(cfg, *, steps, seed, walk, n_max, per_step=4):
    """A controller driven ``steps`` steps on random groups (sizes 1..n_max, tool tokens) under a random walk."""
    rng = np.random.default_rng(seed)

    def fresh(t, pol):
        return [make_group(f"{t}-{i}", policy=pol, step=t, n=int(rng.integers(1, n_max + 1)),
                           seed=seed * 7919 + 31 * t + i,
                           max_len=int(rng.integers(1, 12)), tool_every=int(rng.integers(0, 4)))
                for i in range(per_step)]

    def policy(t):
        return policy_walk(t, step_size=walk, walk_seed=seed)

    ctrl = ReplayController(cfg)
    for _ in drive(ctrl, range(steps), policy_at=policy, fresh=fresh):
        pass
    return ctrl, policy(steps)


@given(seed=st.integers(0, 10_000), K=st.integers(1, 6), tau=st.sampled_from([0.0, 1e-3, 5e-3, 2e-2]),
       passes=st.integers(2, 6), floor=st.sampled_from([0.0, 1e-3, 1e-2, 5e-2]), walk=st.sampled_from([0.05, 0.15]))
@settings(max_examples=25, deadline=None)
def test_per_group_thresholds_gate_the_sliced_scan_as_the_full_one(seed, K, tau, passes, floor, walk):
    """Asynchronous pipelines gate some groups on tau + a floor (hdreplay.staleness): early rejection must then prove
    Drift > the group's own threshold, and the decisions are the full scan's, each group passing iff Drift <= it."""
    cfg = ReplayConfig(selector="headroom_drift", k_rep=K, tau=tau, capacity=24, scan_passes=passes, max_scan=24)
    ctrl, pol = _controller(cfg, steps=7, seed=seed, walk=walk, n_max=6)
    taus = lambda groups: [tau + floor * (1 + sum(map(ord, g.group_id)) % 3) for g in groups]  # noqa: E731
    sel = select_replay(ctrl.buffer, cfg, pol.scorer, step=7, tau=taus)
    full = select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_passes=1), pol.scorer, step=7, tau=taus)
    assert sel.accepted.tolist() == full.accepted.tolist() and sel.scanned.tolist() == full.scanned.tolist()
    assert sel.scanned_pass.tolist() == full.scanned_pass.tolist()
    assert sel.scanned_tau.tolist() == full.scanned_tau.tolist() == taus(ctrl.buffer.get(full.scanned.tolist()))
    _, _, ref = reference_scan(ctrl, pol, K, tau, order="headroom", norm="l2")
    for j, i in enumerate(full.scanned.tolist()):
        assert full.scanned_drift[j] == pytest.approx(ref[i][0], rel=1e-6, abs=1e-9)
        assert full.scanned_pass[j] == (full.scanned_drift[j] <= full.scanned_tau[j])
        if not sel.scanned_exact[j]:
            assert sel.scanned_tau[j] < sel.scanned_drift[j] <= full.scanned_drift[j] * (1 + 1e-12)


@pytest.mark.parametrize("selector", GATED)
def test_finish_refresh_runs_the_full_scans_whole_run(selector):
    """With the exact refresh, a whole run (selections, caches, counters) is the full scan's; only costs differ."""
    logs, ctrls = [], []
    for passes, refresh in ((1, "slice"), (4, "finish")):
        cfg = ReplayConfig(selector=selector, k_rep=3, tau=4e-3, capacity=14, scan_passes=passes,
                           scan_refresh=refresh)
        log = []
        ctrls.append(run_steps(ReplayController(cfg), range(14), k=5, log=log))
        logs.append(log)
    cost = ("replay/rescored_rows", "replay/rescored_tokens", "replay/scorer_calls", "replay/rescore_forward_tokens")
    strip = lambda log: [(a, s, {k: v for k, v in m.items() if k not in cost}) for a, s, m in log]  # noqa: E731
    assert strip(logs[0]) == strip(logs[1])
    assert sum(m["replay/rescored_tokens"] for *_, m in logs[1]) < sum(m["replay/rescored_tokens"] for *_, m in logs[0])
    a, b = (c.buffer.state_dict() for c in ctrls)
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1]


# ---------------------------------------------------------------- the bound, token by token
def _group(n=4, L=5):
    """n responses of L loss tokens each (plus a tool token per response, outside T(g))."""
    torch.manual_seed(0)
    lp = [torch.rand(L + 1) * -2 - 0.1 for _ in range(n)]
    masks = [torch.tensor([True] * L + [False]) for _ in range(n)]
    return GroupRecord.from_responses(group_id="g", prompt_ids=[1, 2], completion_ids=[torch.arange(L + 1)] * n,
                                      logprobs=lp, loss_masks=masks, advantages=torch.tensor([1., -1, 1, -1][:n]),
                                      rewards=torch.tensor([1., 0, 1, 0][:n]), birth_step=0)


class _Shifted:
    """Current log-probs = stored - delta on response 0 only; records the responses forwarded."""

    def __init__(self, delta):
        self.delta, self.rows = delta, 0

    def __call__(self, groups):
        out = []
        for g in groups:
            self.rows += g.num_responses
            parts = g.split(g.logprobs.clone())
            if g.num_responses == 4:  # whole group: response 0 is the first
                parts[0] = parts[0] - self.delta
            elif 0 in _responses_of(g):
                parts[0] = parts[0] - self.delta
            out.append(torch.cat(parts))
        return out


def _responses_of(sub):
    full = _group()
    starts = [r[0].item() for r in full.split(full.logprobs)]
    return [starts.index(x[0].item()) for x in sub.split(sub.logprobs)]


def _buffer_with(group, tau, passes=4):
    cfg = ReplayConfig(k_rep=1, tau=tau, capacity=4, scan_passes=passes)
    ctrl = ReplayController(cfg)
    ctrl.stage([group], step=0)
    ctrl.commit()
    return ctrl, cfg


def _slice_sum(group, delta):
    """The float64 sum of response 0's Drift terms, as the scan computes it."""
    sub = sub_group(group, [0])
    return drift_term_sums([sub], [_Shifted(delta)([sub])[0]], drift_norm="l2")[0]


def test_bound_uses_the_whole_groups_token_count():
    g = _group()
    N = g.num_loss_tokens  # 20 (the tool tokens are not in T(g))
    assert N == 20 and [len(s) for s in response_slices(g, 4)] == [1, 1, 1, 1]
    S = _slice_sum(g, 0.3)
    # S / N is just below tau (group admitted: responses 1-3 did not move): the full scan accepts it.  A bound
    # that divides by N - 1 tokens (S > tau (N - 1)) would reject it after the first slice.
    tau = S / (N - 0.5)
    ctrl, cfg = _buffer_with(g, tau)
    scorer = _Shifted(0.3)
    sel = select_replay(ctrl.buffer, cfg, scorer, step=1)
    assert sel.scanned_pass.tolist() == [True] and sel.scanned_exact.tolist() == [True]
    assert scorer.rows == 4
    # S / N just above tau: rejected after the first slice (one row forwarded).  A bound that divides by N + 1
    # (S > tau (N + 1)) would forward the rest of the group.
    tau = S / (N + 0.5)
    ctrl, cfg = _buffer_with(g, tau)
    scorer = _Shifted(0.3)
    sel = select_replay(ctrl.buffer, cfg, scorer, step=1)
    assert sel.scanned_pass.tolist() == [False] and sel.scanned_exact.tolist() == [False]
    assert scorer.rows == 1 and sel.rescored_rows == 1
    assert sel.scanned_drift[0] == pytest.approx(S / N)
    # the full scan agrees on both
    for t, ok in ((S / (N - 0.5), True), (S / (N + 0.5), False)):
        c, f = _buffer_with(g, t, passes=1)
        assert select_replay(c.buffer, f, _Shifted(0.3), step=1).scanned_pass.tolist() == [ok]


def test_bound_allows_for_float64_round_off_only():
    # at S = tau * N exactly the full scan's float64 Drift may round either way: no early rejection there
    assert not drift_rejects(2.0, 20, 0.1)
    assert drift_rejects(2.0 * (1 + 1e-12), 20, 0.1)  # 1e-12 above: rejected (slack 2 * 22 * 2**-53 = 4.9e-15)
    assert not drift_rejects(2.0 * (1 + 1e-15), 20, 0.1)  # within the slack: kept
    assert not drift_rejects(1e30, 2**52, 0.0)  # a group too long for the float64 argument is never cut
    assert drift_rejects(1e-44, 5, 0.0)  # tau = 0: any positive term rejects, a float32 subnormal one too


def test_counterfactual_scores_early_rejected_groups_in_full():
    from hdreplay.diagnostics import Counterfactual

    cfg = ReplayConfig(k_rep=4, tau=1e-3, capacity=30, scan_passes=4)
    from protocol import fresh, policy_at
    recs = []
    for passes in (4, 1):
        ctrl = run_steps(ReplayController(dataclasses.replace(cfg, scan_passes=passes)), range(8), k=5)
        ctrl.observers.append(Counterfactual())
        sel = ctrl.select(step=8, scorer=policy_at(8).scorer)
        assert passes == 1 or not sel.scanned_exact.all()
        ctrl.stage(fresh(8), step=8)
        ctrl.commit()
        recs.append(ctrl.last_record.extras)
    sliced, full = recs
    assert sliced["cf_size"] == full["cf_size"] > 0
    for k in ("cf_drift_recency", "cf_drift_selected"):
        assert sliced[k] == pytest.approx(full[k], rel=1e-12)
    assert sliced["cf_headroom_recency"] == pytest.approx(full["cf_headroom_recency"], abs=1e-6)
