"""hdreplay's async sampler (HDRReplayBufferAsync) and bypass mode through verl's v1 colocate_async trainer on CPU.

Same harness as the other v1 tests (real v1 trainer, verl's ReplayBufferAsync subclassed through
``trainer.v1.sampler.custom_sampler``, TransferQueue, CPU worker group; stub agent loop and weight sync), with the
stub's rows sampled by a perturbed copy of the policy (tests/support/verl_async_sampler.py): real
``rollout_log_probs`` that differ from the trainer's.  ``max_off_policy_threshold=1``: verl's warm-up batch makes
the previous step's leftover prompts stale every step, so verl evicts them -- and the sampler diverts them.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402

from hdreplay.errors import ReplayConfigError  # noqa: E402
from hdreplay.integrations.verl import HDRPPOTrainerColocateAsync  # noqa: E402
from hdreplay.integrations.verl.settings import validate_verl_config  # noqa: E402
from verl_async_sampler import PerturbedSampler  # noqa: E402
from verl_helpers import flat_every_4th  # noqa: E402
from verl_v1_harness import compose_v1_config, run_v1  # noqa: E402

ASYNC = ("trainer.v1.trainer_mode=colocate_async",
         "trainer.v1.sampler.custom_sampler.path=pkg://hdreplay.integrations.verl.v1_sampler",
         "trainer.v1.sampler.custom_sampler.name=HDRReplayBufferAsync",
         "trainer.v1.sampler.max_off_policy_threshold=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
         "hdr.k_rep=8", "hdr.tau=10.0")  # k_rep >= the buffer: every diverted group is scanned and replayed
BYPASS = "algorithm.rollout_correction.bypass_mode=true"


def _run(worker_group, tokenizer, tiny_model_dir, tmp, *extra):
    sampler = PerturbedSampler(tiny_model_dir, noise=0.05)
    run = run_v1(HDRPPOTrainerColocateAsync, worker_group, tokenizer, tiny_model_dir, tmp, *ASYNC, *extra,
                 lr=0.05, steps=3, flat=flat_every_4th, trajectory=sampler)
    return run, sampler


@pytest.fixture(scope="module")
def decoupled(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return _run(worker_group, tokenizer, tiny_model_dir, tmp_path_factory.mktemp("v1_async"))


@pytest.fixture(scope="module")
def bypass(worker_group, transfer_queue, tokenizer, tiny_model_dir, tmp_path_factory):
    return _run(worker_group, tokenizer, tiny_model_dir, tmp_path_factory.mktemp("v1_bypass"), BYPASS)


def _vanilla_loss(mb: dict, actor) -> float:
    """verl's vanilla PPO loss (dual clip, token-mean over the global mini-batch) recomputed from the rows."""
    lo = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    hi = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    total = 0.0
    for lp, old, adv, mask in zip(mb["lp"], mb["old"], mb["adv"], mb["mask"]):
        lp, old, a, m = (torch.tensor(x, dtype=torch.float64) for x in (lp, old, adv, mask))
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        c1 = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - lo, 1 + hi))
        pg = torch.where(a < 0, torch.minimum(-a * actor.clip_ratio_c, c1), c1)
        total += float((pg * m).sum())
    return total / mb["batch_num_tokens"] * mb["dp_size"]


def _replayed_diverted_rows(run):
    """Per trained row of a replayed diverted group: (micro-batch record, row index, group, response indices whose
    tokens the row carries) -- rows are balanced over ranks and micro-batches, so they are matched by tokens."""
    out = []
    for i, step in enumerate(run.trainer.steps):
        groups = {str(g.group_id): g for g in step["selection"].groups if str(g.group_id).startswith("stale")}
        for rank in run.records:
            for mb in rank["history"][i]:
                for micro in mb.get("micro_terms", []):
                    for r, uid in enumerate(micro["uid"]):
                        if uid in groups:
                            g = groups[uid]
                            idx = [j for j, c in enumerate(g.responses()) if c.tolist() == micro["responses"][r]]
                            assert idx, "a replayed row carries a response its group does not have"
                            out.append((micro, r, g, idx))
    return out


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_stale_groups_are_diverted_not_lost_and_train_later(mode, request):
    run, _ = request.getfixturevalue(mode)
    seam = run.trainer.async_seam
    t = seam.areplay.ledger.totals
    assert t["diverted_groups"] > 0 and t["admitted_groups"] > 0, t
    assert not seam.sampler.problems and not seam.sampler.diverted  # every group read was handed to the trainer
    assert seam.sampler.captured == t["diverted_groups"] + t["dropped_groups"]  # and reached the rule
    evicted = [v for m in run.trainer.logged for k, v in m.items() if k.endswith("off_policy/evicted_samples")]
    assert evicted and sum(evicted) > 0  # verl itself evicted stale groups (the ones read before their eviction)
    flat_dropped = [gid for gid in seam.areplay.tracked]  # tracked = diverted and still buffered
    assert all(str(g).startswith("stale") for g in flat_dropped)
    for step in run.trainer.steps:  # a diverted group is never replayed before an update since its birth
        for g in step["selection"].groups:
            assert g.birth_step < step["step"]
    rows = _replayed_diverted_rows(run)
    assert rows, "a diverted group must have been trained"
    logged = [m for m in run.trainer.logged if "async/diverted_groups" in m]
    assert logged and all("async/floor" in m for m in logged)


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_replayed_rows_loss_equals_a_hand_recomputation(mode, request):
    run, sampler = request.getfixturevalue(mode)
    actor = run.trainer.config.actor_rollout_ref.actor
    by_tokens = {(tuple(r["prompts"].tolist()), tuple(r["responses"].tolist())): r for r in sampler.rows.values()}
    rows = _replayed_diverted_rows(run)
    for micro, r, g, idx in rows:
        src = by_tokens[(tuple(g.prompt_ids.tolist()), tuple(micro["responses"][r]))]  # what the sampler produced
        np.testing.assert_allclose(micro["old"][r], src["rollout_log_probs"].numpy(), rtol=0, atol=1e-6)
        rewards = g.rewards.double()
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # verl's GRPO advantage of the group alone
        assert any(micro["adv"][r][0] == pytest.approx(float(adv[i]), abs=1e-5) for i in idx)
    micros = {id(m): m for m, *_ in rows}
    assert micros
    for mb in micros.values():
        assert mb["loss"] == pytest.approx(_vanilla_loss(mb, actor), rel=1e-5, abs=1e-7)


def test_floor_measured_and_gate_floor_corrected(decoupled, bypass):
    for run, _ in (decoupled, bypass):
        ar = run.trainer.async_seam.areplay
        assert ar.floor.groups > 0 and ar.floor.value > 0  # the perturbed sampler's mismatch
        tau = run.trainer.replay.tau  # a sampler-referenced group is gated on tau + the floor
        floors = [s["selection"].scanned_tau - tau for s in run.trainer.steps]
        assert any(len(f) and f.max() > 0 for f in floors)
    dec = decoupled[0].trainer.async_seam.areplay
    assert all(str(g).startswith("stale") for g in dec.sampler_ref)  # decoupled: fresh groups keep trainer log-probs
    byp = bypass[0].trainer.async_seam.areplay
    assert any(not str(g).startswith("stale") for g in byp.sampler_ref)  # bypass: every group is sampler-referenced


def test_bypass_fresh_rows_train_on_rollout_logprobs(bypass):
    run, sampler = bypass
    by_tokens = {tuple(r["responses"].tolist()): r for r in sampler.rows.values()}
    checked = 0
    for i, step in enumerate(run.trainer.steps):
        kind = run.kind_of(i)
        for rank in run.records:
            for mb in rank["history"][i]:
                for micro in mb.get("micro_terms", []):
                    for r, uid in enumerate(micro["uid"]):
                        if kind(uid) == "fresh" and sum(micro["mask"][r]):
                            resp_len = len(micro["mask"][r])
                            cands = [v for k, v in by_tokens.items() if len(k) == resp_len]
                            match = [v for v in cands if np.allclose(v["rollout_log_probs"].numpy(), micro["old"][r])]
                            assert match, "a fresh row's old_log_probs are not the sampler's"
                            checked += 1
    assert checked


@pytest.mark.parametrize("extra,match", [
    (("actor_rollout_ref.rollout.calculate_log_probs=false",), "calculate_log_probs=false: the sampler gives no"),
    ((BYPASS, "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"), "loss_mode=gpg: that loss never reads"),
    (("trainer.v1.trainer_mode=sync",), "with trainer.v1.trainer_mode=sync"),
    (("algorithm.adv_estimator=reinforce_plus_plus_baseline",), "supported: \\['grpo', 'rloo'\\]"),
    (("actor_rollout_ref.actor.use_kl_loss=true",), "use_kl_loss=true: diverted groups have no reference"),
    (("trainer.v1.sampler.max_off_policy_strategy=wait",), "with 'wait' verl never evicts"),
    (("hdr.capacity=3",), r"hdr.capacity=3 cannot hold one step's groups \(data.train_batch_size=4\)"),
    # decoupled rollout_is: fresh groups would store birth weights, diverted ones none (one buffer, one kind of group)
    (("algorithm.rollout_correction.rollout_is=token",), "rollout_is=token with HDRReplayBufferAsync in decoupled"),
])
def test_bad_async_settings_are_refused_with_the_key(tiny_model_dir, extra, match):
    cfg = compose_v1_config(*ASYNC, *extra, ckpt_dir="/tmp/unused", model_dir=tiny_model_dir)
    with pytest.raises(ReplayConfigError, match=match):
        validate_verl_config(cfg)


def test_rollout_is_with_the_sampler_in_bypass_mode_is_accepted(tiny_model_dir):
    cfg = compose_v1_config(*ASYNC, BYPASS, "algorithm.rollout_correction.rollout_is=token", ckpt_dir="/tmp/unused",
                            model_dir=tiny_model_dir)
    assert validate_verl_config(cfg).active


def test_bypass_alone_is_accepted(tiny_model_dir):
    cfg = compose_v1_config(BYPASS, "actor_rollout_ref.rollout.calculate_log_probs=true", ckpt_dir="/tmp/unused",
                            model_dir=tiny_model_dir)
    assert validate_verl_config(cfg).active
