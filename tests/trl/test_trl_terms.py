"""Every term of TRL's loss composed with replay chunks, against a hand recomputation of the merged micro-batch
(tests/support/trl_loss_ref.py), for every loss type: loss value and gradient.  Plus the adaptive entropy
controller stepping once per update, the MoE router loss counted once, and the drop-in constructor."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.microstep import MicroStep  # noqa: E402
from hdreplay.integrations.trl.plan import ReplaySettingWarning  # noqa: E402
from hdreplay.integrations.trl.terms import applied_entropy_coef  # noqa: E402
from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402
from trl_loss_ref import merged_loss  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo")
#: trainer attributes (TRL reads them at loss time) -> values; "args." = a GRPOConfig field read from args
TERMS = {  # (the policy term and the KL alone: tests/trl/test_trl_loss.py)
    "token:kl+entropy_bonus+off_policy_mask+vllm_is": {
        "beta": 0.1, "entropy_coef": 0.5, "_entropy_bonus_enabled": True, "off_policy_mask_threshold": 0.02,
        "use_vllm": True, "vllm_importance_sampling_correction": True},
    "entropy_quantile+bonus": {"top_entropy_quantile": 0.5, "entropy_coef": 0.5, "_entropy_bonus_enabled": True},
    "sequence(gspo):all": {
        "importance_sampling_level": "sequence", "beta": 0.1, "args.use_bias_correction_kl": True, "args.delta": 1.2,
        "entropy_coef": 0.3, "_entropy_bonus_enabled": True, "off_policy_mask_threshold": 0.02, "use_vllm": True,
        "vllm_importance_sampling_correction": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("terms_models")


class Keep(HDRGRPOTrainer):
    """Keeps the micro-steps that carried replay rows."""

    def _prepare_inputs(self, batch):
        micro = super()._prepare_inputs(batch)
        if isinstance(micro, MicroStep) and micro.replay:
            self.kept = getattr(self, "kept", []) + [micro]
        return micro


def set_terms(tr, values: dict) -> dict:
    """Set ``values`` on ``tr`` (or its args); returns the previous values."""
    old = {}
    for k, v in values.items():
        obj, name = (tr.args, k[5:]) if k.startswith("args.") else (tr, k)
        old[k] = getattr(obj, name)
        setattr(obj, name, v)
    return old


def with_sampler_fields(part: dict, g: torch.Generator) -> dict:
    """A vLLM-generated part: its sampler's log-probs and TRL's importance-sampling ratio (token level)."""
    out = dict(part)
    shape = part["completion_mask"].shape
    base = part.get("old_per_token_logps", torch.full(shape, -2.0))
    out["sampling_per_token_logps"] = base + 0.2 * torch.randn(shape, generator=g)
    out["importance_sampling_ratio"] = torch.exp(0.3 * torch.randn(shape, generator=g)).clamp(0.5, 2.0)
    return out


def chunk_grads(tr, micro, mode):
    tr.model.zero_grad()
    tr.args.replay_micro_step = mode
    loss = tr.compute_loss(tr.model, MicroStep(micro.fresh, micro.replay, None))
    tr.accelerator.backward(loss)
    return loss.detach(), [p.grad.clone() for p in tr.model.parameters()]


def reference_grads(tr, parts, coef):
    tr.model.zero_grad()
    fwd = []
    for p in parts:
        ids = torch.cat([p["prompt_ids"], p["completion_ids"]], 1)
        attn = torch.cat([p["prompt_mask"], p["completion_mask"]], 1)
        fwd.append(GRPOTrainer._get_per_token_logps_and_entropies(
            tr, tr.model, ids, attn, p["completion_ids"].shape[1], compute_entropy=True,
            compute_aux_loss=tr.aux_loss_enabled))
    loss = merged_loss(tr, parts, fwd, entropy_coef=coef)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in tr.model.parameters()]


def assert_matches(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert float(la) == pytest.approx(float(lb), rel=1e-5, abs=1e-7), what
    flat_a, flat_b = torch.cat([g.flatten() for g in ga]), torch.cat([g.flatten() for g in gb])
    assert flat_b.abs().max() > 0, what
    assert torch.allclose(flat_a, flat_b, rtol=1e-4, atol=1e-7), (what, float((flat_a - flat_b).abs().max()))


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    model, tok = tiny_model(model_dir)
    tr = Keep(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
              args=make_args(tmp_path_factory.mktemp("terms") / "o", max_steps=3, per_device_train_batch_size=4,
                             replay_k_rep=4, beta=0.1))
    tr.train()
    tr.model.train()
    micro = tr.kept[-1]
    assert len(micro.replay) >= 2 and all(c["prompt_ids"].shape[0] <= 4 for c in micro.replay)
    return tr, micro


@pytest.mark.parametrize("terms", list(TERMS))
def test_every_term_equals_the_merged_batch_for_every_loss_type(trained, terms):
    """Chunked loss and gradient == hand recomputation on [fresh ; replay] (per loss type); with every term that
    the merged batch defines (all but the per-part entropy quantile) ``grow`` -- TRL's own loss on the merged
    batch -- equals the same recomputation, which checks the recomputation against TRL itself."""
    tr, micro = trained
    g = torch.Generator().manual_seed(0)
    fresh, replay = micro.fresh, micro.replay
    if TERMS[terms].get("use_vllm"):
        fresh, replay = with_sampler_fields(fresh, g), [with_sampler_fields(c, g) for c in replay]
    m = MicroStep(fresh, replay, None)
    old = set_terms(tr, TERMS[terms])
    try:
        for loss_type in LOSS_TYPES:
            tr.loss_type = loss_type
            coef = applied_entropy_coef(tr)
            ref = reference_grads(tr, [fresh, *replay], coef)
            assert_matches(chunk_grads(tr, m, "chunk"), ref, (terms, loss_type, "chunk"))
            if "top_entropy_quantile" not in TERMS[terms]:
                assert_matches(chunk_grads(tr, m, "grow"), ref, (terms, loss_type, "grow"))
    finally:
        set_terms(tr, old)
        tr.args.replay_micro_step, tr.loss_type = "chunk", "dapo"


def test_the_entropy_bonus_counts_once_per_micro_step(trained):
    """The issue's measurement: with dapo the bonus of 1 fresh part + 2 replay chunks was counted 3 times (1.505
    where 0.5 was expected).  Here: the chunked loss minus the loss without the bonus is -c x the merged mean
    entropy / GA, whatever the number of parts."""
    tr, micro = trained
    m = MicroStep(micro.fresh, micro.replay, None)
    base = float(tr.compute_loss(tr.model, m))  # (earlier parts backpropagate inside; the gradients are not used)
    old = set_terms(tr, {"entropy_coef": 0.5, "_entropy_bonus_enabled": True})
    try:
        with_bonus = float(tr.compute_loss(tr.model, m))
    finally:
        set_terms(tr, old)
    tr.model.zero_grad()
    ent, toks = 0.0, 0.0
    with torch.no_grad():
        for p in (micro.fresh, *micro.replay):
            ids = torch.cat([p["prompt_ids"], p["completion_ids"]], 1)
            attn = torch.cat([p["prompt_mask"], p["completion_mask"]], 1)
            _, h, _ = GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, attn,
                                                                    p["completion_ids"].shape[1], compute_entropy=True)
            mask = p["completion_mask"] * p.get("tool_mask", 1)
            ent, toks = ent + float((h * mask).sum()), toks + float(mask.sum())
    ga = tr.current_gradient_accumulation_steps
    assert base - with_bonus == pytest.approx(0.5 * ent / toks / ga, rel=1e-5)


class CountingController(RecordingTrainer):
    """Counts the adaptive entropy controller's steps (TRL assigns ``_last_world_entropy`` once per step) and
    the coefficient every part of every update applied."""

    steps = 0
    applied: list

    @property
    def _last_world_entropy(self):
        return self.__dict__.get("_lwe", float("inf"))

    @_last_world_entropy.setter
    def _last_world_entropy(self, v):
        if "_lwe" in self.__dict__:  # not TRL's initial value
            type(self).steps += 1
        self.__dict__["_lwe"] = v

    def _compute_loss(self, model, inputs):
        self.applied = getattr(self, "applied", []) + [(self.state.global_step, applied_entropy_coef(self))]
        return super()._compute_loss(model, inputs)


def test_the_adaptive_entropy_controller_steps_once_per_update_as_in_plain_trl(model_dir, tmp_path):
    """Plain TRL steps the controller once per optimizer update (9 for 9 updates); chunked replay stepped it once
    per part of the last micro-step (17), and the replay chunks after the step applied the next update's value."""
    common = dict(max_steps=4, use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
                  entropy_coef_delta=0.01, replay_k_rep=4, per_device_train_batch_size=4)
    model, tok = tiny_model(model_dir)
    CountingController.steps = 0
    tr = CountingController(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                            args=make_args(tmp_path / "h", **common))
    tr.train()
    assert any(r["is_replay"].any() for r in tr.records)
    assert CountingController.steps == 4
    assert tr.entropy_coef == pytest.approx(0.05 + 4 * 0.01)  # the window entropy is below the target every update
    by_step = {}
    for step, c in tr.applied:
        by_step.setdefault(step, set()).add(c)
    assert all(len(v) == 1 for v in by_step.values()), by_step  # every part of an update: the same coefficient
    assert [by_step[s].pop() for s in sorted(by_step)] == pytest.approx([0.0, 0.06, 0.07, 0.08])


def moe_model(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hdreplay_lab.sandbox.model import build_tokenizer, load_model

    if not (path / "config.json").exists():
        tok = build_tokenizer()
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=True,
                             pad_token_id=0, eos_token_id=1, bos_token_id=None, router_aux_loss_coef=0.05)
        Qwen3MoeForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path / "tokenizer")
    return load_model(path)


def test_the_moe_router_loss_counts_once_with_token_shares(model_dir, tmp_path):
    model, tok = moe_model(model_dir / "moe")
    tr = Keep(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
              args=make_args(tmp_path / "o", max_steps=3, per_device_train_batch_size=4, replay_k_rep=4))
    assert tr.aux_loss_enabled and tr.router_aux_loss_coef == 0.05
    tr.train()
    tr.model.train()
    micro = tr.kept[-1]
    assert len(micro.replay) >= 2
    for loss_type in ("dapo", "grpo"):
        tr.loss_type = loss_type
        ref = reference_grads(tr, [micro.fresh, *micro.replay], applied_entropy_coef(tr))
        assert_matches(chunk_grads(tr, micro, "chunk"), ref, loss_type)


def test_the_drop_in_constructor_builds_with_trls_defaults(model_dir, tmp_path, monkeypatch):
    """``HDRGRPOTrainer(model, reward_funcs, train_dataset=...)`` as ``GRPOTrainer``: TRL's defaults (batch 8, 8
    generations, 1 fresh group per update) leave the default replay budget (half the fresh groups) at 0, so it
    replays one group per update and says why.  A plain GRPOConfig gets the same.  (TRL's default bf16=True needs a
    bf16 device; the check that refuses it on this CPU is answered yes for this test.)"""
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    model, tok = tiny_model(model_dir)
    plain = GRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok)
    with pytest.warns(ReplaySettingWarning, match="replay_k_rep=1") as rec:
        hdr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok)
    assert isinstance(hdr.args, HDRGRPOConfig) and hdr.args.output_dir == plain.args.output_dir
    assert (hdr.replay_plan.fresh_groups, hdr.replay_config.k_rep) == (1, 1)
    assert any("would be 0" in str(w.message) for w in rec)
    with pytest.warns(ReplaySettingWarning, match="replay_k_rep=1"):
        conv = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                              args=GRPOConfig("x", use_cpu=True, bf16=False, report_to="none"))
    assert conv.replay_config.k_rep == 1
    # a configuration the user wrote keeps its refusal: the error names the field and the fix
    from hdreplay import ReplayConfigError

    with pytest.raises(ReplayConfigError, match="replay_k_rep"):
        HDRGRPOConfig("y", use_cpu=True, bf16=False, report_to="none")
    with warnings.catch_warnings():  # an explicit budget is not warned about
        warnings.simplefilter("error", ReplaySettingWarning)
        HDRGRPOConfig("z", use_cpu=True, bf16=False, report_to="none", replay_k_rep=1)
