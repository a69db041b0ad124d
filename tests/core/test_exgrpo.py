"""ExGRPO's store and decisions (hdreplay.baselines.exgrpo) against independently computed expectations: admission
of 0 < k < n groups' new correct responses, retirement of all-correct prompts, the phase switch, bucket-weighted
prompt sampling, the entropy pick, the policy-shaped token loss and its gradient, and the checkpoint round-trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hdreplay import ReplayConfigError
from hdreplay.baselines.exgrpo import ExgrpoController, ExgrpoOptions, mean_entropies, shaped_token_loss
from hdreplay.baselines.repo import key_of
from hdreplay.store.record import GroupRecord

N = 8


def group(prompt, rewards, completions, step=0):
    return GroupRecord.from_responses(
        group_id=f"g{step}.{prompt}", prompt_ids=torch.tensor(prompt), birth_step=step,
        completion_ids=[torch.tensor(c) for c in completions],
        logprobs=[-torch.rand(len(c)) for c in completions], advantages=torch.tensor(rewards) - 0.5,
        rewards=torch.tensor(rewards, dtype=torch.float32))


def comps(k, base=10):
    return [[base + i, 2] for i in range(N)][:k] + [[99, 3]] * (N - k)


def started(**kw) -> ExgrpoController:
    c = ExgrpoController(ExgrpoOptions(start_solved=0.0, **kw), n=N, seed=0)
    c.stage([group([1], [1.0] + [0.0] * 7, comps(1))], step=0)
    c.commit()  # solved 1/8 > 0: switched, nothing collected yet
    assert c.started and len(c) == 0
    return c


def test_commit_admits_new_correct_responses_of_mixed_groups_retires_all_correct_and_switches():
    c = ExgrpoController(ExgrpoOptions(start_solved=0.35), n=N)
    c.stage([group([5], [1.0] * 3 + [0.0] * 5, comps(3))], step=0)
    c.commit()  # 3/8 = 0.375 > 0.35: switch after this step; nothing collected before the switch
    assert c.started and len(c) == 0
    # k = 3 with two identical correct completions: 2 distinct stored; k = 0 and k = 8 are not admitted
    c.stage([group([5], [1.0] * 3 + [0.0] * 5, [[7, 2], [7, 2], [8, 2]] + [[99, 3]] * 5, step=1),
             group([6], [0.0] * 8, comps(0), step=1), group([9], [1.0] * 8, comps(8), step=1)], step=1)
    m = c.commit()
    k5 = key_of(torch.tensor([5]))
    assert [r.completion_ids.tolist() for r in c.pool[k5]] == [[7, 2], [8, 2]] and c.bucket[k5] == 3
    assert m["exgrpo/admitted"] == 2 and m["exgrpo/retired"] == 1 and key_of(torch.tensor([9])) in c.retired
    # k moves the prompt to its latest bucket; an already stored completion is not added twice
    c.stage([group([5], [1.0] * 6 + [0.0] * 2, [[8, 2]] * 6 + [[99, 3]] * 2, step=2)], step=2)
    c.commit()
    assert c.bucket[k5] == 6 and len(c.pool[k5]) == 2
    # an all-correct group retires the prompt for good: its trajectories leave the pool, it is never re-admitted
    c.stage([group([5], [1.0] * 8, comps(8), step=3)], step=3)
    c.commit()
    c.stage([group([5], [1.0] * 2 + [0.0] * 6, comps(2, base=40), step=4)], step=4)
    c.commit()
    assert k5 not in c.pool and k5 in c.retired


def test_plan_draws_buckets_in_proportion_to_the_normal_weights_and_never_twice_a_prompt():
    c = started(ratio=0.5)
    for k in range(1, N):  # 6 prompts per bucket k = 1..7
        for j in range(6):
            p = [k, j]
            c.rows[key_of(torch.tensor(p))] = {"prompt": str(p)}
            c.stage([group(p, [1.0] * k + [0.0] * (N - k), comps(k))], step=1)
    c.commit()
    assert sorted(set(c.bucket.values())) == list(range(1, N))
    w = np.exp(-0.5 * (np.arange(1, N) - N / 2) ** 2)
    want = w / w.sum()
    counts = np.zeros(N - 1)
    trials = 3000
    for _ in range(trials):
        keys = c.plan(8)  # B = 8 prompts, ratio 0.5: 4 experience prompts
        assert len(keys) == 4 and len(set(keys)) == 4
        for key in keys:
            counts[c.bucket[key] - 1] += 1
    freq = counts / counts.sum()
    # multinomial draws (with the overflow rule only when a 6-prompt bucket got more than 6 of 4 draws: never)
    assert np.allclose(freq, want, atol=0.02), (freq.round(3), want.round(3))


def test_plan_is_empty_before_the_switch_and_reproducible_across_a_checkpoint(tmp_path):
    c = ExgrpoController(ExgrpoOptions(), n=N, seed=3)
    c.rows["x"] = {"prompt": "x"}
    assert c.plan(16) == []
    c = started(seed=11)
    for j in range(10):
        p = [3, j]
        c.rows[key_of(torch.tensor(p))] = {"prompt": f"p{j}", "answer": str(j)}
        c.stage([group(p, [1.0] * (1 + j % 7) + [0.0] * (7 - j % 7), comps(1 + j % 7))], step=1)
    c.commit()
    c.plan(6)
    c.save(tmp_path / "ex")
    d = ExgrpoController(ExgrpoOptions(start_solved=0.0, seed=11), n=N)
    d.load(tmp_path / "ex")
    assert d.started and d.bucket == c.bucket and d.rows == c.rows and d.retired == c.retired
    assert {k: [r.completion_ids.tolist() for r in v] for k, v in d.pool.items()} == \
           {k: [r.completion_ids.tolist() for r in v] for k, v in c.pool.items()}
    assert [d.plan(6) for _ in range(5)] == [c.plan(6) for _ in range(5)]  # the generator state came back


def test_the_pick_is_the_lowest_mean_entropy_over_loss_tokens():
    ent = torch.tensor([[0.5, 0.5, 9.0], [0.2, 0.4, 0.0], [0.1, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    m = mean_entropies(ent, mask)
    assert torch.allclose(m, torch.tensor([0.5, 0.2, 0.1]))
    assert ExgrpoController.pick(m.tolist()) == 2
    assert ExgrpoController.pick([0.3, 0.1, 0.1]) == 1  # ties: the first
    assert math.isinf(float(mean_entropies(ent[:1], torch.zeros(1, 3))[0]))


def test_shaped_loss_is_minus_a_w_over_w_plus_gamma_with_that_gradient():
    torch.manual_seed(0)
    logps = (-torch.rand(3, 5)).requires_grad_()
    stored = -torch.rand(3, 5)
    a = torch.tensor([1.5, -0.5, 0.0])
    gamma = 0.1
    tok = shaped_token_loss(logps, stored, a, gamma)
    w = torch.exp(logps.detach() - stored)
    assert torch.allclose(tok, -a[:, None] * w / (w + gamma))
    tok.sum().backward()
    # d/dlogp [-A w/(w+g)] = -A g w / (w+g)^2 (ExGRPO's shaped gradient; 1/12 of the on-policy one at w = 1, g = 0.1)
    assert torch.allclose(logps.grad, -a[:, None] * gamma * w / (w + gamma) ** 2)


@pytest.mark.parametrize("bad", [{"ratio": 0.0}, {"ratio": 1.5}, {"gamma": 0}, {"sigma": -1.0}, {"lbound": -1},
                                 {"rbound": 0}, {"seed": -3}, {"start_solved": 2.0}])
def test_bad_options_are_refused_naming_the_field(bad):
    with pytest.raises(ReplayConfigError) as e:
        ExgrpoOptions(**bad)
    assert e.value.field == next(iter(bad))
    with pytest.raises(ReplayConfigError):
        ExgrpoController(ExgrpoOptions(rbound=9), n=N)
