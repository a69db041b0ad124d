"""RePO's per-prompt stores (arXiv 2506.09340, code @119fef6): the three retrieval rules against independent
computations, split advantage normalisation, the per-prompt FIFO and min-cache rule, and the checkpoint."""

import itertools
import random

import pytest
import torch

from hdreplay import CheckpointError, ReplayConfigError
from hdreplay.baselines.repo import (
    RepoOptions,
    RepoStore,
    brute_force_max_variance,
    max_variance_subset,
    retrieve,
    split_advantages,
)
from hdreplay.baselines.store import load_state, prompt_key, save_state
from hdreplay.store.record import GroupRecord
from hdreplay_lab.synthetic import TablePolicy, make_group


def _one(reward: float, gid: str, step: int = 0):
    """A single stored response (n = 1) with reward ``reward``, as the RePO store keeps them."""
    g = make_group(gid, policy=TablePolicy(vocab=8), step=step, n=2, seed=len(gid) + step,
                   rewards=[reward, 1.0 - reward])
    return GroupRecord.from_responses(
        group_id=gid, prompt_ids=g.prompt_ids, completion_ids=[g.responses()[0]], logprobs=[g.split(g.logprobs)[0]],
        loss_masks=[g.split(g.loss_mask)[0]], advantages=g.advantages[:1], rewards=g.rewards[:1], birth_step=step)


def _numpy_var_pick(rewards, k):
    """Independent brute force: every k-subset scored by (population variance, sum), first maximum kept."""
    best = None
    for sub in itertools.combinations(range(len(rewards)), k):
        v = torch.tensor([rewards[j] for j in sub], dtype=torch.float64)
        key = (round(float(v.var(unbiased=False)), 12), float(v.sum()))
        if best is None or key > best[0]:
            best = (key, sub)
    return best[1]


@pytest.mark.parametrize("seed", range(30))
def test_max_variance_closed_form_equals_repos_subset_loop_for_binary_rewards(seed):
    rng = random.Random(seed)
    m, k = rng.randint(2, 12), rng.randint(1, 8)
    k = min(k, m)
    r = [float(rng.random() < rng.random()) for _ in range(m)]
    assert max_variance_subset(r, k) == brute_force_max_variance(r, k) == _numpy_var_pick(r, k)


def test_max_variance_falls_back_to_the_loop_for_graded_rewards():
    r = [0.0, 0.1, 0.9, 1.0, 0.5]
    assert max_variance_subset(r, 2) == _numpy_var_pick(r, 2) == (0, 3)


def test_recent_and_highest_retrievals_follow_repos_rules():
    r = [1.0, 0.0, 1.0, 0.0, 1.0, 0.5]
    assert retrieve(r, "recent", 3) == [3, 4, 5]  # newest k
    assert retrieve(r, "highest", 2) == [0, 2]  # ties go to the older entry (stable sort)
    assert retrieve(r, "highest", 4) == [0, 2, 4, 5]
    assert retrieve(r, "recent", 10) == list(range(6))  # k capped by the store


def test_split_advantages_are_normalised_among_the_replayed_rows_only():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    a = split_advantages(r)
    want = (r - r.mean()) / (r.std(unbiased=True) + 1e-4)
    assert torch.allclose(a, want)
    assert abs(float(a.sum())) < 1e-6
    assert torch.equal(split_advantages(torch.ones(4)), torch.zeros(4))  # all-equal rewards: no gradient


def test_store_replays_only_from_min_cache_and_keeps_the_newest_max_cache():
    s = RepoStore(RepoOptions(retrieval="recent", num_replays=2, min_cache=3, max_cache=4))
    key = prompt_key([{"role": "user", "content": "1+1"}])
    s.add(key, [_one(1.0, "a"), _one(0.0, "b")])
    assert s.retrieve(key) == []  # 2 < min_cache
    s.add(key, [_one(1.0, "c"), _one(0.0, "d"), _one(1.0, "e")])
    assert [r.group_id for r in s.cache[key]] == ["b", "c", "d", "e"]  # FIFO of 4
    assert [r.group_id for r in s.retrieve(key)] == ["d", "e"]
    assert s.retrieve("another prompt") == []


def test_options_refuse_settings_that_never_replay():
    with pytest.raises(ReplayConfigError) as e:
        RepoOptions(min_cache=17, max_cache=16)
    assert e.value.field == "min_cache"
    with pytest.raises(ReplayConfigError):
        RepoOptions(retrieval="random")


def test_store_round_trips_through_a_crash_safe_checkpoint(tmp_path):
    s = RepoStore(RepoOptions(retrieval="highest", num_replays=2, min_cache=2, max_cache=3))
    s.add("p1", [_one(1.0, "a"), _one(0.0, "b")])
    s.add("p2", [_one(0.0, "c"), _one(1.0, "d", step=3)])
    tensors, meta = s.state_dict()
    save_state(tmp_path / "repo", "hdreplay.repo", tensors, meta)
    t2, m2 = load_state(tmp_path / "repo", "hdreplay.repo")
    s2 = RepoStore(s.options)
    s2.load_state_dict(t2, m2)
    assert {k: [r.group_id for r in v] for k, v in s2.cache.items()} == {"p1": ["a", "b"], "p2": ["c", "d"]}
    assert [r.birth_step for r in s2.cache["p2"]] == [0, 3]
    assert torch.equal(s2.cache["p1"][0].completion_ids, s.cache["p1"][0].completion_ids)
    assert [r.group_id for r in s2.retrieve("p2")] == ["d", "c"]
    bad = dict(m2, keys=m2["keys"][:-1])
    with pytest.raises(CheckpointError):
        RepoStore(s.options).load_state_dict(t2, bad)
