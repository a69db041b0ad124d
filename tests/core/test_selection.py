"""Selection invariants (DESIGN section 1) on buffers built through the real controller protocol."""

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hdreplay import (
    SELECTORS,
    ReplayConfig,
    ReplayConfigError,
    ReplayController,
    ReplayInputError,
    drift,
    select_replay,
)
from protocol import build, reference_scan

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.ReplayStarvedWarning")  # tau = 0 starves on purpose

@given(seed=st.integers(0, 500), K=st.integers(0, 12), tau=st.sampled_from([0.0, 1e-3, 5e-3, 2e-2, 1.0]),
       cap=st.integers(1, 25), chunk=st.sampled_from([None, 1, 3, 50]))
def test_headroom_drift_invariants_and_chunked_equals_one_at_a_time(seed, K, tau, cap, chunk):
    cfg = ReplayConfig(k_rep=K, tau=tau, capacity=cap, scan_chunk=chunk)
    ctrl, pol = build(cfg, seed=seed)
    ref_acc, ref_scan, _ = reference_scan(ctrl, pol, K, tau)
    sel = select_replay(ctrl.buffer, cfg, pol.scorer, step=6, acceptance_rate=ctrl.acceptance_rate)
    assert sel.accepted.tolist() == ref_acc
    assert sel.scanned.tolist() == ref_scan
    assert len(sel.accepted) <= K
    assert bool((sel.scanned_drift[sel.scanned_pass] <= tau).all())
    # Proposition 3: R_t = top-K of the Drift-feasible set under cached order, within the scanned prefix
    feasible = [i for i, ok in zip(sel.scanned.tolist(), sel.scanned_pass) if ok]
    assert sel.accepted.tolist() == feasible[:K]
    # early termination: the scan stops right at the K-th acceptance
    if len(sel.accepted) == K and K > 0:
        assert sel.scanned_pass[-1]
    # every group scored at most once
    assert sum(len(x) for x in [sel.scanned]) == len(set(sel.scanned.tolist()))
    assert [g.group_id for g in sel.groups] == [ctrl.buffer.group_id(int(i)) for i in sel.accepted]


@pytest.mark.parametrize("passes", [1, 2, 4])
def test_each_response_scored_at_most_once_per_step(passes):
    cfg = ReplayConfig(k_rep=6, tau=4e-3, capacity=40, scan_chunk=None, scan_passes=passes)
    ctrl, pol = build(cfg, steps=8, per_step=6)
    seen, rows = Counter(), Counter()

    def scorer(groups):
        seen.update(g.group_id for g in groups)
        rows.update({g.group_id: g.num_responses for g in groups})
        return pol.scorer(groups)

    sel = select_replay(ctrl.buffer, cfg, scorer, step=8, acceptance_rate=0.3)
    n = {g.group_id: g.num_responses for g in ctrl.buffer.get(ctrl.buffer.insertion_ids().tolist())}
    assert all(rows[g] <= n[g] for g in rows)  # a response is forwarded at most once
    assert max(seen.values()) <= passes  # and a group in at most `passes` slices
    assert len(seen) == len(sel.scanned) + sel.scored_unused
    assert sum(rows.values()) == sel.rescored_rows
    assert sel.scorer_calls == len(pol.calls)  # every call of this selection, and only those
    assert sum(pol.calls) == sum(sel.chunk_sizes)


def test_auto_chunk_follows_acceptance_rate():
    cfg = ReplayConfig(k_rep=4, tau=1.0, capacity=50, scan_passes=1)
    ctrl, pol = build(cfg, steps=10)
    s1 = select_replay(ctrl.buffer, cfg, pol.scorer, step=10, acceptance_rate=1.0)
    s2 = select_replay(ctrl.buffer, cfg, pol.scorer, step=10, acceptance_rate=0.25)
    assert s1.chunk_sizes == [4] and s1.scored_unused == 0
    assert s2.chunk_sizes == [16] and s2.scored_unused == 12
    assert s1.accepted.tolist() == s2.accepted.tolist()  # chunking never changes the outcome
    # sliced: the same window, one slice of each group, then the rest of the groups that look admissible
    s3 = select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_passes=4), pol.scorer, step=10,
                       acceptance_rate=0.25)
    assert s3.chunk_sizes == [16, 16] and s3.accepted.tolist() == s2.accepted.tolist()


@pytest.mark.parametrize("name", ["recency", "drift_only", "headroom_only", "none"])
def test_baseline_selectors(name):
    cfg = ReplayConfig(selector=name, k_rep=4, tau=3e-3, capacity=30)
    ctrl, pol = build(cfg)
    n_calls = len(pol.calls)
    sel = select_replay(ctrl.buffer, cfg, pol.scorer, step=6)
    gate = SELECTORS[name].gate
    if name == "none":
        assert sel.accepted.tolist() == [] and len(pol.calls) == n_calls
        return
    order = "recency" if name in ("recency", "drift_only") else "headroom"
    ref_acc, ref_scan, _ = reference_scan(ctrl, pol, 4, 3e-3, gate=gate, order=order)
    assert sel.accepted.tolist() == ref_acc
    if name == "recency":
        assert len(pol.calls) == n_calls  # no forward pass spent
        assert sel.accepted.tolist() == ctrl.buffer.insertion_ids()[::-1][:4].tolist()
    else:
        assert sel.scanned.tolist() == ref_scan


def test_recency_with_the_ungated_diagnosis_is_scored_but_not_gated():
    from hdreplay.diagnostics import UngatedDiagnosis

    cfg = ReplayConfig(selector="recency", k_rep=4, tau=0.0, capacity=30)
    ctrl, pol = build(cfg)
    ctrl.observers.append(UngatedDiagnosis())
    sel = ctrl.select(step=6, scorer=pol.scorer)
    assert sel.scored and len(sel.accepted) == 4 and sel.scanned_pass.all()
    assert (sel.scanned_drift > 0).any()
    assert sel.accepted.tolist() == select_replay(ctrl.buffer, cfg, None, step=6).accepted.tolist()


def test_truncation_keeps_highest_priority_prefix():
    cfg = ReplayConfig(k_rep=7, tau=1.0, capacity=30, truncate_multiple=3)
    ctrl, pol = build(cfg)
    full = select_replay(ctrl.buffer, dataclasses.replace(cfg, truncate_multiple=1), pol.scorer, step=6)
    cut = select_replay(ctrl.buffer, cfg, pol.scorer, step=6)
    assert cut.accepted.tolist() == full.accepted.tolist()[:6]
    assert cut.truncated.tolist() == full.accepted.tolist()[6:]
    assert len(cut.groups) == 6


@pytest.mark.parametrize("bad", ["length", "nan", "positive", "count", "type"])
def test_bad_scorer_output_raises_and_buffer_unchanged(bad):
    cfg = ReplayConfig(k_rep=3, tau=1.0, capacity=10)
    ctrl, pol = build(cfg, steps=3)
    before = ctrl.buffer.state_dict()

    def scorer(groups):
        out = pol.scorer(groups)
        if bad == "length":
            out[0] = out[0][:-1]
        elif bad == "nan":
            out[0][0] = float("nan")
        elif bad == "positive":
            out[0][0] = 0.7
        elif bad == "count":
            out = out[:-1]
        else:
            out = torch.stack([o[:1] for o in out])
        return out

    with pytest.raises(ReplayInputError):
        ctrl.select(step=3, scorer=scorer)
    after = ctrl.buffer.state_dict()
    assert before[1] == after[1] and all(torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_unknown_selector_lists_valid_names():
    with pytest.raises(ReplayConfigError) as e:
        ReplayConfig(selector="per")
    for name in SELECTORS:
        assert name in str(e.value)


def test_gate_uses_l1_when_configured():
    cfg2 = ReplayConfig(k_rep=50, tau=0.05, capacity=50, drift_norm="l2")
    cfg1 = dataclasses.replace(cfg2, drift_norm="l1")
    ctrl, pol = build(cfg2, steps=8)
    s1 = select_replay(ctrl.buffer, cfg1, pol.scorer, step=8)
    for i, d in zip(s1.scanned.tolist(), s1.scanned_drift):
        g = ctrl.buffer.get([i])[0]
        cur = pol.token_logprobs(g.completion_ids, g.response_lengths)
        ref = drift(logprobs=cur[None], ref_logprobs=g.logprobs[None], mask=g.loss_mask[None], norm="l1")
        if s1.scanned_exact[s1.scanned.tolist().index(i)]:
            assert d == pytest.approx(float(ref), rel=1e-6)
        else:  # rejected early: a lower bound, already above tau
            assert 0.05 < d <= float(ref) * (1 + 1e-6)
    assert not s1.scanned_exact.all()  # the L1 bound rejected some early


def test_scan_budget_caps_rescoring_and_is_reported():
    cfg = ReplayConfig(k_rep=3, tau=0.0, capacity=40, max_scan=7)  # tau 0: nothing passes a moved policy
    ctrl, pol = build(cfg, steps=8)
    sel = select_replay(ctrl.buffer, cfg, pol.scorer, step=8)
    assert len(sel.scanned) + sel.scored_unused <= 7 and len(sel.scanned) == 7 and sel.scan_capped
    assert sum(pol.calls) == len(sel.scanned) + sel.scored_unused
    auto = ReplayConfig(k_rep=3, capacity=40)
    assert auto.scan_budget == 40 and ReplayConfig(k_rep=3, capacity=10).scan_budget == 10  # unset: the buffer
    full = select_replay(ctrl.buffer, dataclasses.replace(cfg, max_scan=None, capacity=40), pol.scorer, step=8)
    assert len(full.scanned) == len(ctrl.buffer) and not full.scan_capped  # the paper's scan: to the end


def test_a_starved_gate_warns_once_after_several_steps():
    from hdreplay import ReplayStarvedWarning
    from protocol import run_steps

    ctrl = ReplayController(ReplayConfig(k_rep=2, tau=0.0, capacity=30))
    with pytest.warns(ReplayStarvedWarning, match="starved for 5 steps") as rec:
        run_steps(ctrl, range(12))
    assert len([w for w in rec if issubclass(w.category, ReplayStarvedWarning)]) == 1
