"""verl's rollout importance sampling (``algorithm.rollout_correction.rollout_is``, decoupled mode) with replay, through
both recipes' real ``fit()`` on CPU (v0 ``RayPPOTrainer`` and v1 ``PPOTrainerSync``; the CPU worker group of
``verl_cpu_worker`` trains with verl's own ``ppo_loss``, which multiplies the PPO loss by ``rollout_is_weights``).

The stub rollouts return inference-engine log-probs near the tiny model's own (``verl_helpers.rollout_logps``), so
verl computes weights around 1 (truncated at the threshold) for every fresh row.  In decoupled mode a replayed row's
right weight is the PPO ratio against its stored ``old_log_probs`` times its *birth* ``rollout_is_weights``.  Each run
trains with SGD lr 0.1 and tau = 10 (every scanned group replayed), so replayed rows' ratios differ from 1.  Checked
from what the workers' ``ppo_loss`` received, per row and per micro-batch:

* every replayed row carries exactly the weights (and loss mask and old log-probs) it was trained with at birth;
* verl's padding rows (v1) weigh 0;
* every micro-batch's loss equals a hand recomputation (PPO clip with dual clip, times the weights, token-mean over
  the global token count), and the same recomputation without the weights does not.

Runs: v0 token-level IcePop (``rollout_is_threshold="0.5_2.0"``: weights outside [0.5, 2] are 0) with token rejection
sampling (``rollout_rs=token_k1`` at "0.3_1.6": verl keeps tokens with ratio in [1/1.6, 1/0.3]; the v0 recipe now keeps
rejection sampling as v1 does); v1 sequence-level TIS (one weight per row, clamped at 2).
"""

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

import torch  # noqa: E402

from hdreplay.integrations.verl import HDRRayPPOTrainer  # noqa: E402
from verl_helpers import compose_config, make_trainer, rollout_logps  # noqa: E402

RC = "algorithm.rollout_correction"
COMMON = ("hdr.tau=10", "actor_rollout_ref.actor.use_kl_loss=false")
LR, STEPS = 0.1, 3
CLIP, CLIP_C = 0.2, 3.0  # verl's defaults: actor.clip_ratio, clip_ratio_c (dual clip)


class Recording(HDRRayPPOTrainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = []

    def _update_actor(self, batch):
        out = super()._update_actor(batch)
        self.steps.append(self.last_replay)
        return out


def _v0(worker_group):
    cfg = compose_config(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='0.5_2.0'", f"{RC}.rollout_rs=token_k1",
                         f"{RC}.rollout_rs_threshold='0.3_1.6'", *COMMON, f"trainer.total_training_steps={STEPS}")
    worker_group.reset(lr=LR, actor_config=cfg.actor_rollout_ref.actor)
    trainer = make_trainer(Recording, cfg, worker_group, rollout_lp=True)
    trainer.fit()
    return trainer, worker_group.get_records()


def _trajectory(p, j, *, step, flat):
    from verl_v1_harness import stub_trajectory

    row = stub_trajectory(p, j, step=step, flat=flat)
    g = torch.Generator().manual_seed(7 * step + 1009 * p + j)
    row["rollout_log_probs"] = rollout_logps(row["responses"].shape, g)
    return row


def _v1(worker_group, transfer_queue, tokenizer, model_dir, ckpt, *overrides):
    from hdreplay.integrations.verl import HDRPPOTrainerSync
    from verl_v1_harness import run_v1

    run = run_v1(HDRPPOTrainerSync, worker_group, tokenizer, model_dir, ckpt, *overrides, *COMMON, "hdr.k_rep=3",
                 lr=LR, steps=STEPS, trajectory=_trajectory)
    return run.trainer, run.records


@pytest.fixture(scope="module", params=["v0_token_icepop_rs", "v1_sequence_tis"])
def run(request, worker_group, tiny_model_dir, tmp_path_factory):
    kind = request.param
    if kind.startswith("v0"):
        trainer, records = _v0(worker_group)
        return kind, trainer, records, {"upper": 2.0, "lower": 0.5, "level": "token", "rs": True}
    pytest.importorskip("transfer_queue")
    tq, tok = request.getfixturevalue("transfer_queue"), request.getfixturevalue("tokenizer")
    trainer, records = _v1(worker_group, tq, tok, tiny_model_dir, tmp_path_factory.mktemp(kind),
                           f"{RC}.rollout_is=sequence")
    return kind, trainer, records, {"upper": 2.0, "lower": None, "level": "sequence", "rs": False}


def _rows(records):
    """Every row every rank trained: (update index, micro record, row index, kind) with kind replay / fresh / pad."""
    for rank in records:
        for u, update in enumerate(rank["history"]):
            for mb in update:
                for micro in mb["micro"]:
                    for i, uid in enumerate(micro["uid"]):
                        uid = str(uid)
                        kind = ("pad" if uid.startswith("hdrpad") else
                                "replay" if (micro["replay"] or [None] * len(micro["uid"]))[i] or ":" in uid
                                else "fresh")
                        yield u, micro, i, kind


def _hand_loss(m, *, weights: bool) -> float:
    mask = m["response_mask"].bool()
    ratio = torch.exp(torch.clamp(m["lp"] - m["old_log_probs"], -20.0, 20.0))
    adv = m["advantages"]
    pg1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    pg = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, pg1), pg1)
    if weights:
        pg = pg * m["rollout_is_weights"]
    return float((pg * mask).sum() / m["batch_num_tokens"] * m["dp_size"])


def test_replayed_rows_carry_their_birth_weights_mask_and_old_logprobs(run):
    kind, trainer, records, _ = run
    birth = {}
    for u, m, i, k in _rows(records):
        if k == "fresh":
            mask, n = m["response_mask"][i].bool(), len(m["responses"][i])
            assert not mask[n:].any()
            birth[(u + 1, str(m["uid"][i]), tuple(m["responses"][i]))] = (
                mask[:n], m["rollout_is_weights"][i][mask], m["old_log_probs"][i][mask])
    checked, moved = 0, 0.0
    for u, m, i, k in _rows(records):
        if k != "replay":
            continue
        step, uid = str(m["uid"][i]).split(":", 1)
        mask0, w0, old0 = birth[(int(step), uid, tuple(m["responses"][i]))]
        mask, n = m["response_mask"][i].bool(), len(m["responses"][i])
        assert int(step) <= u  # born in an earlier update
        assert torch.equal(mask[:n], mask0) and not mask[n:].any()
        assert torch.equal(m["rollout_is_weights"][i][mask], w0), kind  # the birth weights, bit for bit
        assert torch.equal(m["old_log_probs"][i][mask], old0)  # the ratio's denominator is the stored pi_old
        moved = max(moved, float((m["lp"][i] - m["old_log_probs"][i])[mask].abs().max()))
        checked += 1
    assert checked >= 8, f"{kind}: too few replayed rows ({checked}) to check"
    assert moved > 1e-3  # lr > 0: the replayed rows' PPO ratio is not 1, so ratio x birth weight is exercised


def test_weights_are_verls_truncated_ratios_and_not_trivial(run):
    kind, _, records, spec = run
    ws = []
    for _, m, i, k in _rows(records):
        mask = m["response_mask"][i].bool()
        if k == "pad":
            assert not m["rollout_is_weights"][i].any() and not mask.any()  # padding rows weigh 0
        elif k == "fresh" and mask.any():
            w = m["rollout_is_weights"][i][mask]
            if spec["level"] == "sequence":
                assert torch.allclose(w, w[0].expand_as(w))  # one weight per sequence
                w = w[:1]
            ws.append(w)
    w = torch.cat(ws)
    assert float(w.max()) <= spec["upper"] + 1e-6
    inside = w[(w > 0) & (w < spec["upper"] - 1e-6)]
    assert inside.numel() > 0 and float(inside.std()) > 0.05  # weights vary around 1
    if spec["lower"] is None:  # TIS: some weights clamped at the bound
        assert bool((w == spec["upper"]).any())
    else:  # IcePop: weights outside [lower, upper] set to 0
        assert bool((w == 0).any()) and float(w[w > 0].min()) >= spec["lower"] - 1e-6


def test_every_microbatch_loss_equals_the_hand_recomputation_with_the_weights(run):
    kind, _, records, _ = run
    seen, differs = 0, 0
    for rank in records:
        for update in rank["history"]:
            for mb in update:
                for m in mb["micro"]:
                    want = _hand_loss(m, weights=True)
                    assert m["loss"] == pytest.approx(want, abs=1e-6, rel=1e-5), kind
                    differs += abs(_hand_loss(m, weights=False) - m["loss"]) > 1e-4
                    seen += 1
    assert seen and differs > seen // 2  # the weights change most micro-batches' loss: the check can see them


def test_rejection_sampling_masks_are_kept_for_replayed_rows(run):
    """verl's token_k1 rejection (v0 run) zeroes response tokens of fresh rows before the seam, beyond the stub's
    tool tokens at positions 2-3; replayed rows train exactly that stored mask (bit for bit, checked above), so
    they too have such zeros.  Without rollout_rs (v1 run) only the tool tokens are masked."""
    kind, _, records, spec = run
    rejected = {"fresh": 0, "replay": 0, "pad": 0}
    for _, m, i, k in _rows(records):
        n = len(m["responses"][i])
        rejected[k] += sum(1 for t in range(n) if not m["response_mask"][i][t] and t not in (2, 3))
    if spec["rs"]:
        assert rejected["fresh"] > 0 and rejected["replay"] > 0, rejected
    else:
        assert rejected["fresh"] == rejected["replay"] == 0, rejected
