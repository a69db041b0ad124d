"""BAPO's uid store (arXiv 2602.20722, code @426b509): eligibility ranges, the promotion rule, category eviction
against hand-worked expectations, ingress / selection through the controller, and the checkpoint (generator
state included)."""

from collections import Counter

import numpy as np
import pytest

from hdreplay import CheckpointError, ReplayConfigError, ReplayResumeWarning
from hdreplay.baselines.bapo import (
    BapoController,
    BapoOptions,
    Entry,
    Fresh,
    evict,
    is_difficult,
    is_target,
    promoted,
    should_ingress,
)
from hdreplay_lab.synthetic import TablePolicy, make_group

OPTS = BapoOptions()


def _entry(alpha, current=(), last=0):
    return Entry(alpha=list(alpha), row={"prompt": "p"}, last_step=last, current=list(current))


def test_eligibility_ranges_are_inclusive_and_use_the_right_scores():
    assert is_difficult(_entry([1, 0, 0, 0, 0, 0, 0, 0]), OPTS)  # 1/8: inclusive
    assert not is_difficult(_entry([1, 1, 0, 0, 0, 0, 0, 0]), OPTS)
    assert is_difficult(_entry([0] * 8, current=[1] * 8), OPTS)  # mean(alpha): re-evaluation never changes it
    assert is_target(_entry([0] * 8, current=[1, 1, 0, 0, 0, 0, 0, 0]), OPTS)  # latest = mean(current) = 2/8
    assert not is_target(_entry([1, 1, 0, 0, 0, 0, 0, 0], current=[0] * 8), OPTS)
    assert is_target(_entry([1, 1, 0, 0, 0, 0, 0, 0]), OPTS) and not is_target(_entry([1, 1, 1, 0, 0, 0, 0, 0]), OPTS)
    assert [should_ingress(k / 8, OPTS) for k in range(9)] == [True, True, True] + [False] * 6
    assert promoted([1, 0, 0, 0], _entry([0, 0, 0, 0])) and not promoted([0] * 4, _entry([0] * 4))  # strict


# LRU order u0..u7 at step 10, stale = last step < 7.  Classes by latest score (target ties win over difficult).
_STORE = [("u0", [1, 0, 0, 0], (), 5), ("u1", [0] * 4, (), 6), ("u2", [1, 0, 0, 0], (), 9),
          ("u3", [1, 1, 0, 0], (), 9), ("u4", [1, 0, 0, 0], (), 8), ("u5", [0] * 4, [1, 0, 0, 0], 4),
          ("u6", [0] * 4, (), 9), ("u7", [1, 1, 1, 0], (), 9)]


@pytest.mark.parametrize("max_uids,max_target,removed", [
    (8, 2, []),  # at capacity: nothing
    (6, 2, ["u0", "u5"]),  # 4 targets > 2: the stale ones (u0, u5), oldest first
    (4, 2, ["u0", "u5", "u3", "u7"]),  # then over capacity: "other" first, oldest first
    (3, 1, ["u0", "u5", "u2", "u3", "u7"]),  # 3 targets to drop: 2 stale, then the oldest fresh one
    (2, 1, ["u0", "u5", "u2", "u1", "u3", "u7"]),  # difficult beyond max_uids - max_target = 1: oldest (u1)
])
def test_eviction_follows_bapos_category_caps(max_uids, max_target, removed):
    o = BapoOptions(max_uids=max_uids, max_target=max_target, stale_steps=3)
    store = {u: _entry(a, c, last) for u, a, c, last in _STORE}
    assert evict(store, o, step=10) == removed
    assert list(store) == [u for u, *_ in _STORE if u not in removed]
    assert len(store) <= max_uids


def _group(k, rewards, step=0):
    return make_group(f"s{step}.0g{k}", policy=TablePolicy(vocab=8), step=step, n=4, seed=k, rewards=rewards)


def _step(ctl, step, fresh_rewards, kept):
    """One step of the protocol: plan the fresh groups (``kept`` = batch positions), stage the trained ones."""
    fresh = [Fresh(f"s{step}.{g}", {"prompt": f"p{step}.{g}"}, r, kept.index(g) if g in kept else None)
             for g, r in enumerate(fresh_rewards)]
    ctl.plan(fresh, budget=1, counters={"bapo/reeval_prompts": 0.0})
    sel = ctl.select(step=step)
    ctl.stage([_group(i, fresh_rewards[g], step) for i, g in enumerate(kept)], step=step)
    return sel, ctl.commit()


def test_controller_ingress_stores_eligible_fresh_groups_and_replays_only_targets_with_log_probs():
    ctl = BapoController(BapoOptions(seed=1))
    rewards = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]  # target (kept), difficult, mixed, solved
    _, m = _step(ctl, 0, rewards, kept=[0, 2])
    assert list(ctl.store) == ["s0.0", "s0.1"]  # mean 1/4 and 0 stored; 1/2 and 1 not
    assert ctl.store["s0.0"].record is not None and ctl.store["s0.1"].record is None  # dropped: no log-probs
    assert ctl.store["s0.0"].alpha == [1, 0, 0, 0] and ctl.store["s0.1"].row == {"prompt": "p0.1"}
    assert m["replay/buffer_size"] == 2 and m["bapo/stored"] == 2 and m["replay/accepted"] == 0
    assert ctl.reeval_candidates(2) == []  # BAPO's step 3: no re-evaluation
    assert ctl.reeval_candidates(1) == [("s0.1", {"prompt": "p0.1"})]  # BAPO's step 2: only the difficult uid
    assert ctl.record_reeval("s0.1", [1, 1, 0, 0]) and ctl.store["s0.1"].current == [1, 1, 0, 0]
    sel, m = _step(ctl, 2, [[0, 1, 1, 1]] * 4, kept=[0, 1, 2, 3])
    # s0.1 is now a target by its latest score but has no log-probs: the one replayable target is s0.0
    assert [g.group_id for g in sel.groups] == ["s0.0g0"] and m["replay/replayed_rows"] == 4


def test_uniform_picks_are_uniform_and_the_checkpoint_restores_the_generator(tmp_path):
    ctl = BapoController(BapoOptions(seed=5, max_reeval=2))
    for step in range(3):
        _step(ctl, step, [[0, 0, 0, 0]] * 3 + [[1, 0, 0, 0]], kept=[3])
    assert len(ctl.store) == 12
    ctl.save(tmp_path / "s")
    twin = BapoController(BapoOptions(seed=99, max_reeval=2))
    with pytest.warns(ReplayResumeWarning, match="seed: 5 -> 99"):  # the saved generator state wins
        twin.load(tmp_path / "s")
    assert [(u, e.alpha, e.last_step, e.record is None) for u, e in twin.store.items()] == \
        [(u, e.alpha, e.last_step, e.record is None) for u, e in ctl.store.items()]
    got = [ctl.reeval_candidates(2 * i + 1) for i in range(300)]
    assert got == [twin.reeval_candidates(2 * i + 1) for i in range(300)]  # same draws after the restore
    counts = Counter(u for c in got for u, _ in c)
    assert all(len(c) == 2 and len({u for u, _ in c}) == 2 for c in got)  # without replacement
    assert set(counts) == {u for u, e in ctl.store.items() if is_difficult(e, ctl.options)}  # 9 difficult uids
    assert np.ptp(list(counts.values())) < 0.5 * 600 / 9  # roughly uniform (each ~67)


def test_bad_options_and_a_malformed_checkpoint_are_refused(tmp_path):
    for kw, field in (({"bad_thr": -0.1}, "bad_thr"), ({"target_range": (0.3, 0.2)}, "target_range"),
                      ({"train_range": (0, 2)}, "train_range"), ({"reeval_every": 0}, "reeval_every"),
                      ({"max_reeval": 1.5}, "max_reeval"), ({"max_target": 9, "max_uids": 8}, "max_target")):
        with pytest.raises(ReplayConfigError) as e:
            BapoOptions(**kw)
        assert e.value.field == field
    ctl = BapoController(OPTS)
    _step(ctl, 0, [[1, 0, 0, 0]], kept=[0])
    ctl.save(tmp_path / "s")
    from hdreplay.baselines.store import load_state, save_state
    tensors, meta = load_state(tmp_path / "s", "hdreplay.bapo")
    save_state(tmp_path / "bad", "hdreplay.bapo", tensors, {**meta, "entries": [{"uid": "x"}]})
    other = BapoController(OPTS)
    with pytest.raises(CheckpointError):
        other.load(tmp_path / "bad")
    assert other.store == {}  # nothing changed
