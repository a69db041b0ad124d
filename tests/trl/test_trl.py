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
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.batch import ROW_KEYS, SCALAR_KEYS, check_keys  # noqa: E402
from trl_fixtures import RecordingTrainer, buffer_hash, make_args, prompts, reward_digit, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def run(model_dir, out, cls=RecordingTrainer, **over):
    model, tok = tiny_model(model_dir)
    tr = cls(model=model, reward_funcs=reward_digit, args=make_args(out, **over), train_dataset=prompts(),
             processing_class=tok)
    tr.train()
    return tr


def cycles(tr):
    """Group micro-step records by generation cycle (GA micro-steps each)."""
    ga = tr.args.gradient_accumulation_steps
    return [tr.records[i:i + ga] for i in range(0, len(tr.records), ga)]


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "token"), ("grpo", "sequence")])
def test_replay_rows_train_through_the_real_loss(model_dir, tmp_path, loss_type, level):
    tr = run(model_dir, tmp_path / "out", loss_type=loss_type, importance_sampling_level=level, max_steps=5,
             epsilon_high=0.28 if loss_type == "dapo" else None)
    sels = tr.selections
    assert sum(len(s["groups"]) for s in sels) > 0, "the scenario must replay something"
    for cyc, sel in zip(cycles(tr), sels):
        flags = torch.cat([r["is_replay"] for r in cyc])
        n_rep = int(flags.sum())
        # replay rows first, in the first micro-steps; nothing dropped
        assert flags.tolist() == [True] * n_rep + [False] * (len(flags) - n_rep)
        assert n_rep == sum(len(lens) for lens in sel["lengths"])
        assert len(flags) - n_rep == tr.args.generation_batch_size
        # num_items_in_batch = loss-mask tokens of fresh + replay rows
        assert all(r["nib"] == sum(int(x["mask"].sum()) for x in cyc) for r in cyc)
        # no same-step replay
        assert all(b < sel["step"] for b in sel["births"])
        # replayed rows carry their stored generation log-probs as the ratio denominator
        with_rep = [r for r in cyc if r["is_replay"].any()]
        assert all(r["old"] is not None for r in with_rep)
        rep_old = [r["old"][r["is_replay"]] for r in with_rep]
        rep_mask = [r["mask"][r["is_replay"]] for r in with_rep]
        rows_old = [row[m.bool()] for old, mk in zip(rep_old, rep_mask) for row, m in zip(old, mk)]
        stored = [lp[mk] for lp, mk in zip(sel["stored_logps"], sel["stored_mask"])]
        lens = [x for ls in sel["lengths"] for x in ls]
        flat_stored = torch.cat(stored) if stored else torch.zeros(0)
        assert sum(lens) == sum(len(torch.as_tensor(lp)) for lp in sel["stored_logps"])
        if rows_old:
            assert torch.equal(torch.cat(rows_old), flat_stored)
    # fresh rows: generation log-probs captured from their own (pre-update) training forward are what the
    # buffer stores, and next to replay rows their ratio denominator is that same value (ratio exactly 1)
    n = tr.args.num_generations
    buf = tr.replay.buffer
    stored = {g.group_id: g for g in buf.get(buf.insertion_ids().tolist())}
    checked = 0
    for t, cyc in enumerate(cycles(tr)):
        for r in cyc:
            for row, k in enumerate(r["hdr_row"].tolist()):
                if k < 0:
                    continue
                if r["old_after"] is not None:  # a fresh row sharing its micro-step with replay rows
                    m = r["mask"][row].bool()
                    assert torch.allclose(r["old_after"][row][m], r["now"][row][m], atol=1e-6, rtol=0)
                    checked += 1
                g = stored.get(f"s{t}g{k // n}")
                if g is None:
                    continue
                resp = g.split(g.logprobs)[k % n]
                m = g.split(g.loss_mask)[k % n]
                L = len(resp)
                assert torch.allclose(resp[m], r["now"][row][:L][m], atol=1e-6, rtol=0)
                checked += 1
    assert checked > 0
    # after the first update, replayed ratios differ from 1 and equal exp(logp_now - stored)
    later = [r for r in tr.records if r["is_replay"].any() and r["global_step"] >= 1]
    assert later
    for r in later:
        m = r["mask"][r["is_replay"]].bool()
        ratio = torch.exp(r["now"][r["is_replay"]][m] - r["old"][r["is_replay"]][m])
        assert (ratio - 1).abs().max() > 1e-3
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)


def test_selector_none_reproduces_grpo_trainer_exactly(model_dir, tmp_path):
    common = dict(max_steps=3, seed=7)
    model, tok = tiny_model(model_dir)
    base_args = make_args(tmp_path / "a", **common)
    plain = GRPOConfig(**{k: v for k, v in base_args.to_dict().items() if not k.startswith("replay_")
                          and k in GRPOConfig.__dataclass_fields__ and k not in ("generation_batch_size",)})
    plain.steps_per_generation = base_args.steps_per_generation
    g = GRPOTrainer(model=model, reward_funcs=reward_digit, args=plain, train_dataset=prompts(), processing_class=tok)
    g.train()
    model2, tok2 = tiny_model(model_dir)
    h = HDRGRPOTrainer(model=model2, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok2,
                       args=make_args(tmp_path / "b", replay_selector="none", **common))
    h.train()
    keys = ("loss", "grad_norm", "reward", "entropy")
    a = [{k: x[k] for k in keys} for x in g.state.log_history if "loss" in x]
    b = [{k: x[k] for k in keys} for x in h.state.log_history if "loss" in x]
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


def test_reference_logprobs_are_stored_and_replayed_when_beta_is_set(model_dir, tmp_path):
    tr = run(model_dir, tmp_path / "out", beta=0.04, max_steps=4)
    assert any(s["groups"] for s in tr.selections)
    ids = tr.replay.buffer.insertion_ids()
    g = tr.replay.buffer.get([int(ids[0])])[0]
    assert "ref_logprobs" in g.extras and torch.isfinite(g.extras["ref_logprobs"]).all()
    assert all(math.isfinite(h["loss"]) for h in tr.state.log_history if "loss" in h)


def test_metrics_reach_trl_logs(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    tr = run(model_dir, tmp_path / "out", max_steps=3, report_to="tensorboard")
    logged = {k for h in tr.state.log_history for k in h}
    for k in ("replay/buffer_size", "replay/ingress_admitted", "replay/accepted", "replay/budget_fill", "replay/scanned",
              "replay/accept_rate", "replay/drift_accepted", "replay/replay_kl", "replay/mean_age"):
        assert k in logged, k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    assert "train/replay/accepted" in ev.Tags()["scalars"]
    assert (tmp_path / "out" / "replay" / "steps.jsonl").exists()
    assert (tmp_path / "out" / "replay" / "groups.jsonl").exists()  # written at the end of train()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_rescoring_is_padding_invariant_with_mixed_prompt_lengths(model_dir, tmp_path, arch):
    """A group re-scored under unchanged weights has Drift ~0 however it is padded or batched."""
    model, tok = tiny_model(model_dir, arch=arch)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                          args=make_args(tmp_path / "o", max_steps=1, learning_rate=0.0, replay_k_rep=0,
                                         disable_dropout=True))
    tr.train()
    groups = tr.replay.buffer.get(tr.replay.buffer.insertion_ids().tolist()) + tr.replay._staged
    assert len({g.prompt_ids.numel() for g in groups}) > 1, "prompts of different lengths must be mixed"
    from hdreplay import group_scores

    for batch in (groups, groups[::-1], [groups[0]], groups[1:]):
        lps = tr._replay_scorer(batch)
        d = group_scores(batch, lps).drift
        assert float(d.max()) < 1e-10, (arch, d)
    if arch == "gpt2":  # the hook is what makes an absolute-position model invariant
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
    with pytest.raises(ValueError, match="use_vllm"):
        make_args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="replay_k_rep"):
        make_args(tmp_path, replay_k_rep=-2)


def test_plain_grpo_config_is_rejected(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    with pytest.raises(TypeError, match="HDRGRPOConfig"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(), processing_class=tok,
                       args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False))


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
    with pytest.raises(RuntimeError, match="'pixel_values'"):
        check_keys({"prompt_ids": 0, "pixel_values": 0})


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
    for cyc in cycles(tr):
        assert all(r["nib"] == sum(int(x["mask"].sum()) for x in cyc) for r in cyc)


def test_generation_spanning_several_optimizer_steps_replays_in_the_first(model_dir, tmp_path):
    """steps_per_generation = 2 x GA: one generation feeds two optimizer steps; replay goes first."""
    tr = run(model_dir, tmp_path / "out", max_steps=6, steps_per_generation=4, gradient_accumulation_steps=2,
             per_device_train_batch_size=4)
    assert tr.args.steps_per_generation == 4
    gens = [tr.records[i:i + 4] for i in range(0, len(tr.records), 4)]
    assert len(gens) == len(tr.selections) == 3
    assert any(s["groups"] for s in tr.selections)
    for gen, sel in zip(gens, tr.selections):
        flags = torch.cat([r["is_replay"] for r in gen])
        k = int(flags.sum())
        assert flags.tolist() == [True] * k + [False] * (len(flags) - k)
        assert k == sum(len(x) for x in sel["lengths"])
        # the buffered generation is consumed over two optimizer steps
        assert gen[0]["global_step"] + 1 == gen[-1]["global_step"]
