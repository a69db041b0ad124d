"""The random orders (uniform FIFO, FreshPER, rollout-level |A| priority) and their samplers: frequencies against
exact probabilities, FreshPER's decay and importance weights, max-age and zero-advantage rules, rollout budgets,
seeded reproducibility and the generator state surviving a checkpoint."""

import math
from itertools import permutations

import numpy as np
import pytest

from hdreplay import CheckpointError, ReplayConfig, ReplayController, ReplayInputError
from hdreplay.baselines.orders import priorities
from hdreplay.baselines.sampling import (
    bucket_counts,
    importance_weights,
    normal_bucket_weights,
    proportional_order,
    uniform_order,
)
from hdreplay.sampling import new_rng, rng_from_state, rng_state
from hdreplay.selection import select_replay
from hdreplay_lab.synthetic import make_group, policy_walk
from protocol import run_steps


def test_proportional_order_is_successive_sampling_without_replacement():
    w = np.array([0.5, 1.0, 2.0, 0.0, 4.0])
    rng, draws = new_rng(3), 40_000
    pairs = {}
    for _ in range(draws):
        o = tuple(proportional_order(rng, w, 2).tolist())
        pairs[o] = pairs.get(o, 0) + 1
    W = w.sum()
    for i, j in permutations(range(5), 2):
        exact = 0.0 if 0.0 in (w[i], w[j]) else w[i] / W * w[j] / (W - w[i])
        assert abs(pairs.get((i, j), 0) / draws - exact) < 0.01, (i, j)
    assert not any(3 in p for p in pairs)  # weight 0 is never drawn
    assert proportional_order(rng, [0.0, 0.0], 2).size == 0


def test_uniform_order_draws_every_position_equally_often_without_repeats():
    rng, counts = new_rng(0), np.zeros(10)
    for _ in range(5000):
        o = uniform_order(rng, 10, 3)
        assert len(set(o.tolist())) == 3
        counts[o] += 1
    assert np.abs(counts / 5000 - 0.3).max() < 0.02


def test_importance_weights_are_pers_formula_with_max_one():
    p = np.array([0.1, 0.2, 0.3, 0.4])
    w = importance_weights(p, [0, 3, 1], beta=0.4)
    expect = (4 * p[[0, 3, 1]]) ** -0.4 / (4 * 0.1) ** -0.4
    assert np.allclose(w, expect) and w.max() == pytest.approx(1.0) and importance_weights(p, [2], 0.0)[0] == 1.0
    with pytest.raises(ReplayInputError):
        importance_weights(np.array([0.5, 0.5, 0.0]), [2], 0.4)


def test_bucket_sampling_frequencies_match_the_normal_weights_of_exgrpo():
    ks = np.arange(1, 8)
    w = normal_bucket_weights(ks, 8)
    table = {1: .0044, 2: .054, 3: .242, 4: .399, 5: .242, 6: .054, 7: .0044}  # the notes' N(k; 4, 1) table
    assert np.allclose(w / w.sum(), [table[k] for k in ks], atol=6e-4)
    rng, tot = new_rng(1), np.zeros(7)
    for _ in range(4000):
        tot += bucket_counts(rng, [100] * 7, w, 8)
    assert np.allclose(tot / tot.sum(), w / w.sum(), atol=0.01)
    # overflow: a bucket holding fewer items than its draws passes the excess to buckets with room
    for _ in range(200):
        c = bucket_counts(rng, [0, 1, 1, 1, 50, 1, 1], w, 8)
        assert c.sum() == 8 and (c <= [0, 1, 1, 1, 50, 1, 1]).all()
    assert bucket_counts(rng, [1, 2], [1.0, 1.0], 9).tolist() == [1, 2]


def _controller(selector, steps=5, k=4, **kw):
    cfg = ReplayConfig(selector=selector, k_rep=2, capacity=12, group_size=4, **kw)
    return run_steps(ReplayController(cfg), range(steps), k=k)


def test_uniform_selector_frequencies_are_uniform_over_the_pre_existing_buffer():
    ctrl = _controller("uniform", steps=3)  # 12 groups, all mixed
    ids = ctrl.buffer.insertion_ids()
    rng, counts = new_rng(7), dict.fromkeys(ids.tolist(), 0)
    for _ in range(3000):
        sel = select_replay(ctrl.buffer, ctrl.config, None, step=3, rng=rng)
        assert len(sel.accepted) == 2 and sel.accepted[0] != sel.accepted[1] and not sel.scored
        for i in sel.accepted.tolist():
            counts[i] += 1
    freq = np.array(list(counts.values())) / 3000
    assert np.abs(freq - 2 / len(ids)).max() < 0.03
    with pytest.raises(ReplayInputError, match="rng"):
        select_replay(ctrl.buffer, ctrl.config, None, step=3)


def test_freshper_priority_is_reward_times_exponential_age_decay_and_draws_follow_it():
    ctrl = _controller("freshper", steps=6, age_decay=2.0, priority_alpha=0.6, is_beta=0.4)
    buf, step = ctrl.buffer, 6
    groups = buf.get(buf.insertion_ids().tolist())
    expect = np.array([(float(g.rewards.abs().mean()) + 1e-6) * math.exp(-(step - g.birth_step) / 2.0)
                       for g in groups])
    assert np.allclose(priorities(buf, ctrl.config, step), expect, rtol=1e-12)
    # first draws follow p^alpha / sum; the importance weight of a draw is (N P)^-beta / max
    w = expect ** 0.6
    P = w / w.sum()
    rng, first = new_rng(0), np.zeros(len(groups))
    for _ in range(6000):
        sel = select_replay(buf, ctrl.config, None, step=step, rng=rng)
        j = int(sel.accepted[0] - buf.insertion_ids()[0])
        first[j] += 1
        assert sel.loss_weights[0] == pytest.approx((len(P) * P[j]) ** -0.4 / (len(P) * P.min()) ** -0.4)
        assert sel.loss_weights.max() <= 1.0
    assert np.abs(first / 6000 - P).max() < 0.02
    # the decay: at a later step every priority shrinks by exp(-dt / age_decay)
    assert np.allclose(priorities(buf, ctrl.config, step + 3), expect * math.exp(-3 / 2.0))


def test_age_decay_and_importance_weights_are_refused_outside_the_proportional_selectors():
    with pytest.raises(Exception, match="age_decay"):
        ReplayConfig(selector="uniform", age_decay=5.0)
    with pytest.raises(Exception, match="group_size"):
        ReplayConfig(selector="adv_priority")


def test_adv_priority_stores_rollouts_with_nonzero_advantage_and_never_replays_past_max_age():
    cfg = ReplayConfig(selector="adv_priority", k_rep=2, capacity=3, group_size=4, max_age=2, seed=5)
    ctrl, pol = ReplayController(cfg), policy_walk(0)
    assert ctrl.buffer.capacity == 12 and ctrl.buffer.group_size == 1
    seen_ages = []
    for t in range(8):
        sel = ctrl.select(step=t)
        assert len(sel.accepted) <= 8  # k_rep x n rollouts
        seen_ages += [t - g.birth_step for g in sel.groups]
        assert all(g.num_responses == 1 and float(g.advantages[0]) != 0 for g in sel.groups)
        rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]  # the all-equal group stores nothing
        ctrl.stage([make_group(f"{t}-{i}", policy=pol, step=t, seed=t * 7 + i, rewards=r)
                    for i, r in enumerate(rewards)], step=t)
        m = ctrl.commit()
        if "replay/budget_fill" in m:  # rollouts replayed / (k_rep groups x n rows): never above 1
            assert m["replay/budget_fill"] == pytest.approx(len(sel.accepted) / 8)
        births = ctrl.buffer.slot_values("birth_step", ctrl.buffer.insertion_ids())
        assert (t - births < 2).all()  # units reaching max_age were evicted at commit
    assert seen_ages and max(seen_ages) <= 2 and min(seen_ages) >= 1
    # priorities are |A| (the stored advantage of the rollout in its birth group)
    buf = ctrl.buffer
    adv = np.array([abs(float(g.advantages[0])) for g in buf.get(buf.insertion_ids().tolist())])
    assert np.allclose(priorities(buf, cfg, 8), adv)


def test_random_orders_are_reproducible_and_resume_exactly_from_a_checkpoint(tmp_path):
    cfg = ReplayConfig(selector="freshper", k_rep=2, capacity=12, group_size=4, age_decay=3.0, is_beta=0.4, seed=11)
    a, log_a = ReplayController(cfg), []
    run_steps(a, range(10), k=4, log=log_a)
    b, log_b = ReplayController(cfg), []
    run_steps(b, range(5), k=4, log=log_b)
    b.save(tmp_path / "ck")
    c = ReplayController(cfg)
    c.load(tmp_path / "ck")
    assert c.rng_state == b.rng_state
    run_steps(c, range(5, 10), k=4, log=log_b)
    assert log_a == log_b and any(ids for ids, _, _ in log_a)
    other, log_o = ReplayController(ReplayConfig(**{**cfg.to_dict(), "seed": 12})), []
    run_steps(other, range(10), k=4, log=log_o)
    assert [x[0] for x in log_o] != [x[0] for x in log_a]  # the seed matters


def test_a_malformed_generator_state_is_refused_and_changes_nothing(tmp_path):
    ctrl = _controller("uniform")
    tensors, meta = ctrl.state_dict()
    before = dict(ctrl.rng_state)
    for bad in ({"bit_generator": "MT19937"}, {**meta["sampler_state"], "state": {"state": -1, "inc": 1}}):
        with pytest.raises(CheckpointError, match="sampler_state"):
            ctrl.load_state_dict(tensors, {**meta, "sampler_state": bad})
        assert ctrl.rng_state == before
    rng = new_rng(4)
    rng.random(3)
    assert rng_from_state(rng_state(rng)).random() == rng.random()


def test_max_age_filters_gated_orders_too():
    cfg = ReplayConfig(selector="headroom_drift", k_rep=3, tau=10.0, capacity=30, group_size=4, max_age=1)
    ctrl = run_steps(ReplayController(cfg), range(4), k=5)
    pol = policy_walk(4)
    sel = select_replay(ctrl.buffer, ctrl.config, pol.scorer, step=4)
    assert len(sel.accepted) == 3 and all(4 - g.birth_step <= 1 for g in sel.groups)
    assert sel.scanned_age.max() <= 1 and sel.eligible == len(ctrl.buffer) == 5  # commit evicted the older ones
    late = select_replay(ctrl.buffer, ctrl.config, pol.scorer, step=5)  # a skipped step: all stored are too old
    assert late.eligible == 0 and len(late.accepted) == 0 and len(late.scanned) == 0
    assert sel.rescored_rows == sum(g.num_responses for g in ctrl.buffer.get(sel.scanned.tolist()))
