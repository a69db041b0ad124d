"""TRL's own vLLM-mode path (``use_vllm=True``, colocate and server) through ``HDRGRPOTrainer.train()``.

vLLM cannot run here (no GPU, not installed): ``vllm_standin`` replaces the engine call only (same interface and
outputs; samples with a copy of the local model, returns bf16-rounded processed log-probs).  Checked: pi_gen is the
training engine's log-prob at the generation weights (TRL's ``old_per_token_logps``), replay rows carry their
birth-time importance-sampling ratio and sampling log-probs into TRL's loss, and TRL's weight sync is untouched.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

import vllm_standin  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402

MODES = [("colocate", "sequence_mask", True), ("server", "token_truncate", True), ("colocate", "token_mask", False)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_models")


class VLLMRecorder(RecordingTrainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches, self.syncs = [], []
        vg = self.vllm_generation
        orig = vg.sync_weights

        def sync():
            orig()
            engine = (vg.llm if vg.mode == "colocate" else vg.vllm_client).engine
            theirs = dict(engine.model.named_parameters())
            self.syncs.append(max(float((p.detach() - theirs[n]).abs().max())
                                  for n, p in self.accelerator.unwrap_model(self.model).named_parameters()))
        vg.sync_weights = sync

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.batches.append({k: v.detach().cpu().clone() for k, v in out.items() if torch.is_tensor(v)})
        return out


@pytest.mark.parametrize("mode, is_mode, is_on", MODES, ids=[f"{m}-{i}-{o}" for m, i, o in MODES])
def test_vllm_generation_replays_with_its_birth_time_sampler_correction(model_dir, tmp_path, monkeypatch, mode,
                                                                          is_mode, is_on):
    model, tok = tiny_model(model_dir)
    vllm_standin.install(monkeypatch, model_dir / "tiny-qwen2")
    tr = VLLMRecorder(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                      args=make_args(tmp_path / "o", max_steps=4, loss_type="grpo", use_vllm=True, vllm_mode=mode,
                                     vllm_importance_sampling_mode=is_mode, replay_k_rep=2,
                                     vllm_importance_sampling_correction=is_on))
    tr.train()
    engine = (tr.vllm_generation.llm if mode == "colocate" else tr.vllm_generation.vllm_client).engine
    # TRL's weight sync ran once per generation (each at a new optimizer step) and left the engine equal to the model
    assert len(tr.syncs) == len(set(tr.generation_steps)) == 4 and max(tr.syncs) == 0.0
    assert engine.max_logprob_error > 0  # the stand-in's log-probs differ from the trainer's, like a bf16 engine
    # pi_gen of every stored group = the training engine's log-prob at the generation weights
    n = tr.args.num_generations
    stored = {g.group_id: g for g in tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist())}
    checked = 0
    for t, b in enumerate(tr.batches):
        if is_on:
            assert "old_per_token_logps" in b and "importance_sampling_ratio" in b
        for k in range(b["prompt_ids"].shape[0] // n):
            g = stored.get(f"s{tr.generation_steps[t]}.0g{k}")
            if g is None:
                continue
            rows = slice(k * n, (k + 1) * n)
            cm = b["completion_mask"][rows].bool()
            if is_on:
                assert torch.equal(g.logprobs[g.loss_mask], b["old_per_token_logps"][rows][cm])
                ratio = b["importance_sampling_ratio"][rows].expand_as(cm)
                assert torch.equal(g.extras["is_ratio"][g.loss_mask], ratio[cm])
            assert torch.equal(g.extras["sampling_logprobs"][g.loss_mask], b["sampling_per_token_logps"][rows][cm])
            checked += 1
    assert checked > 0
    # replay rows carry the stored sampler correction and sampling log-probs into TRL's loss
    replayed = [r for r in tr.records if r["is_replay"].any()]
    assert replayed
    spg = tr.args.steps_per_generation
    for t, sel in enumerate(tr.selections):
        rows = [r for r in replayed if r["micro"] // spg == t]
        if not sel["groups"]:
            assert not rows
            continue
        got_s = torch.cat([row[m.bool()] for r in rows for row, m in zip(r["sampling"], r["mask"])])
        want_s = torch.cat([e["sampling_logprobs"][m] for e, m in zip(sel["stored_extras"], sel["stored_mask"])])
        assert torch.equal(got_s, want_s)
        if not is_on:
            assert all(r["is_ratio"] is None for r in rows)
            continue
        width = [r["is_ratio"].shape[1] for r in rows]
        assert set(width) == ({1} if is_mode.startswith("sequence") else {r["mask"].shape[1] for r in rows})
        got = torch.cat([row[m.bool()] for r in rows for row, m in zip(r["is_ratio"].expand_as(r["mask"]), r["mask"])])
        want = torch.cat([e["is_ratio"][m] for e, m in zip(sel["stored_extras"], sel["stored_mask"])])
        assert torch.equal(got, want) and (want - 1).abs().max() > 1e-4
        for r in rows:  # ... and the ratio enters the loss as TRL's factor on the policy term
            assert r["loss"] == pytest.approx(grpo_is_loss(r, r["is_ratio"].expand_as(r["mask"])), rel=1e-4, abs=1e-6)


def grpo_is_loss(r, ratio):
    """TRL's grpo loss with the vLLM importance-sampling factor, written out (eps 0.2, GA 2)."""
    m = r["mask"].float()
    now, old, adv = r["now"], r["old"], r["advantages"].unsqueeze(1)
    coef = torch.exp(now - old)
    pg = -torch.min(coef * adv, coef.clamp(0.8, 1.2) * adv) * ratio
    return float(((pg * m).sum(1) / m.sum(1).clamp(min=1)).mean() / 2)
