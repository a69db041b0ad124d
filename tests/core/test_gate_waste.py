"""Where the gate's re-scoring goes (issue 27): the waste counters of the step record, the reject streaks, and the
futile-rescoring skip (``skip_rejected``) against an oracle written from the step logs."""

import math

import pytest

from hdreplay import ReplayConfig, ReplayController
from hdreplay_lab.synthetic import drive, fresh_groups, policy_walk
from protocol import state_hash

pytestmark = pytest.mark.filterwarnings("ignore::hdreplay.ReplayStarvedWarning")


def _run(cfg, steps=16, k=6, ctrl=None, start=0):
    ctrl = ctrl or ReplayController(cfg)
    out, live = [], ctrl.buffer.group_ids(ctrl.buffer.insertion_ids())
    for st in drive(ctrl, range(start, steps), policy_at=lambda t: policy_walk(t, step_size=0.08),
                    fresh=lambda t, p: fresh_groups(t, p, per_step=k)):
        st.live_before = live  # the pre-step buffer the selection saw
        live = ctrl.buffer.group_ids(ctrl.buffer.insertion_ids())
        out.append((st, ctrl.last_record))
    return ctrl, out


def test_waste_counters_add_up():
    cfg = ReplayConfig(k_rep=3, tau=3e-3, capacity=20, scan_passes=4)
    _, steps = _run(cfg)
    early = 0
    for st, rec in steps:
        sel = st.selection
        fwd = sel.scanned_rescored_tokens
        assert rec.rescored_tokens == fwd.sum() + sel.unused_tokens
        assert rec.rescored_tokens_rejected == fwd[~sel.scanned_pass].sum()
        assert rec.rescored_tokens_unused == sel.unused_tokens
        assert rec.replayed_tokens == sum(g.num_tokens for g in sel.groups)
        assert rec.early_rejected == (~sel.scanned_exact).sum() and len(rec.scan_exact) == rec.scanned
        early += rec.early_rejected
    assert early > 0  # the run rejected some groups early


def test_reject_streaks_count_consecutive_rejecting_scans():
    cfg = ReplayConfig(k_rep=3, tau=3e-3, capacity=20)
    _, steps = _run(cfg)
    streak = {}  # oracle: group id -> consecutive rejecting scans so far
    again = 0
    for st, rec in steps:
        sel = st.selection
        for gid, ok, prior in zip(sel.scanned_group_ids, sel.scanned_pass, rec.scan_streak):
            assert prior == streak.get(gid, 0)
            streak[gid] = 0 if ok else streak.get(gid, 0) + 1
        assert rec.rejected_again == sum(1 for ok, p in zip(sel.scanned_pass, rec.scan_streak) if not ok and p > 0)
        again += rec.rejected_again
    assert again > 0


@pytest.mark.parametrize("max_skip", [1, 3])
def test_skip_leaves_out_widely_rejected_groups_for_log2_steps(max_skip):
    cfg = ReplayConfig(k_rep=3, tau=3e-3, capacity=20, skip_rejected=max_skip)
    _, steps = _run(cfg)
    banned = {}  # oracle: group id -> first step it may be scanned again
    skipped = 0
    for st, rec in steps:
        sel = st.selection
        for gid in sel.scanned_group_ids:
            assert banned.get(gid, 0) <= st.step, f"{gid} scanned at {st.step} while skipped"
        assert rec.skipped == sum(banned.get(g, 0) > st.step for g in st.live_before)
        for gid, ok, d in zip(sel.scanned_group_ids, sel.scanned_pass, sel.scanned_drift):
            if not ok:
                banned[gid] = st.step + 1 + min(max_skip, 1 + math.floor(math.log2(d / cfg.tau)))
        skipped += rec.skipped
    assert skipped > 0
    # off, the same run scans some of the groups the option left out
    _, plain = _run(ReplayConfig(k_rep=3, tau=3e-3, capacity=20))
    assert sum(r.scanned for _, r in plain) > sum(r.scanned for _, r in steps)


def test_skip_state_is_checkpointed(tmp_path):
    cfg = ReplayConfig(k_rep=3, tau=3e-3, capacity=20, skip_rejected=3)
    full, _ = _run(cfg, steps=14)
    half, _ = _run(cfg, steps=7)
    half.save(tmp_path / "ck")
    back = ReplayController(cfg)
    back.load(tmp_path / "ck")
    assert (back.buffer.slot_values("skip_until", back.buffer.insertion_ids()) > 0).any()
    back, _ = _run(cfg, steps=14, ctrl=back, start=7)
    assert state_hash(back) == state_hash(full)
