"""HDRGRPOTrainer through the real ``trainer.train()`` path (1 process; see test_trl_distributed for 2)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hdreplay import CheckpointError, ReplayController  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOConfig, HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.batch import ROW_KEYS, SCALAR_KEYS, check_keys  # noqa: E402
from trl_fixtures import (  # noqa: E402
    RecordingTrainer,
    buffer_hash,
    grpo_and_replay_none,
    loss_log,
    make_args,
    prompts,
    reward_digit,
    tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def run(model_dir, out, cls=RecordingTrainer, **over):
    model, tok = tiny_model(model_dir)
    tr = cls(model=model, reward_funcs=reward_digit, args=make_args(out, **over), train_dataset=prompts(),
             processing_class=tok)
    tr.train()
    return tr


def generations(tr):
    """Loss-call records grouped by generation (spg micro-steps each, num_iterations = 1)."""
    spg = tr.args.steps_per_generation
    out: dict[int, list] = {}
    for r in tr.records:
        out.setdefault(r["micro"] // spg, []).append(r)
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "token"), ("grpo", "sequence")])
def test_replay_rows_train_through_the_real_loss(model_dir, tmp_path, loss_type, level):
    tr = run(model_dir, tmp_path / "out", loss_type=loss_type, importance_sampling_level=level, max_steps=5,
             epsilon_high=0.28 if loss_type == "dapo" else None)
    sels, pd = tr.selections, tr.args.per_device_train_batch_size
    assert sum(len(s["groups"]) for s in sels) > 0, "the scenario must replay something"
    gens = generations(tr)
    assert len(gens) == len(sels) == 5
    for gen, sel in zip(gens, sels):
        fresh = [r for r in gen if not r["is_replay"].any()]
        replay = [r for r in gen if r["is_replay"].any()]
        # every fresh part is exactly one plain-TRL micro-batch; replay rows come as separate chunks of <= pd rows
        assert len(fresh) == tr.args.steps_per_generation and all(len(r["is_replay"]) == pd for r in fresh)
        assert all(bool(r["is_replay"].all()) and len(r["is_replay"]) <= pd for r in replay)
        n_rep = sum(len(r["is_replay"]) for r in replay)
        assert n_rep == sum(len(lens) for lens in sel["lengths"])
        # num_items_in_batch = loss-mask tokens of the generation's fresh + replay rows, counted here from the masks
        tokens = sum(int(r["mask"].sum()) for r in gen)
        assert all(r["nib"] == tokens for r in gen)
        # no replay before a weight update since birth
        assert all(b < sel["step"] for b in sel["births"])
        # replayed rows carry their stored generation log-probs as the ratio denominator, in selection order
        got = [row[m.bool()] for r in replay for row, m in zip(r["old"], r["mask"])]
        want = [g_lp[g_m] for g_lp, g_m in zip(sel["stored_logps"], sel["stored_mask"])]
        if replay:
            assert torch.equal(torch.cat(got), torch.cat(want))
    # fresh rows: the generation log-probs stored in the buffer are those of the row's own first training forward
    n = tr.args.num_generations
    buf = tr.replay.buffer
    stored = {g.group_id: g for g in buf.get(buf.insertion_ids().tolist())}
    checked = 0
    for t, gen in enumerate(gens):
        for r in gen:
            if r["is_replay"].any():
                continue
            for row, k in enumerate(r["hdr_row"].tolist()):
                g = stored.get(f"s{t}.0g{k // n}")
                if g is None:
                    continue
                resp, m = g.split(g.logprobs)[k % n], g.split(g.loss_mask)[k % n]
                assert torch.allclose(resp[m], r["now"][row][:len(resp)][m], atol=1e-6, rtol=0)
                checked += 1
    assert checked > 0
    # after the first update, replayed ratios differ from 1 and equal exp(logp_now - stored)
    later = [r for r in tr.records if r["is_replay"].any() and r["global_step"] >= 1]
    assert later
    for r in later:
        m = r["mask"].bool()
        assert (torch.exp(r["now"][m] - r["old"][m]) - 1).abs().max() > 1e-3
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)


def test_selector_none_reproduces_grpo_trainer_exactly(model_dir, tmp_path):
    common = dict(max_steps=3, seed=7)
    g, h = grpo_and_replay_none(lambda: tiny_model(model_dir), prompts, make_args(tmp_path / "a", **common),
                                make_args(tmp_path / "b", replay_selector="none", **common), reward_digit)
    a, b = loss_log(g), loss_log(h)
    assert len(a) == 3 and a == b
    assert not any(k.startswith("replay/") for x in h.state.log_history for k in x)


def test_checkpoint_resume_equals_uninterrupted(model_dir, tmp_path):
    over = dict(max_steps=6, save_strategy="steps", save_steps=3, replay_tau=0.05, replay_k_rep=3)
    full = run(model_dir, tmp_path / "full", **over)
    ck = tmp_path / "full" / "checkpoint-3" / "hdreplay"
    assert ReplayController.verify(ck) is not None  # a complete, intact replay state with committed steps
    model, tok = tiny_model(model_dir)
    resumed = RecordingTrainer(model=model, reward_funcs=reward_digit, args=make_args(tmp_path / "full", **over),
                               train_dataset=prompts(), processing_class=tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    # the selections after step 3 and the final buffer are the uninterrupted run's
    tail = [{k: s[k] for k in ("step", "groups")} for s in full.selections[3:]]
    assert [{k: s[k] for k in ("step", "groups")} for s in resumed.selections] == tail
    assert full.buffer_hashes[-1] == resumed.buffer_hashes[-1] == buffer_hash(resumed.replay)
    steps = [json.loads(x)["step"] for x in open(tmp_path / "full" / "replay" / "steps.jsonl")]
    assert steps == list(range(6))  # the resumed run rewound and rewrote its diagnostics


def test_resume_from_plain_checkpoint_is_refused_unless_allowed(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    plain = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                           args=make_args(tmp_path / "o", replay_selector="none", max_steps=1, save_strategy="steps",
                                          save_steps=1))
    plain.train()
    model, tok = tiny_model(model_dir)
    tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                        args=make_args(tmp_path / "o", max_steps=2))
    with pytest.raises(CheckpointError, match="replay_resume_without_state"):
        tr.train(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-1"))


def test_replay_rows_use_the_stored_reference_logprobs_in_the_loss(model_dir, tmp_path):
    """beta != 0: a replayed row's KL term uses the reference log-probs stored at its birth, inside TRL's loss."""
    tr = run(model_dir, tmp_path / "out", beta=0.5, max_steps=4, loss_type="grpo", replay_k_rep=2)
    assert any(s["groups"] for s in tr.selections)
    gens = generations(tr)
    checked = 0
    for gen, sel in zip(gens, tr.selections):
        replay = [r for r in gen if r["is_replay"].any()]
        if not replay:
            continue
        got = torch.cat([row[m.bool()] for r in replay for row, m in zip(r["ref"], r["mask"])])
        want = torch.cat([ref[m] for ref, m in zip(sel["stored_ref"], sel["stored_mask"])])
        assert torch.equal(got, want)
        for r in replay:  # the loss TRL computed for the chunk, recomputed here from its own inputs
            assert r["loss"] == pytest.approx(grpo_chunk_loss(r, beta=0.5, eps=0.2, ga=2), rel=1e-4, abs=1e-6)
            checked += 1
    assert checked > 0


def grpo_chunk_loss(r, *, beta, eps, ga):
    """TRL's grpo loss (token-level ratio, two-sided clip, k3 KL to the reference weighted by the ratio:
    use_bias_correction_kl defaults to True), written out independently."""
    m = r["mask"].float()
    now, old, ref, adv = r["now"], r["old"], r["ref"], r["advantages"].unsqueeze(1)
    ratio = torch.exp(now - old)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    kl = (torch.exp(ref - now) - (ref - now) - 1) * ratio
    per_row = ((pg + beta * kl) * m).sum(1) / m.sum(1).clamp(min=1)
    return float(per_row.mean() / ga)


def test_metrics_reach_trl_logs(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    tr = run(model_dir, tmp_path / "out", max_steps=3, report_to="tensorboard")
    logged = {k for h in tr.state.log_history for k in h}
    for k in ("replay/buffer_size", "replay/ingress_admitted", "replay/accepted", "replay/budget_fill",
              "replay/scanned", "replay/accept_rate", "replay/drift_accepted", "replay/replay_kl", "replay/mean_age",
              "replay/ingress_empty", "replay/generations", "replay/scan_capped"):
        assert k in logged, k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    assert "train/replay/accepted" in ev.Tags()["scalars"]
    assert (tmp_path / "out" / "replay" / "steps.jsonl").exists()
    assert (tmp_path / "out" / "replay" / "groups.jsonl").exists()  # written at the end of train()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_rescoring_is_padding_invariant_with_mixed_prompt_lengths(model_dir, tmp_path, monkeypatch, arch):
    """A group re-scored under unchanged weights has Drift ~0 however it is padded or batched."""
    import hdreplay.integrations.trl.rescore as rescore

    monkeypatch.setattr(rescore, "SHARE_BELOW_TOKEN_RATIO", 1.0)  # these short prompts would not be shared
    model, tok = tiny_model(model_dir, arch=arch)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(tmp_path / "o", max_steps=1, learning_rate=0.0, replay_k_rep=0,
                                         disable_dropout=True))
    tr.train()
    groups = tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist())
    assert len({g.prompt_ids.numel() for g in groups}) > 1, "prompts of different lengths must be mixed"
    from hdreplay import group_scores

    for shared in (True, False):  # one prompt pass per group (KV cache), and TRL's full-row forward
        tr._share_prompt = shared
        for batch in (groups, groups[::-1], [groups[0]], groups[1:]):
            lps = tr._replay_scorer(batch)
            d = group_scores(batch, lps).drift
            assert float(d.max()) < 1e-10, (arch, shared, d)
    if arch == "gpt2":  # the hook is what makes an absolute-position model invariant under the full-row forward
        tr._position_hook.remove()
        lps = tr._replay_scorer(groups)
        assert float(group_scores(groups, lps).drift.max()) > 1e-4


def test_active_dropout_is_rejected_with_the_fix(model_dir, tmp_path):
    model, tok = tiny_model(model_dir, arch="gpt2")  # GPT-2 has dropout 0.1
    with pytest.raises(ValueError, match="disable_dropout=True"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                       args=make_args(tmp_path / "o", max_steps=1))


def test_bad_replay_config_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="replay_tau"):
        make_args(tmp_path, replay_tau=-1.0)
    with pytest.raises(ValueError, match="replay_selector") as e:
        make_args(tmp_path, replay_selector="per")
    assert "headroom_drift" in str(e.value)
    with pytest.raises(ValueError, match="replay_answer_threshold"):
        make_args(tmp_path, replay_ingress="answer")
    with pytest.raises(ValueError, match="replay_k_rep"):
        make_args(tmp_path, replay_k_rep=-2)


def test_plain_grpo_config_is_converted_with_the_replay_settings_named(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, max_steps=1,
                       per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2,
                       activation_checkpointing=False, disable_dropout=True, learning_rate=0.0)
    with pytest.warns(UserWarning, match="plain GRPOConfig") as rec:
        tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                            args=plain)
    msg = next(str(w.message) for w in rec if "plain GRPOConfig" in str(w.message))
    assert "replay_k_rep=2" in msg  # half the 4 fresh groups of an update
    assert isinstance(tr.args, HDRGRPOConfig) and tr.replay_active and tr.replay_config.k_rep == 2
    assert {f: getattr(tr.args, f) for f in ("per_device_train_batch_size", "steps_per_generation", "learning_rate")} \
        == {"per_device_train_batch_size": 8, "steps_per_generation": 2, "learning_rate": 0.0}
    tr.train()
    assert tr.state.global_step == 1
    with pytest.raises(TypeError, match="HDRGRPOConfig, a GRPOConfig or None"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                       args={"output_dir": str(tmp_path)})


def test_args_none_builds_a_default_config_like_grpo_trainer(model_dir, monkeypatch, tmp_path):
    """Without ``args`` GRPOTrainer builds GRPOConfig(f"{name}-GRPO") with TRL's defaults (one process, batch 8, 8
    generations: one fresh group per update, bf16).  HDRGRPOTrainer builds HDRGRPOConfig from the same defaults; the
    default budget (half the fresh groups) would be 0 there, so a config the user did not write replays one group
    per update and warns, naming the TRL defaults and the knobs to choose.  A config the user wrote with the same
    settings is refused instead, naming replay_k_rep.  TRL's default bf16=True needs a GPU: the capability query is
    the one call substituted, so both constructions get past TrainingArguments' check on this CPU machine."""
    import transformers.training_args

    from hdreplay.errors import ReplayConfigError
    from hdreplay.integrations.trl.plan import ReplaySettingWarning

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    model, tok = tiny_model(model_dir)
    plain = GRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok)
    assert type(plain.args) is GRPOConfig and plain.args.output_dir == "tiny-qwen2-GRPO"
    assert (plain.args.per_device_train_batch_size, plain.args.num_generations, plain.args.bf16) == (8, 8, True)
    model, tok = tiny_model(model_dir)
    with pytest.warns(ReplaySettingWarning) as rec:
        tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok)
    assert type(tr.args) is HDRGRPOConfig and tr.args.output_dir == plain.args.output_dir
    same = ("per_device_train_batch_size", "num_generations", "bf16", "learning_rate", "gradient_accumulation_steps",
            "loss_type", "beta", "max_completion_length")
    assert {k: getattr(tr.args, k) for k in same} == {k: getattr(plain.args, k) for k in same}
    assert tr.args.replay_k_rep == 1 and tr.replay_config.k_rep == 1 and tr.replay_active
    msg = " ".join(str(w.message) for w in rec if issubclass(w.category, ReplaySettingWarning))
    assert "would be 0" in msg and "replay_k_rep=1" in msg and "num_generations=8" in msg, msg
    with pytest.raises(ReplayConfigError) as err:  # the same TRL defaults, written by the user
        HDRGRPOConfig(output_dir=str(tmp_path / "written"), per_device_train_batch_size=8, num_generations=8)
    msg = str(err.value)
    assert msg.startswith("replay_k_rep:") and "is 0, so nothing would ever be replayed" in msg, msg
    assert "Set replay_k_rep to a multiple of 1, or replay_selector='none'" in msg, msg


def test_output_key_contract(model_dir, tmp_path):
    """Fails loudly, naming the key, if TRL's per-row output keys change."""
    seen = {}

    class Probe(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.setdefault(self.args.beta, set(out))
            return out

    for beta in (0.0, 0.04):
        model, tok = tiny_model(model_dir)
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, max_steps=1,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=4, beta=beta,
                          activation_checkpointing=False, disable_tqdm=True)
        Probe(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
              processing_class=tok).train()
    expected = {0.0: {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                      "num_items_in_batch"},
                0.04: {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                       "num_items_in_batch", "ref_per_token_logps"}}
    for beta, keys in seen.items():
        assert keys == expected[beta], f"TRL's batch keys changed for beta={beta}: {sorted(keys ^ expected[beta])}"
        assert keys <= set(ROW_KEYS) | set(SCALAR_KEYS)
    with pytest.raises(RuntimeError, match="'audio_features'"):  # a key no version of replay knows
        check_keys({"prompt_ids": 0, "audio_features": 0})
    check_keys({"prompt_ids": 0, "pixel_values": 0, "image_grid_thw": 0, "num_images": 0})  # VLM keys: replayed
    with pytest.raises(RuntimeError, match="'pixel_attention_mask'.*Idefics3"):  # a VLM layout replay refuses
        check_keys({"prompt_ids": 0, "pixel_values": 0, "pixel_attention_mask": 0})


def test_tool_tokens_are_masked_in_buffer_loss_and_replay(model_dir, tmp_path):
    """Multi-turn rollouts (TRL's rollout_func + env_mask): environment tokens never enter T(g)."""
    from trl_fixtures import TOOL_TEXT, tool_rollout

    model, tok = tiny_model(model_dir)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          rollout_func=tool_rollout, args=make_args(tmp_path / "o", max_steps=3))
    tr.train()
    tool_ids = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"]
    groups = tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist())
    assert groups
    for g in groups:
        for resp, m in zip(g.responses(), g.split(g.loss_mask)):
            assert resp[3:3 + len(tool_ids)].tolist() == tool_ids
            assert m.tolist() == [True] * 3 + [False] * len(tool_ids) + [True] * 2
        # Drift/Headroom of the scan are over T(g) only: tool positions carry 0 and are masked
        assert (g.logprobs[~g.loss_mask] == 0).all()
    replayed = [r for r in tr.records if r["is_replay"].any()]
    assert replayed
    for r in tr.records:
        ids = r["completion_ids"]
        for row, m in zip(ids, r["mask"]):
            tool_pos = [j for j in range(len(row) - len(tool_ids) + 1) if row[j:j + len(tool_ids)].tolist() == tool_ids]
            for j in tool_pos:
                assert m[j:j + len(tool_ids)].sum() == 0  # excluded from the loss, replay rows included
    for gen in generations(tr):
        assert all(r["nib"] == sum(int(x["mask"].sum()) for x in gen) for r in gen)


def test_generation_spanning_several_optimizer_steps_trains_replay_only_in_the_gated_update(model_dir, tmp_path):
    """steps_per_generation = 2 x GA: one generation feeds two optimizer updates.  By default the replay rows fill
    the micro-steps of the update whose gate admitted them (the next update trains the generation's fresh rows
    only); with replay_train_scope="generation" they are spread over all four micro-steps, both updates."""
    tr = run(model_dir, tmp_path / "out", max_steps=6, steps_per_generation=4, gradient_accumulation_steps=2,
             per_device_train_batch_size=4, replay_k_rep=2)
    assert tr.args.steps_per_generation == 4 and tr.args.replay_train_scope == "update"
    gens = generations(tr)
    assert len(gens) == len(tr.selections) == 3
    assert [s["step"] for s in tr.selections] == [0, 2, 4] == tr.generation_steps
    for gen, sel in zip(gens[1:], tr.selections[1:]):
        per_micro = {}
        for r in gen:
            per_micro[r["micro"]] = per_micro.get(r["micro"], 0) + int(r["is_replay"].sum())
        assert [per_micro[m] for m in sorted(per_micro)] == [4, 4, 0, 0]  # 8 replay rows in the first update
        assert {r["global_step"] for r in gen if r["is_replay"].any()} == {sel["step"]}
    old = run(model_dir, tmp_path / "old", max_steps=6, steps_per_generation=4, gradient_accumulation_steps=2,
              per_device_train_batch_size=4, replay_k_rep=2, replay_train_scope="generation")
    for gen, sel in zip(generations(old)[1:], old.selections[1:]):
        per_micro = {}
        for r in gen:
            per_micro[r["micro"]] = per_micro.get(r["micro"], 0) + int(r["is_replay"].sum())
        assert sorted(per_micro.values()) == [2, 2, 2, 2]  # 8 replay rows over 4 micro-steps
        assert {r["global_step"] for r in gen if r["is_replay"].any()} == {sel["step"], sel["step"] + 1}


@pytest.mark.parametrize("over", [dict(steps_per_generation=4, gradient_accumulation_steps=2),
                                  dict(num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=2),
                                  dict(num_iterations=2, steps_per_generation=1, gradient_accumulation_steps=2)])
def test_every_replayed_group_trains_within_tau_in_every_update(model_dir, tmp_path, over):
    """The paper's guarantee when a generation outlives an update: each replayed group's Drift, measured on the
    loss forward of every micro-step that trains its rows, is <= tau.  Two iterations inside one update
    (num_iterations=2, spg=1, GA=2) train the rows twice, both times within that update."""
    tau = 0.05
    tr = run(model_dir, tmp_path / "out", max_steps=8, per_device_train_batch_size=4, replay_k_rep=2,
             replay_tau=tau, learning_rate=1e-3, **over)
    trained = {}  # (optimizer update, selection, group) -> [sum of squared log-ratios, tokens]
    sel_of = {s["step"]: s for s in tr.selections}
    for r in tr.records:
        if not r["is_replay"].any():
            continue
        sel = max(k for k in sel_of if k <= r["global_step"])  # the selection whose rows these are
        d = ((r["now"] - r["old"]) ** 2 * r["mask"])[r["is_replay"]]
        for row, g in enumerate((-1 - r["hdr_row"][r["is_replay"]]).tolist()):
            acc = trained.setdefault((r["global_step"], sel, g), [0.0, 0])
            acc[0] += float(d[row].sum())
            acc[1] += int(r["mask"][r["is_replay"]][row].sum())
    assert trained and all(k[0] == k[1] for k in trained)  # trained only in the update that selected them
    drift = {k: v[0] / v[1] for k, v in trained.items()}
    assert max(drift.values()) <= tau * (1 + 1e-4), drift
    if over.get("steps_per_generation") == 1:  # both iterations of the update trained the rows
        assert len({r["micro"] for r in tr.records if r["is_replay"].any()}) > len(drift) // 2


def test_calling_train_again_continues_the_replay_steps(model_dir, tmp_path):
    """A second train() restarts TRL's global_step; replay steps keep increasing and the buffer carries over."""
    tr = run(model_dir, tmp_path / "out", max_steps=2)
    first = [s["step"] for s in tr.selections]
    size = len(tr.replay.buffer)
    tr.train()
    steps = [s["step"] for s in tr.selections]
    assert first == [0, 1] and steps == [0, 1, 2, 3] and len(tr.replay.buffer) >= size
    assert tr.selections[2]["groups"]  # the carried-over buffer is replayed at once


def test_user_callbacks_see_the_step_committed_at_step_end(model_dir, tmp_path):
    from transformers import TrainerCallback

    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append((state.global_step, tr.replay.last_step))

    model, tok = tiny_model(model_dir)
    tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                        args=make_args(tmp_path / "o", max_steps=3), callbacks=[Probe()])
    tr.train()
    assert seen == [(1, 0), (2, 1), (3, 2)]  # the update's replay step (opened at global_step - 1) is committed


@pytest.mark.parametrize("shared", [False, True])
def test_sliced_scan_through_the_trainers_scorer_makes_the_full_scans_decisions(model_dir, tmp_path, monkeypatch,
                                                                                  shared):
    """Exact early rejection through TRL's own re-scoring paths (full rows, and one prompt pass per slice): the same
    scanned groups and gate decisions as whole groups, fewer rows forwarded, and the run itself rejected early."""
    import dataclasses

    import hdreplay.integrations.trl.rescore as rescore
    from hdreplay import select_replay

    tr = run(model_dir, tmp_path / "out", max_steps=6, replay_tau=0.02, learning_rate=1e-2, replay_k_rep=2)
    if shared:
        monkeypatch.setattr(rescore, "SHARE_BELOW_TOKEN_RATIO", 10.0)  # these short prompts would not be shared
        tr._share_prompt = True
    ctrl = tr.replay
    cfg = ctrl.config
    assert cfg.scan_passes == 4
    whole = select_replay(ctrl.buffer, dataclasses.replace(cfg, scan_passes=1), tr._replay_scorer,
                          step=ctrl.last_step + 1, tau=ctrl.tau)
    sliced = select_replay(ctrl.buffer, cfg, tr._replay_scorer, step=ctrl.last_step + 1, tau=ctrl.tau)
    assert len(whole.scanned) and (~whole.scanned_pass).any()
    assert sliced.scanned.tolist() == whole.scanned.tolist()
    assert sliced.scanned_pass.tolist() == whole.scanned_pass.tolist()
    assert sliced.rescored_rows < whole.rescored_rows and (~sliced.scanned_exact).any()
