"""The scan's token budget (issue 37): windows filled to whole forwards, speculative scoring beyond the stop, the
walk's mode (canonical slices / whole groups) from the acceptance rate and the device, the cost in the step record, the
ReplayCostWarning, and the bad input it refuses.  That a budgeted scan is Algorithm 1 for every setting is
tests/core/test_algorithm1.py (its ``budget`` and ``rate`` draws); here, what the budget itself promises."""

import dataclasses
import warnings

import numpy as np
import pytest

from hdreplay import (
    ReplayConfig,
    ReplayConfigError,
    ReplayController,
    ReplayCostWarning,
    ReplayInputError,
    select_replay,
)
from hdreplay.controller import COST_FACTOR, COST_STEPS
from protocol import fresh, policy_at, run_steps

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.ReplayStarvedWarning", "ignore::hdreplay.ReplayCostWarning")


def _buffer(tau=3e-3, steps=8, k=5, capacity=40):
    cfg = ReplayConfig(k_rep=3, tau=tau, capacity=capacity, scan_passes=2)  # first slices of 2+ responses
    return run_steps(ReplayController(cfg), range(steps), k=k), cfg


class _Counting:
    """A scorer that records every call's groups (and can drop one result: a short answer)."""

    def __init__(self, policy, short=False):
        self.policy, self.short, self.calls = policy, short, []

    def __call__(self, groups):
        self.calls.append([g.group_id for g in groups])
        out = self.policy.scorer(groups)
        return out[:-1] if self.short else out


def _largest(buffer):
    return int(buffer.forward_tokens(buffer.insertion_ids()).max())


@pytest.mark.parametrize("rate", [0.02, 0.3, 1.0])
@pytest.mark.parametrize("mult", [1, 3, 50])
def test_a_budgeted_scan_makes_the_full_scans_decisions_with_no_more_calls(rate, mult):
    ctrl, cfg = _buffer()
    pol = policy_at(8)
    full = select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_passes=1), pol.scorer, step=8)
    before, after = _Counting(pol), _Counting(pol)
    old = select_replay(ctrl.buffer, cfg, before, step=8, acceptance_rate=rate)
    new = select_replay(ctrl.buffer, cfg, after, step=8, acceptance_rate=rate, scan_tokens=mult * _largest(ctrl.buffer))
    for sel in (old, new):
        assert sel.accepted.tolist() == full.accepted.tolist() and sel.scanned.tolist() == full.scanned.tolist()
        assert sel.scanned_pass.tolist() == full.scanned_pass.tolist()
    # breadth-first, filled calls: never more scorer calls than the window-sized walk (one host sync each)
    assert len(after.calls) <= len(before.calls)
    assert new.cost.forward_tokens > new.cost.unused_forward_tokens >= 0


def test_speculative_groups_are_scored_but_neither_scanned_nor_refreshed():
    """On a latency-bound device (the default) a forward's room holds further groups; beyond the stop they change
    nothing."""
    ctrl, cfg = _buffer(tau=1.0)  # every group passes: K_rep = 3 groups are needed, a big budget holds many more
    pol = policy_at(8)
    sel = ctrl.select(step=8, scorer=pol.scorer, scan_tokens=20 * _largest(ctrl.buffer))
    assert len(sel.scanned) == 3 and sel.cost.unused > 0 and sel.cost.unused_forward_tokens > 0
    ids = ctrl.buffer.insertion_ids()
    cached = dict(zip(ids.tolist(), ctrl.buffer.slot_values("cached_headroom", ids).tolist()))
    ctrl.stage(fresh(8), step=8)
    ctrl.commit()
    live = ctrl.buffer.insertion_ids()
    after = dict(zip(live.tolist(), ctrl.buffer.slot_values("cached_headroom", live).tolist()))
    untouched = (set(cached) & set(after)) - set(sel.scanned.tolist())
    assert untouched and all(after[i] == cached[i] for i in untouched)  # beyond the stop: as it was
    assert any(after[i] != cached[i] for i in sel.scanned.tolist() if i in after)  # the scanned ones: refreshed


def test_the_mode_follows_the_acceptance_rate_and_whole_groups_report_as_the_canonical_slices():
    ctrl, cfg = _buffer(tau=2e-3)
    pol = policy_at(8)
    big = 1000 * _largest(ctrl.buffer)  # a forward holds the whole window: slicing cannot save one
    canonical = select_replay(ctrl.buffer, cfg, pol.scorer, step=8, acceptance_rate=0.5)
    whole = select_replay(ctrl.buffer, cfg, pol.scorer, step=8, acceptance_rate=0.5, scan_tokens=big)
    low = select_replay(ctrl.buffer, cfg, pol.scorer, step=8, acceptance_rate=0.02, scan_tokens=_largest(ctrl.buffer))
    assert canonical.cost.sliced and not whole.cost.sliced and low.cost.sliced  # few pass: slices save forwards
    assert not canonical.scanned_exact.all()  # the buffer has groups the canonical slices reject early
    # forwarded whole, a rejected group reports the canonical slicing's bound, exactness and refreshed Headroom
    for sel in (whole, low):
        for f in ("scanned", "scanned_pass", "scanned_exact", "scanned_drift", "scanned_headroom", "scanned_kl"):
            assert np.array_equal(getattr(sel, f), getattr(canonical, f)), f
    assert whole.cost.rows >= canonical.cost.rows  # ... at the whole groups' cost
    # a device that pays per token (a CPU) keeps the slices at every rate: the walk of no budget, no speculation
    for rate in (0.02, 0.5, 1.0):
        cpu = select_replay(ctrl.buffer, cfg, pol.scorer, step=8, acceptance_rate=rate, scan_tokens=big,
                            latency_bound=False)
        plain = select_replay(ctrl.buffer, cfg, pol.scorer, step=8, acceptance_rate=rate)
        assert cpu.cost.sliced and (cpu.cost.rows, cpu.cost.unused) == (plain.cost.rows, plain.cost.unused)
        assert np.array_equal(cpu.scanned_headroom, plain.scanned_headroom)


@pytest.mark.parametrize("tau", [2e-3, 5e-3])
@pytest.mark.parametrize("refresh", ["slice", "finish"])
def test_a_run_with_a_budget_is_the_run_without_one(tau, refresh):
    """Step after step, budget, device and speculation change what is forwarded, never a result: every selection,
    every scanned group's Drift, exactness and refreshed Headroom, and the buffer's caches after every commit."""
    runs = []
    for budget, latency in ((None, True), (1.0, True), (40.0, True), (3.0, False)):
        cfg = ReplayConfig(k_rep=3, tau=tau, capacity=24, scan_refresh=refresh, scan_passes=2)  # first slices of 2+
        ctrl, log = ReplayController(cfg), []
        for t in range(12):
            tokens = None if budget is None or not len(ctrl.buffer) else int(budget * _largest(ctrl.buffer))
            sel = ctrl.select(step=t, scorer=policy_at(t).scorer, scan_tokens=tokens, latency_bound=latency)
            log.append((sel.accepted.tolist(), sel.scanned.tolist(), sel.scanned_exact.tolist(),
                        sel.scanned_drift.tolist(), sel.scanned_headroom.tolist()))
            ctrl.stage(fresh(t), step=t)
            ctrl.commit()
            ids = ctrl.buffer.insertion_ids()
            log.append(ctrl.buffer.slot_values("cached_headroom", ids).tolist())
        runs.append(log)
    assert all(r == runs[0] for r in runs[1:])


def test_a_budget_that_cannot_fit_a_group_is_refused_before_any_forward():
    ctrl, cfg = _buffer()
    calls = _Counting(policy_at(8))
    need = _largest(ctrl.buffer)
    with pytest.raises(ReplayInputError, match=rf"scan_tokens: a token budget of {need - 1} .* raise it to >= {need}"):
        select_replay(ctrl.buffer, cfg, calls, step=8, scan_tokens=need - 1)
    with pytest.raises(ReplayInputError, match="scan_tokens"):
        select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_tokens=need - 1), calls, step=8)
    for bad in (0, -5, 2.5, True, "100"):
        with pytest.raises(ReplayInputError, match="scan_tokens"):
            select_replay(ctrl.buffer, cfg, calls, step=8, scan_tokens=bad)
        with pytest.raises(ReplayInputError, match="scan_tokens"):  # checked even where the config's budget rules
            select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_tokens=10 * need), calls, step=8, scan_tokens=bad)
        with pytest.raises(ReplayConfigError, match="scan_tokens"):
            ReplayConfig(scan_tokens=bad)
    assert calls.calls == []  # no forward ran
    assert ctrl.select(step=8, scorer=calls, scan_tokens=need).scanned.size  # the controller is still usable


def test_a_scorer_that_answers_fewer_groups_than_asked_is_a_named_error():
    ctrl, cfg = _buffer()
    with pytest.raises(ReplayInputError, match=r"scorer returned \d+ results for \d+ groups"):
        select_replay(ctrl.buffer, cfg, _Counting(policy_at(8), short=True), step=8,
                      scan_tokens=3 * _largest(ctrl.buffer))


def test_the_step_record_carries_the_gates_cost_beside_the_fresh_forwards():
    ctrl, _ = _buffer()
    sel = ctrl.select(step=8, scorer=policy_at(8).scorer, scan_tokens=2 * _largest(ctrl.buffer))
    groups = fresh(8)
    ctrl.stage(groups, step=8)
    m = ctrl.commit(counters={"fresh_forward_seconds": 0.25})
    rec = ctrl.last_record
    assert rec.fresh_forward_tokens == sum(g.num_responses * g.prompt_ids.numel() + g.num_tokens for g in groups)
    assert rec.rescore_forward_tokens == sel.cost.forward_tokens > 0
    assert rec.rescore_seconds == sel.cost.seconds > 0 and rec.fresh_forward_seconds == 0.25
    assert m["replay/rescore_forward_tokens"] == rec.rescore_forward_tokens
    assert m["replay/fresh_forward_tokens"] == rec.fresh_forward_tokens
    ctrl.select(step=9, scorer=policy_at(9).scorer)
    ctrl.stage(fresh(9), step=9)
    for bad in (-1.0, float("nan"), "0.1"):
        with pytest.raises(ReplayInputError, match="fresh_forward_seconds"):
            ctrl.commit(counters={"fresh_forward_seconds": bad})
    ctrl.commit()  # refused without a trace: the step is still open
    assert ctrl.last_record.step == 9 and ctrl.last_record.fresh_forward_seconds is None


def test_the_cost_warning_names_the_knobs_after_several_costly_steps():
    """A strict tau on a full buffer: the scan walks the whole buffer for K_rep it cannot fill, many times the tokens
    of the fresh groups of a step."""
    ctrl = ReplayController(ReplayConfig.paper(k_rep=2, tau=1e-9, capacity=60))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ctrl = run_steps(ctrl, range(12), k=5)
    costly = [w for w in seen if issubclass(w.category, ReplayCostWarning)]
    assert len(costly) >= 1
    msg = str(costly[0].message)
    for knob in ("max_scan", "skip_rejected", "k_rep", "tau"):
        assert knob in msg
    assert f"{COST_STEPS} steps" in msg and f"{COST_FACTOR:g}x" in msg
    # everything passes: the scan stops early
    quiet = ReplayController(ReplayConfig.paper(k_rep=2, tau=1.0, capacity=60))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_steps(quiet, range(12), k=5)
    assert not [w for w in seen if issubclass(w.category, ReplayCostWarning)]
