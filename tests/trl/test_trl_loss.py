"""How replay rows enter TRL's loss: chunks of <= per_device rows whose weighted sum is TRL's loss on the merged
micro-batch (checked against the merged pass, per loss type), fresh micro-batches identical to plain TRL's
(entropy masking included), truncated completions kept in their group with loss mask 0."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl import GRPOTrainer  # noqa: E402

from hdreplay.integrations.trl.microstep import MicroStep  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402
from trl_grid import EOS_BIAS  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loss_models")


class Keep(RecordingTrainer):
    """Keeps the micro-steps that carried replay rows."""

    kept: list

    def _prepare_inputs(self, batch):
        micro = super()._prepare_inputs(batch)
        if isinstance(micro, MicroStep) and micro.replay:
            self.kept = getattr(self, "kept", []) + [micro]
        return micro


def grads(tr, micro, mode):
    model = tr.model
    model.zero_grad()
    tr.args.replay_micro_step = mode
    loss = tr.compute_loss(model, MicroStep(micro.fresh, micro.replay, None))
    tr.accelerator.backward(loss)
    return float(loss), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def test_chunks_give_the_gradient_of_the_merged_micro_batch_for_every_loss_type(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    tr = Keep(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
              args=make_args(tmp_path / "o", max_steps=3, per_device_train_batch_size=4, replay_k_rep=4,
                             beta=0.1))
    tr.train()
    micro = tr.kept[-1]
    tr.model.train()
    assert len(micro.replay) >= 2 and all(c["prompt_ids"].shape[0] <= 4 for c in micro.replay)
    for loss_type in LOSS_TYPES:
        tr.loss_type = loss_type
        l_chunk, g_chunk = grads(tr, micro, "chunk")
        l_grow, g_grow = grads(tr, micro, "grow")
        assert l_chunk == pytest.approx(l_grow, rel=1e-5, abs=1e-7), loss_type
        assert torch.allclose(g_chunk, g_grow, rtol=1e-4, atol=1e-7), (loss_type, (g_chunk - g_grow).abs().max())
        assert g_chunk.abs().max() > 0


def test_every_forward_holds_at_most_per_device_rows(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(tmp_path / "o", max_steps=3, per_device_train_batch_size=4, replay_k_rep=3))
    tr.train()
    sizes = [len(r["is_replay"]) for r in tr.records]
    assert max(sizes) == 4 and any(r["is_replay"].any() for r in tr.records)
    model, tok = tiny_model(model_dir)
    grow = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                            args=make_args(tmp_path / "g", max_steps=3, per_device_train_batch_size=4, replay_k_rep=3,
                                           replay_micro_step="grow"))
    grow.train()
    # grow: replay rows join the micro-batch, spread evenly over the generation's 2 micro-steps
    most = max(-(-sum(len(x) for x in s["lengths"]) // 2) for s in grow.selections)
    assert most >= 4 and max(len(r["is_replay"]) for r in grow.records) == 4 + most


class EntropyProbe:
    def get_high_entropy_mask(self, entropies, mask, threshold):
        out = super().get_high_entropy_mask(entropies, mask, threshold)
        self.masks = getattr(self, "masks", []) + [(self._step, out.clone(), entropies.detach().clone())]
        return out


class PlainProbe(EntropyProbe, GRPOTrainer):
    pass


class HDRProbe(EntropyProbe, RecordingTrainer):
    pass


def test_fresh_rows_see_plain_trls_entropy_threshold(model_dir, tmp_path):
    """top_entropy_quantile: the fresh micro-batch is plain TRL's, so its threshold is plain TRL's. With learning
    rate 0 both trainers generate the same batches, so the masks are compared one to one (entropies agree to
    float round-off: hdreplay's forward uses generation-style position ids, a constant shift for a rotary model)."""
    common = dict(max_steps=3, learning_rate=0.0, top_entropy_quantile=0.5, replay_k_rep=2)
    model, tok = tiny_model(model_dir)
    hdr = HDRProbe(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                   args=make_args(tmp_path / "h", **common))
    hdr.train()
    model, tok = tiny_model(model_dir)
    plain = PlainProbe(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                       args=make_args(tmp_path / "p", replay_selector="none", **common))
    plain.train()
    fresh = [(s, m, e) for (s, m, e), r in zip(hdr.masks, hdr.records) if not r["is_replay"].any()]
    replay = [m for (_, m, _), r in zip(hdr.masks, hdr.records) if r["is_replay"].any()]
    assert replay, "replay chunks must have been trained"
    assert len(fresh) == len(plain.masks) == 6
    for (s1, m1, e1), (s2, m2, e2) in zip(fresh, plain.masks):
        assert s1 == s2 and torch.allclose(e1, e2, atol=1e-5, rtol=0) and torch.equal(m1, m2)


def test_truncated_completions_stay_in_their_group_with_loss_mask_zero(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(tmp_path / "o", max_steps=4, mask_truncated_completions=True,
                                         generation_kwargs=dict(EOS_BIAS), replay_k_rep=2))
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert sum(h["replay/ingress_admitted"] for h in logs) > 0
    assert any(r["is_replay"].any() for r in tr.records)
    # groups whose every response was truncated (no loss token): skipped and counted, counted here independently
    n, spg = tr.args.num_generations, tr.args.steps_per_generation
    empty = 0
    by_gen = {}
    for r in tr.records:
        if not r["is_replay"].any():
            for k, m in zip(r["hdr_row"].tolist(), r["mask"]):
                by_gen.setdefault((r["micro"] // spg, k // n), []).append(int(m.sum()))
    empty = sum(all(x == 0 for x in v) for v in by_gen.values())
    assert sum(h["replay/ingress_empty"] for h in logs) == empty
    # a truncated response keeps its tokens in the stored group, with loss mask 0
    groups = tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist())
    kept = [(g, i) for g in groups for i, m in enumerate(g.split(g.loss_mask)) if not m.any()]
    assert kept, "some admitted group must hold a truncated response"
    for g, i in kept:
        assert int(g.response_lengths[i]) == tr.args.max_completion_length
        assert g.responses()[i][-1] != tok.eos_token_id
    # ... and is replayed with loss mask 0 (its tokens present, none of them in the loss)
    rep_rows = [(ids, m) for r in tr.records if r["is_replay"].any() for ids, m in zip(r["completion_ids"], r["mask"])]
    assert any(int(m.sum()) == 0 and int((ids != tok.pad_token_id).sum()) == tr.args.max_completion_length
               for ids, m in rep_rows)
