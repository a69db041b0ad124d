"""POPO (hdreplay.baselines.popo): the buffer keeps effective groups only (FIFO), the swap replays the newest ones,
their proximal log-probs and decoupled weights match a hand computation, and the store checkpoints through the
strategies' validating store path (a refused load changes nothing)."""

import importlib
import math
import warnings
import zlib

import numpy as np
import pytest
import torch

from hdreplay import (
    CheckpointError,
    ReplayConfig,
    ReplayConfigError,
    ReplayController,
    ReplayInputError,
    ReplayProtocolError,
    ReplayResumeWarning,
)
from hdreplay.baselines import (
    BapoController,
    BapoOptions,
    ExgrpoController,
    ExgrpoOptions,
    PopoController,
    PopoOptions,
    RepoController,
    RepoOptions,
    Strategy,
)
from hdreplay.baselines.popo import TOKEN_WEIGHT, decoupled_weights, is_effective
from hdreplay.baselines.store import load_state
from hdreplay_lab.synthetic import TablePolicy, make_group

POL = TablePolicy(vocab=8)
NOW = TablePolicy(vocab=8).perturbed(0.3, seed=7)  # the "current policy" of the selections


def _g(gid, step, rewards):
    return make_group(gid, policy=POL, step=step, n=4, seed=zlib.crc32(gid.encode()) % 1000, rewards=rewards)


MIXED, ALL_RIGHT, ALL_WRONG = [1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]


def _run(ctl, plan):
    """Steps of (fresh groups' rewards, ineffective count): select (planned), stage, commit; the selections."""
    sels = []
    for t, (rewards, ineffective) in enumerate(plan):
        ctl.plan(ineffective=ineffective)
        sels.append(ctl.select(step=t, scorer=NOW.scorer))
        ctl.stage([_g(f"s{t}g{k}", t, r) for k, r in enumerate(rewards)], step=t)
        ctl.commit()
    return sels


def test_the_buffer_keeps_effective_groups_fifo_and_the_swap_takes_the_newest_with_hand_computed_weights():
    ctl = PopoController(PopoOptions(capacity=4, is_cap=1.5))
    # step 0: two mixed groups stored, the all-right one is not; step 1: three mixed; capacity 4 evicts s0g0
    sels = _run(ctl, [([MIXED, ALL_RIGHT, MIXED], 1), ([MIXED, MIXED, ALL_WRONG, MIXED], 1)])
    assert [len(s.groups) for s in sels] == [0, 1]  # step 0: nothing stored yet; step 1: 1 of 2 swapped
    assert sels[1].groups[0].group_id == "s0g2"  # the newest stored group at step 1
    assert [g.group_id for g in ctl.store] == ["s0g2", "s1g0", "s1g1", "s1g3"]
    assert ctl.plan(ineffective=3) == 3 and ctl.plan(ineffective=9) == 4 and ctl.plan(ineffective=9, most=2) == 2
    ctl.plan(ineffective=3)
    stored = {g.group_id: g for g in ctl.store}
    sel = ctl.select(step=2, scorer=NOW.scorer)
    assert [g.group_id for g in sel.groups] == ["s1g3", "s1g1", "s1g0"]  # newest first
    assert sel.rescored_rows == 12 and sel.rescored_tokens == sum(g.num_tokens for g in sel.groups)
    for copy in sel.groups:
        orig = stored[copy.group_id]
        prox = NOW.token_logprobs(orig.completion_ids, orig.response_lengths)
        assert torch.allclose(copy.logprobs, prox * orig.loss_mask)  # the ratio denominator: pi_prox
        for j in torch.nonzero(orig.loss_mask).flatten().tolist():  # w = min(pi_prox / pi_behav, cap), by hand
            w = min(math.exp(float(prox[j]) - float(orig.logprobs[j])), 1.5)
            assert float(copy.extras[TOKEN_WEIGHT][j]) == pytest.approx(w, rel=1e-5)
        assert torch.equal(copy.advantages, orig.advantages) and torch.equal(copy.completion_ids, orig.completion_ids)
        assert TOKEN_WEIGHT not in orig.extras and not torch.equal(orig.logprobs, copy.logprobs)  # the store unchanged
    assert bool((torch.cat([g.extras[TOKEN_WEIGHT] for g in sel.groups]) == 1.5).any())  # the cap was hit
    ctl.stage([_g("s2g0", 2, MIXED)], step=2)
    m = ctl.commit()
    assert m["replay/accepted"] == 3 and m["popo/swapped"] == 3 and m["popo/ineffective"] == 3
    assert m["popo/stored"] == 1 and m["popo/evicted"] == 1 and m["popo/mean_age"] == pytest.approx(1.0)
    assert [g.group_id for g in ctl.store] == ["s1g0", "s1g1", "s1g3", "s2g0"]


def test_a_group_is_never_replayed_in_its_own_step_and_the_protocol_is_enforced():
    ctl = PopoController(PopoOptions())
    ctl.plan(ineffective=2)
    assert ctl.select(step=0, scorer=NOW.scorer).groups == []
    ctl.stage([_g("a", 0, MIXED)], step=0)
    ctl.commit()
    ctl.plan(ineffective=1)
    with pytest.raises(ReplayInputError, match="scorer"):
        ctl.select(step=1)
    sel = ctl.select(step=1, scorer=NOW.scorer)
    with pytest.raises(ReplayInputError, match="not born"):
        ctl.stage([_g("b", 0, MIXED)], step=1)
    with pytest.raises(ReplayProtocolError, match="open"):
        ctl.stage([_g("b", 2, MIXED)], step=2)
    ctl.stage([_g("b", 1, MIXED)], step=1)
    ctl.commit()
    assert [g.group_id for g in sel.groups] == ["a"] and ctl.last_step == 1
    with pytest.raises(ReplayProtocolError, match="committed"):
        ctl.select(step=1)
    assert is_effective(_g("m", 0, MIXED)) and not is_effective(_g("r", 0, ALL_RIGHT))
    assert decoupled_weights(torch.tensor([-1.0]), torch.tensor([-3.0]), 10.0).item() == pytest.approx(math.e ** 2)


def test_options_are_validated_naming_the_field():
    for bad, field in (({"capacity": 0}, "capacity"), ({"capacity": 2.0}, "capacity"), ({"is_cap": 0.0}, "is_cap"),
                       ({"is_cap": float("inf")}, "is_cap"), ({"is_cap": "2"}, "is_cap")):
        with pytest.raises(ReplayConfigError) as e:
            PopoOptions(**bad)
        assert e.value.field == field


def test_the_store_round_trips_through_the_validating_store_path_and_a_refused_load_changes_nothing(tmp_path):
    ctl = PopoController(PopoOptions(capacity=5))
    _run(ctl, [([MIXED, ALL_WRONG, MIXED], 1), ([MIXED, MIXED], 0), ([ALL_RIGHT, MIXED], 1)])
    ctl.save(tmp_path / "ck")
    back = PopoController(PopoOptions(capacity=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same options: no warning
        back.load(tmp_path / "ck")
    assert back.last_step == 2 and [g.group_id for g in back.store] == [g.group_id for g in ctl.store]
    for a, b in zip(ctl.store, back.store):
        for f in ("prompt_ids", "completion_ids", "response_lengths", "loss_mask", "logprobs", "advantages", "rewards"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert a.birth_step == b.birth_step
    for c in (ctl, back):  # the resumed controller makes the same next selection
        c.plan(ineffective=2)
    sa, sb = ctl.select(step=3, scorer=NOW.scorer), back.select(step=3, scorer=NOW.scorer)
    assert [g.group_id for g in sa.groups] == [g.group_id for g in sb.groups]
    assert all(torch.equal(x.extras[TOKEN_WEIGHT], y.extras[TOKEN_WEIGHT]) for x, y in zip(sa.groups, sb.groups))

    tensors, meta = load_state(tmp_path / "ck", "hdreplay.popo")
    fresh = PopoController(PopoOptions(capacity=5))
    bad_metas = {
        "last_step": {**meta, "last_step": 0},  # groups born after the saved step
        "FIFO": {**meta, "records": {**meta["records"], "birth_steps": meta["records"]["birth_steps"][::-1]}},
        "options": {**meta, "options": {"capacity": -1, "is_cap": 2.0}},
        "missing": {k: v for k, v in meta.items() if k != "records"},
    }
    for why, bad in bad_metas.items():
        with pytest.raises(CheckpointError):
            fresh.load_state_dict(tensors, bad)
        assert fresh.store == [] and fresh.last_step is None, why
    rewards = tensors["store.rewards"].clone()
    rewards[:4] = 1.0  # the first stored group now has rewards all equal
    with pytest.raises(CheckpointError, match="all equal"):
        fresh.load_state_dict({**tensors, "store.rewards": rewards}, meta)
    small = PopoController(PopoOptions(capacity=2))
    with pytest.raises(CheckpointError, match="capacity"):
        small.load(tmp_path / "ck")
    assert small.store == []
    other = PopoController(PopoOptions(capacity=5, is_cap=3.0))
    with pytest.warns(ReplayResumeWarning, match="is_cap"):
        other.load(tmp_path / "ck")
    assert len(other.store) == len(ctl.store)


def test_every_controller_speaks_the_strategy_protocol_and_the_old_paths_are_gone():
    ctls = (ReplayController(ReplayConfig()), PopoController(PopoOptions()), BapoController(BapoOptions()),
            RepoController(RepoOptions()), ExgrpoController(ExgrpoOptions(), n=4))
    assert all(isinstance(c, Strategy) for c in ctls)
    import hdreplay
    import hdreplay.baselines.sampling as orders

    for old in ("hdreplay.strategies", "hdreplay.layout", "hdreplay.scan", "hdreplay.adaptive"):
        with pytest.raises(ModuleNotFoundError):  # shims of a 0.1.0 never released: removed (README changelog)
            importlib.import_module(old)
    assert not hasattr(hdreplay, "minibatch_layout") and not hasattr(hdreplay.sampling, "bucket_counts")
    assert np.isclose(orders.importance_weights(np.array([0.5, 0.5]), [0], 1.0)[0], 1.0)
