"""The library against a plain rendering of the paper's Algorithm 1, written from the paper, in float64.

``algorithm1`` below reads the paper (Sec. 3, Algorithm 1, Appendix A.3 / F), not the library: it sorts the
pre-existing buffer by cached Headroom (descending, ties to the older group) or by recency, walks it, computes each
group's Drift and runtime Headroom in float64 from the current policy's log-probs of the stored tokens, admits a group
iff Drift <= tau (ungated orders admit every group), stops at K_rep admitted groups, and keeps the first u * floor(m/u).
``PaperBuffer`` adds what happens around the selection: ingress (mixed / answer-based / all), Headroom cached at
ingress from the generation log-probs, refreshed for every scanned group, FIFO eviction beyond capacity.

The library is held to it for the paper's selectors (headroom_drift, headroom_only, drift_only, recency), both
norms, both Headroom weightings, each ingress rule, random slicings of the walk (scan_passes, scan_chunk, the
running acceptance rate, a token budget per forward with speculative scoring of the groups beyond the stop) and both
early-rejection refreshes: decisions, scan order, admitted groups, Drift, and the
refreshed Headroom wherever the paper defines it (every scanned group under the paper's refresh; the groups forwarded
whole otherwise).  Numbers of the library and the reference agree to float64 round-off for Drift and to float32
round-off for Headroom (the library keeps Headroom in float32; a decision could differ only for a Drift within ~1e-15
of tau, which random continuous log-probs never hit).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hdreplay import ReplayConfig, ReplayController, select_replay
from hdreplay_lab.synthetic import TablePolicy, make_group, policy_walk

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.ReplayStarvedWarning")

#: the paper's selectors: (order, gated)
PAPER_SELECTORS = {"headroom_drift": ("headroom", True), "headroom_only": ("headroom", False),
                   "drift_only": ("recency", True), "recency": ("recency", False)}


# ----------------------------------------------------------------------------------------- the paper, in float64
def responses(g):
    """Per response i: (token ids, loss mask, generation log-probs pi_gen, advantage A_i, reward r_i)."""
    cuts = np.cumsum([0] + g.response_lengths.tolist())
    arrays = [g.completion_ids.numpy(), g.loss_mask.numpy().astype(bool), g.logprobs.numpy().astype(np.float64)]
    return [tuple(a[cuts[i]:cuts[i + 1]] for a in arrays) + (float(g.advantages[i]), float(g.rewards[i]))
            for i in range(len(cuts) - 1)]


def drift64(g, current, norm):
    """Drift(g) = mean over T(g) of (log pi_theta - log pi_gen)^2 (l2) or |.| (l1), in float64."""
    cur, gen, mask = (np.asarray(current, dtype=np.float64), g.logprobs.numpy().astype(np.float64),
                      g.loss_mask.numpy().astype(bool))
    d = (cur - gen)[mask]
    return float(np.mean(d ** 2 if norm == "l2" else np.abs(d)))


def headroom64(g, logprobs, weighting):
    """Headroom = mean over T(g) of h_ij, h = 1 - p if A_i > 0, p if A_i < 0, 0 if A_i = 0 ("sign"); "advantage":
    sum |A_i| h_ij / sum |A_i| over T(g) (0 when every A_i is 0)."""
    p = np.exp(np.minimum(np.asarray(logprobs, dtype=np.float64), 0.0))
    adv = np.repeat(g.advantages.numpy().astype(np.float64), g.response_lengths.numpy())
    mask = g.loss_mask.numpy().astype(bool)
    h = np.where(adv > 0, 1.0 - p, np.where(adv < 0, p, 0.0))[mask]
    if weighting == "sign":
        return float(h.mean())
    w = np.abs(adv[mask])
    return float((w * h).sum() / w.sum()) if w.sum() > 0 else 0.0


def admitted_at_ingress(g, rule, threshold):
    r = g.rewards.numpy()
    if rule == "all":
        return True
    if rule == "mixed":
        return bool((r != r[0]).any())
    s = int((r >= threshold).sum())
    return 1 <= s <= len(r) - 1


def algorithm1(entries, current, *, K, tau, selector, norm, weighting, u):
    """Lines 6-14 of Algorithm 1 (+ App. F's truncation) over ``entries``: oldest first, each a dict with ``id``,
    ``group``, ``cached`` (the cached Headroom).  Returns (admitted ids, [(id, Drift, runtime Headroom, passed)])."""
    order, gated = PAPER_SELECTORS[selector]
    if order == "headroom":  # descending cached Headroom; ties: the older group first
        ranked = sorted(entries, key=lambda e: (-e["cached"], e["id"]))
    else:
        ranked = entries[::-1]
    R, scanned = [], []
    for e in ranked:
        if len(R) >= K:
            break
        if not gated and selector == "recency":  # "GRPO + replay": the latest K, nothing re-scored
            R.append(e["id"])
            scanned.append((e["id"], None, None, True))
            continue
        lp = current(e["group"])
        d, h = drift64(e["group"], lp, norm), headroom64(e["group"], lp, weighting)
        ok = (not gated) or d <= tau
        scanned.append((e["id"], d, h, ok))
        if ok:
            R.append(e["id"])
    return R[: len(R) // u * u], scanned


class PaperBuffer:
    """The buffer around Algorithm 1: ingress after the update, H_ref at ingress, refresh of scanned groups, FIFO."""

    def __init__(self, capacity, rule, threshold, weighting):
        self.capacity, self.rule, self.threshold, self.weighting = capacity, rule, threshold, weighting
        self.entries, self.next_id = [], 0

    def step(self, scanned, fresh):
        at = {e["id"]: e for e in self.entries}
        for i, _, h, _ in scanned:
            if h is not None:
                at[i]["cached"] = h
        for g in fresh:
            if admitted_at_ingress(g, self.rule, self.threshold):
                self.entries.append({"id": self.next_id, "group": g,
                                     "cached": headroom64(g, g.logprobs.numpy(), self.weighting)})
                self.next_id += 1
        self.entries = self.entries[-self.capacity:]


# ----------------------------------------------------------------------------------------- the data
def fresh(t, policy, rng, per_step, n_max):
    out = []
    for i in range(per_step):
        n = int(rng.integers(1, n_max + 1))
        rewards = rng.choice([0.0, 0.1, 0.9, 1.0], size=n).tolist()  # zero-variance groups happen
        out.append(make_group(f"{t}-{i}", policy=policy, step=t, n=n, seed=int(rng.integers(1 << 30)),
                              rewards=rewards, max_len=int(rng.integers(1, 10)), tool_every=int(rng.integers(0, 4))))
    return out


def current_of(policy: TablePolicy):
    return lambda g: policy.token_logprobs(g.completion_ids, g.response_lengths).numpy()


SETTINGS = dict(
    seed=st.integers(0, 100_000), selector=st.sampled_from(sorted(PAPER_SELECTORS)), norm=st.sampled_from(["l2", "l1"]),
    weighting=st.sampled_from(["sign", "advantage"]), ingress=st.sampled_from(["mixed", "answer", "all"]),
    K=st.integers(1, 8), tau=st.sampled_from([0.0, 1e-3, 5e-3, 2e-2, 0.1]), u=st.integers(1, 3),
    passes=st.integers(1, 8), chunk=st.sampled_from([None, 1, 3]), rate=st.sampled_from([0.02, 0.1, 0.5, 1.0]),
    walk=st.sampled_from([0.02, 0.05, 0.15]), n_max=st.integers(1, 8), budget=st.sampled_from([None, 1.0, 1.7, 4.0]),
    latency_bound=st.booleans())


def scan_tokens(buffer, budget):
    """A token budget per forward of ``budget`` x the buffer's largest group (None: no budget): windows filled to
    whole forwards, further groups scored speculatively, slicing decided by the acceptance rate."""
    if budget is None or not len(buffer):
        return None
    return max(1, int(budget * buffer.forward_tokens(buffer.insertion_ids()).max()))


def _config(selector, norm, weighting, ingress, K, tau, u, passes, chunk, refresh, capacity):
    return ReplayConfig(selector=selector, k_rep=K, tau=tau, capacity=capacity, drift_norm=norm,
                        headroom_weighting=weighting, ingress=ingress, answer_threshold=0.9, truncate_multiple=u,
                        scan_passes=passes, scan_chunk=chunk, scan_refresh=refresh, max_scan=capacity)


def _check_selection(sel, ref_admitted, ref_scanned, insertion_ids, *, exact_refresh):
    """The library's selection against the reference's, ``insertion_ids`` mapping reference ids to the library's."""
    assert sel.accepted.tolist() == [insertion_ids[i] for i in ref_admitted]
    if not sel.scored:  # recency replay re-scores nothing: the latest K, as the paper's "GRPO + replay"
        assert sel.accepted.tolist() + sel.truncated.tolist() == [insertion_ids[r[0]] for r in ref_scanned]
        return
    assert sel.scanned.tolist() == [insertion_ids[r[0]] for r in ref_scanned]
    assert sel.scanned_pass.tolist() == [r[3] for r in ref_scanned]
    for j, (_, d, h, ok) in enumerate(ref_scanned):
        if sel.scanned_exact[j]:
            assert sel.scanned_drift[j] == pytest.approx(d, rel=1e-12, abs=1e-300)
        else:  # rejected early: a lower bound of Drift that already exceeds tau
            assert not ok and sel.scanned_drift[j] <= d * (1 + 1e-12)
        if sel.scanned_exact[j] or exact_refresh:
            assert sel.scanned_headroom[j] == pytest.approx(h, abs=2e-6)


@given(**SETTINGS, refresh=st.sampled_from(["slice", "finish"]))
@settings(max_examples=60, deadline=None)
def test_a_selection_is_algorithm_1(seed, selector, norm, weighting, ingress, K, tau, u, passes, chunk, rate, walk,
                                    n_max, budget, latency_bound, refresh):
    """One step: the library's buffer state after a few steps, selected by the library and by the reference."""
    cfg = _config(selector, norm, weighting, ingress, K, tau, u, passes, chunk, refresh, capacity=20)
    rng = np.random.default_rng(seed)
    ctrl = ReplayController(cfg)
    for t in range(6):
        pol = policy_walk(t, step_size=walk, walk_seed=seed)
        ctrl.select(step=t, scorer=pol.scorer)
        ctrl.stage(fresh(t, pol, rng, 4, n_max), step=t)
        ctrl.commit()
    buf, pol = ctrl.buffer, policy_walk(6, step_size=walk, walk_seed=seed)
    ids = buf.insertion_ids().tolist()
    entries = [{"id": i, "group": g, "cached": c} for i, g, c in
               zip(ids, buf.get(ids), buf.slot_values("cached_headroom", ids).tolist())]
    ref_admitted, ref_scanned = algorithm1(entries, current_of(pol), K=K, tau=tau, selector=selector, norm=norm,
                                           weighting=weighting, u=u)
    sel = select_replay(buf, cfg, pol.scorer, step=6, acceptance_rate=rate, scan_tokens=scan_tokens(buf, budget),
                        latency_bound=latency_bound)
    _check_selection(sel, ref_admitted, ref_scanned, {i: i for i in ids}, exact_refresh=refresh == "finish")


@given(**SETTINGS, paper_refresh=st.sampled_from(["passes=1", "finish"]))
@settings(max_examples=30, deadline=None)
def test_a_run_is_algorithm_1_step_after_step(seed, selector, norm, weighting, ingress, K, tau, u, passes, chunk,
                                               rate, walk, n_max, budget, latency_bound, paper_refresh):
    """Many steps from an empty buffer, the library against the paper's loop with its own buffer: every step's scan,
    decisions and admitted groups, and the buffer (group ids, order) after every commit."""
    passes = 1 if paper_refresh == "passes=1" else passes
    cfg = _config(selector, norm, weighting, ingress, K, tau, u, passes, chunk, "finish", capacity=12)
    rng = np.random.default_rng(seed)
    ctrl, paper = ReplayController(cfg), PaperBuffer(12, ingress, 0.9, weighting)
    for t in range(9):
        pol = policy_walk(t, step_size=walk, walk_seed=seed)
        ref_admitted, ref_scanned = algorithm1(paper.entries, current_of(pol), K=K, tau=tau, selector=selector,
                                               norm=norm, weighting=weighting, u=u)
        sel = ctrl.select(step=t, scorer=pol.scorer, scan_tokens=scan_tokens(ctrl.buffer, budget),
                          latency_bound=latency_bound)
        ids = dict(zip([e["id"] for e in paper.entries], ctrl.buffer.insertion_ids().tolist()))
        _check_selection(sel, ref_admitted, ref_scanned, ids, exact_refresh=True)
        groups = fresh(t, pol, rng, 4, n_max)
        ctrl.stage(groups, step=t)
        ctrl.commit()
        paper.step(ref_scanned, groups)
        lib = ctrl.buffer.insertion_ids().tolist()
        assert ctrl.buffer.group_ids(lib) == [e["group"].group_id for e in paper.entries]
        cached = ctrl.buffer.slot_values("cached_headroom", lib)
        np.testing.assert_allclose(cached, [e["cached"] for e in paper.entries], atol=2e-6)


# ----------------------------------------------------------------------------------------- the tau = 0 corner
def _one_moved_token(delta: float):
    """A buffered group of 8 responses whose current log-probs differ from the stored ones at one token by ``delta``:
    its Drift is delta^2 / |T(g)| -- a subnormal in float32 for delta = 1e-22, not 0."""
    pol = TablePolicy(seed=3)
    g = make_group("g", policy=pol, step=0, n=8, seed=5, max_len=4)
    ids = torch.zeros_like(g.completion_ids)
    ids[-1] = 10  # the one moved token, wherever a slice of the group puts it
    g = dataclasses.replace(g, completion_ids=ids, logprobs=torch.full_like(g.logprobs, -1e-20))

    def scorer(groups):
        out = [x.logprobs.clone() for x in groups]
        for x, lp in zip(groups, out):
            lp[x.completion_ids == 10] += delta
        return out
    assert float(scorer([g])[0][-1]) != float(g.logprobs[-1])
    return g, scorer


@pytest.mark.parametrize("passes,refresh", [(1, "finish"), (2, "slice"), (4, "slice"), (4, "finish"), (8, "slice")])
def test_tau_zero_rejects_a_group_moved_by_a_subnormal_drift_in_every_scan_mode(passes, refresh):
    """The paper: Drift = mean of squared differences > 0 = tau, rejected.  A float32 mean underflows to 0 (the full
    scan used to accept the group and the sliced scan to reject it)."""
    g, scorer = _one_moved_token(1e-22)
    assert drift64(g, scorer([g])[0].numpy(), "l2") > 0
    cfg = ReplayConfig(k_rep=1, tau=0.0, capacity=4, scan_passes=passes, scan_refresh=refresh)
    ctrl = ReplayController(cfg)
    ctrl.select(step=0)
    ctrl.stage([g], step=0)
    ctrl.commit()
    sel = select_replay(ctrl.buffer, cfg, scorer, step=1)
    assert sel.scanned_pass.tolist() == [False] and not len(sel.accepted)
    assert sel.scanned_drift[0] > 0
    unchanged = select_replay(ctrl.buffer, cfg, lambda gs: [x.logprobs for x in gs], step=1)
    assert unchanged.scanned_pass.tolist() == [True]  # Drift exactly 0 passes tau = 0
