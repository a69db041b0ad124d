"""The peer replay strategies through the real ``trainer.train()`` path: DAPO's dynamic sampling (never trains on a
zero-variance group, fills the batch, counts the extra generations), FreshPER's importance weights reaching the
loss, and rollout-level |A| replay (stored advantages, nothing past max_age)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import ReplayConfigError  # noqa: E402
from hdreplay.baselines.orders import priorities  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from trl_fixtures import RecordingTrainer, decoded_rows, make_args, prompts, reward_digit, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def reward_half_constant(completions, prompts, **kw):
    """Prompts of even length: always 1 (a zero-variance group); odd length: the digit reward (mixed)."""
    return [1.0 if len(p) % 2 == 0 else reward_digit([c])[0] for c, p in zip(completions, prompts)]


_texts = decoded_rows


class PromptRecordingTrainer(RecordingTrainer):
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.records[-1]["prompt_ids"] = inputs["prompt_ids"].cpu()
        self.records[-1]["prompt_mask"] = inputs["prompt_mask"].cpu()
        self.records[-1]["completion_mask"] = inputs["completion_mask"].cpu()
        return loss


class RepoRecordingTrainer(PromptRecordingTrainer):
    def _commit_step(self):  # RePO keeps per-prompt stores, not the buffer the parent hashes
        HDRGRPOTrainer._commit_step(self)


def test_dynamic_sampling_trains_only_mixed_groups_fills_the_batch_and_counts_generations(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    args = make_args(tmp_path, replay_selector="none", replay_dynamic_sampling=True, gradient_accumulation_steps=1,
                     per_device_train_batch_size=16, num_generations=4, max_steps=4, seed=3)
    tr = PromptRecordingTrainer(model=model, reward_funcs=reward_half_constant, args=args, train_dataset=prompts(),
                                processing_class=tok)
    tr.train()
    assert len(tr.records) == 4  # one micro-step per update (GA 1, spg 1)
    logs = [x for x in tr.state.log_history if "dynamic/rounds" in x]
    assert len(logs) == 4
    for rec, log in zip(tr.records, logs):
        rows = _texts(tok, rec)
        assert len(rows) == 16  # the batch is full: B = 4 groups of 4
        by_prompt: dict[str, list[float]] = {}
        for p, c in rows:
            by_prompt.setdefault(p, []).append(reward_half_constant([c], [p])[0])
        # rewards recomputed from the trained text: no zero-variance group (every even-length prompt is one)
        assert all(len(p) % 2 == 1 for p in by_prompt), sorted(by_prompt)
        assert all(max(r) > min(r) for r in by_prompt.values())
        assert log["dynamic/filled_zero_var"] == 0
        assert 1 <= log["dynamic/rounds"] <= 10
        assert log["dynamic/generated_rows"] == log["dynamic/rounds"] * 16
        assert log["dynamic/dropped_groups"] == log["dynamic/rounds"] * 4 - 4
    assert max(x["dynamic/rounds"] for x in logs) > 1  # half the prompts are constant: extra rounds were needed


def test_dynamic_sampling_at_the_round_limit_completes_the_batch_with_zero_advantage_groups(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    args = make_args(tmp_path, replay_selector="none", replay_dynamic_sampling=True, gradient_accumulation_steps=1,
                     replay_dynamic_sampling_max_batches=2, max_steps=2)
    tr = RecordingTrainer(model=model, reward_funcs=lambda completions, **kw: [1.0] * len(completions), args=args,
                          train_dataset=prompts(), processing_class=tok)
    tr.train()
    logs = [x for x in tr.state.log_history if "dynamic/rounds" in x]
    assert [x["dynamic/rounds"] for x in logs] == [2, 2]
    assert [x["dynamic/filled_zero_var"] for x in logs] == [2, 2]  # B = 8 rows / 4 = 2 groups, none mixed
    assert all(r["advantages"].abs().max() == 0 and r["completion_ids"].shape[0] == 8 for r in tr.records)


def test_dynamic_sampling_and_repo_settings_are_validated(tmp_path):
    with pytest.raises(ReplayConfigError) as e:
        make_args(tmp_path, replay_selector="recency", replay_dynamic_sampling=True)
    assert e.value.field == "replay_dynamic_sampling"
    with pytest.raises(ReplayConfigError) as e:
        make_args(tmp_path, replay_selector="none", replay_dynamic_sampling_max_batches=0)
    assert e.value.field == "replay_dynamic_sampling_max_batches"
    for bad in ({"retrieval": "recent"}, {"retrieval": "random"}, {"min_cache": 9, "max_cache": 8}, {"k": 3}):
        with pytest.raises(ReplayConfigError) as e:  # RePO replaces the selector; its options are validated
            make_args(tmp_path, replay_selector="recency" if bad == {"retrieval": "recent"} else "none",
                      replay_repo=bad)
        assert e.value.field == "replay_repo"


class WeightRecordingTrainer(RecordingTrainer):
    """Records, before each selection, the FreshPER weights computed independently from the buffer."""

    def _select(self, step):
        buf, cfg = self.replay.buffer, self.replay.config
        expect = None
        if len(buf):
            p = priorities(buf, cfg, step.index) ** cfg.priority_alpha
            w = (len(p) * p / p.sum()) ** -cfg.is_beta  # PER: normalised by the largest weight over the buffer
            expect = dict(zip(buf.insertion_ids().tolist(), w / w.max()))
        super()._select(step)
        sel = step.selection
        self.selections[-1]["weights"] = None if sel.loss_weights is None else np.asarray(sel.loss_weights)
        self.selections[-1]["expect"] = None if expect is None else np.asarray([expect[i] for i in sel.accepted])
        self.selections[-1]["stored_adv"] = [g.advantages.clone() for g in sel.groups]


def test_freshper_importance_weights_scale_the_replayed_rows_in_the_loss(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    args = make_args(tmp_path, replay_selector="freshper", replay_priority_alpha=0.6, replay_age_decay=1.0,
                     replay_is_beta=0.4, replay_ingress="all", max_steps=5, replay_k_rep=2)
    tr = WeightRecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                                processing_class=tok)
    tr.train()
    checked, unequal = 0, False
    for sel in tr.selections:
        if not sel["groups"]:
            continue
        w, expect = sel["weights"], sel["expect"]
        # PER: w_i = (N P(i))^-beta / max_j w_j
        assert np.allclose(w, expect, rtol=1e-6) and w.max() <= 1 + 1e-12
        unequal |= bool(w.min() < 0.999)
        want = torch.cat([a * float(x) for a, x in zip(sel["stored_adv"], w)])
        got = torch.cat([r["advantages"][r["is_replay"]] for r in tr.records if r["global_step"] == sel["step"]])
        assert torch.allclose(got.sort().values, want.float().sort().values, atol=1e-6)
        checked += 1
    assert checked >= 3 and unequal  # weights below 1 did reach the loss


def test_adv_priority_replays_single_rollouts_with_their_stored_advantage_within_max_age(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    args = make_args(tmp_path, replay_selector="adv_priority", replay_priority_alpha=1.0, replay_max_age=1,
                     max_steps=5, replay_k_rep=2)
    tr = WeightRecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(),
                                processing_class=tok)
    tr.train()
    replayed = 0
    for sel in tr.selections:
        assert all(sel["step"] - b <= 1 for b in sel["births"])  # never past max_age
        assert all(len(lens) == 1 for lens in sel["lengths"])  # single rollouts
        want = torch.cat(sel["stored_adv"]) if sel["stored_adv"] else torch.zeros(0)
        assert bool((want != 0).all())  # zero-advantage rollouts are never stored
        got = torch.cat([r["advantages"][r["is_replay"]] for r in tr.records if r["global_step"] == sel["step"]])
        assert torch.allclose(got.sort().values, want.float().sort().values)
        replayed += len(sel["groups"])
    assert replayed > 0


def _repo_args(out, coef, **over):
    repo = {"retrieval": "recent", "num_replays": 3, "min_cache": 4, "max_cache": 8, "off_coef": coef}
    return make_args(out, replay_selector="none", replay_repo=repo, gradient_accumulation_steps=1,
                     per_device_train_batch_size=8, num_generations=4, max_steps=6, seed=1, loss_type="grpo", **over)


def test_repo_replays_newest_stored_responses_of_the_batch_prompts_with_split_advantages(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    tr = RepoRecordingTrainer(model=model, reward_funcs=reward_digit, args=_repo_args(tmp_path, 1.0),
                                train_dataset=prompts(4), processing_class=tok)
    tr.train()
    seen: dict[str, list[tuple[int, str]]] = {}  # prompt -> (step, completion) of every fresh row, in order
    replayed_steps = 0
    for rec in tr.records:  # one loss call per part: the fresh part first, then the replay chunks
        step, rows = rec["global_step"], _texts(tok, rec)
        # fresh rows in generation order (TRL shuffles them into micro-batches; hdr_row is the generation index)
        fresh = [r for _, r in sorted((int(h), r) for r, h in zip(rows, rec["hdr_row"].tolist()) if h >= 0)]
        replay = [(r, float(a)) for r, rep, a in zip(rows, rec["is_replay"].tolist(), rec["advantages"].tolist())
                  if rep]
        by_prompt: dict[str, list] = {}
        for (p, c), a in replay:
            by_prompt.setdefault(p, []).append((c, a))
        batch_prompts = {p for p, _ in fresh} or set(by_prompt)
        for p, got in by_prompt.items():
            assert p in batch_prompts or not fresh  # only prompts of the current batch
            past = [c for s, c in seen.get(p, []) if s < step]  # never a response born this step
            assert len(past) >= 4 and [c for c, _ in got] == past[-3:]  # min_cache 4, the newest k = 3
            r = torch.tensor([reward_digit([c])[0] for c, _ in got])
            want = (r - r.mean()) / (r.std() + 1e-4)  # split normalisation over the replayed rows only
            assert torch.allclose(torch.tensor([a for _, a in got]), want, atol=1e-5)
            replayed_steps += 1
        for p, c in fresh:
            seen.setdefault(p, []).append((step, c))
    assert replayed_steps >= 3


def test_repo_off_policy_term_has_its_own_coefficient(model_dir, tmp_path):
    """off_coef = 0 trains as plain GRPO (the replay rows' term vanishes); off_coef = 1 does not."""
    def history(args):
        model, tok = tiny_model(model_dir)
        tr = RepoRecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(4),
                              processing_class=tok)
        tr.train()
        return [(x["loss"], x["grad_norm"], x["reward"]) for x in tr.state.log_history if "grad_norm" in x], tr

    plain, _ = history(make_args(tmp_path / "p", replay_selector="none", gradient_accumulation_steps=1,
                                 per_device_train_batch_size=8, num_generations=4, max_steps=6, seed=1,
                                 loss_type="grpo"))
    zero, tz = history(_repo_args(tmp_path / "z", 0.0))
    one, _ = history(_repo_args(tmp_path / "o", 1.0))
    assert any(r["is_replay"].any() for r in tz.records)  # replay rows were there, weighted 0
    # equal up to float32 summation order (the fresh part is back-propagated on its own before the replay chunk)
    assert np.allclose(zero, plain, rtol=1e-5, atol=1e-7)
    assert not np.allclose(one, plain, rtol=1e-3, atol=1e-4)


class ExgrpoRecordingTrainer(PromptRecordingTrainer):
    """Records each generation's expected pick per stored prompt (entropies from a plain forward of the model, not
    TRL's), and every shaped (injected-row) loss call."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.expected: list[dict] = []
        self.shaped: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            want = {}
            m = self.accelerator.unwrap_model(self.model)
            for key, cands in self.replay.pool.items():
                ents = []
                for r in cands:
                    ids = torch.cat([r.prompt_ids, r.completion_ids])[None]
                    with torch.no_grad():
                        logits = m(input_ids=ids).logits[0, r.prompt_ids.numel() - 1:-1].float() / self.temperature
                    ents.append(float(torch.distributions.Categorical(logits=logits).entropy().mean()))
                best = int(np.argmin(ents))
                want[key] = (cands[best].completion_ids.tolist(), cands[best].logprobs.clone(), best)
            self.expected.append(want)
        return super()._generate_and_score_completions(inputs)

    def _commit_step(self):  # ExGRPO keeps a per-prompt pool, not the buffer the parent hashes
        HDRGRPOTrainer._commit_step(self)

    def _shaped_loss(self, model, part):
        self.shaped.append({"global_step": self.state.global_step, **{k: v.detach().cpu() for k, v in part.items()
                                                                       if isinstance(v, torch.Tensor)}})
        return super()._shaped_loss(model, part)


def test_exgrpo_injects_the_lowest_entropy_stored_correct_trajectory_with_group_advantages(model_dir, tmp_path):
    from hdreplay.baselines.repo import key_of

    model, tok = tiny_model(model_dir)
    n = 4
    args = make_args(tmp_path, replay_selector="none", replay_exgrpo={"start_solved": 0.0, "ratio": 0.5},
                     gradient_accumulation_steps=1, per_device_train_batch_size=16, num_generations=n, max_steps=6,
                     seed=2, loss_type="dr_grpo", scale_rewards="none")
    tr = ExgrpoRecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(8),
                                processing_class=tok)
    tr.train()
    fresh_by_step: dict[int, dict[int, list[float]]] = {}  # step -> group -> rewards of its generated rows
    for rec in tr.records:
        for (p, c), h in zip(_texts(tok, rec), rec["hdr_row"].tolist()):
            fresh_by_step.setdefault(rec["global_step"], {}).setdefault(h // n, []).append(reward_digit([c])[0])
    injected, not_first = 0, 0
    for part in tr.shaped:
        step = part["global_step"]
        want = tr.expected[step]
        assert part["prompt_ids"].shape[0] <= 2  # at most int(B x ratio) = 2 experience prompts of B = 4
        for i in range(part["prompt_ids"].shape[0]):
            key = key_of(part["prompt_ids"][i][part["prompt_mask"][i].bool()])
            comp = part["completion_ids"][i][part["completion_mask"][i].bool()].tolist()
            ids, logps, best = want[key]  # the prompt was in the pool before this generation ...
            not_first += best > 0
            assert comp == ids  # ... and the injected trajectory is its lowest-entropy stored one
            assert reward_digit([tok.decode(comp, skip_special_tokens=True)])[0] == 1.0  # a correct trajectory
            assert torch.allclose(part["hdr_shaped_logps"][i, :len(comp)], logps.float())  # with its stored pi_gen
            others = fresh_by_step[step][int(part["hdr_row"][i]) // n]
            assert len(others) == n - 1  # the group's other rows were generated and trained on-policy
            group = torch.tensor([1.0, *others])
            assert float(part["advantages"][i]) == pytest.approx(float(1.0 - group.mean()), abs=1e-6)  # r - mean
            injected += 1
    assert injected >= 4 and not_first >= 1  # some picks were not simply the oldest stored trajectory
    logs = [x for x in tr.state.log_history if "exgrpo/started" in x]
    assert sum(x["replay/replayed_rows"] for x in logs) == injected
    assert all(x["replay/rescored_rows"] >= x["replay/replayed_rows"] for x in logs)


def test_exgrpo_settings_are_validated(model_dir, tmp_path):
    for bad, field in (({"ratio": 2}, "replay_exgrpo"), ({"bogus": 1}, "replay_exgrpo"), ("{", "replay_exgrpo")):
        with pytest.raises(ReplayConfigError) as e:
            make_args(tmp_path, replay_selector="none", replay_exgrpo=bad)
        assert e.value.field == field
    with pytest.raises(ReplayConfigError) as e:
        make_args(tmp_path, replay_selector="recency", replay_exgrpo={})
    assert e.value.field == "replay_exgrpo"
    with pytest.raises(ReplayConfigError):
        make_args(tmp_path, replay_selector="none", replay_exgrpo={}, replay_repo={})
    model, tok = tiny_model(model_dir)
    with pytest.raises(ValueError, match="loss_type='sapo'"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, train_dataset=prompts(8), processing_class=tok,
                       args=make_args(tmp_path, replay_selector="none", replay_exgrpo={}, loss_type="sapo"))


def _store_state(ctrl) -> dict:
    """A prompt-keyed controller's store as plain data (RePO's per-prompt FIFOs; ExGRPO's pool, buckets,
    retirements)."""
    store = ctrl.store.cache if hasattr(ctrl, "store") else ctrl.pool
    out = {k: [(r.completion_ids.tolist(), r.logprobs.tolist(), r.rewards.tolist()) for r in v]
           for k, v in store.items()}
    if hasattr(ctrl, "bucket"):
        out = {"pool": out, "bucket": dict(ctrl.bucket), "retired": sorted(ctrl.retired), "started": ctrl.started,
               "next_plan": copy.deepcopy(ctrl).plan(4)}  # on a copy: a probe must not advance the generator
    return out


class _StateAt(TrainerCallback):
    """Records the controller's store at the end of optimizer step ``step`` (after its commit)."""

    def __init__(self, trainer, step):
        self.trainer, self.step, self.state = trainer, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.state = _store_state(self.trainer.replay)


@pytest.mark.parametrize("strategy", ["exgrpo", "repo"])
def test_prompt_keyed_strategies_resume_their_store_from_a_trl_checkpoint(model_dir, tmp_path, strategy):
    """The store saved in checkpoint-3 by TRL's save path is the one a resumed trainer continues from (TRL's own
    resume is not bit-exact in these settings -- the grad norm of the first resumed step differs in the 3rd digit --
    so the two runs are not compared after it)."""
    if strategy == "exgrpo":
        over = dict(replay_exgrpo={"start_solved": 0.0}, loss_type="dr_grpo", scale_rewards="none",
                    per_device_train_batch_size=16)
    else:
        over = dict(replay_repo={"retrieval": "recent", "num_replays": 3, "min_cache": 4, "max_cache": 8},
                    loss_type="grpo", per_device_train_batch_size=8)
    over.update(replay_selector="none", gradient_accumulation_steps=1, num_generations=4, seed=2,
                save_strategy="steps", save_steps=3)

    def trainer(steps):
        model, tok = tiny_model(model_dir)
        return HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=make_args(tmp_path, max_steps=steps, **over),
                              train_dataset=prompts(6), processing_class=tok)

    full = trainer(6)
    at3 = _StateAt(full, 3)
    full.add_callback(at3)
    full.train()
    assert at3.state["pool" if strategy == "exgrpo" else next(iter(at3.state))]  # something was stored by step 3
    loaded = trainer(3)  # resumes at the last step: loads everything, trains nothing
    loaded.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert _store_state(loaded.replay) == at3.state
    resumed = trainer(6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    tail = [x["replay/replayed_rows"] for x in resumed.state.log_history
            if "replay/replayed_rows" in x and x["step"] > 3]
    assert len(tail) == 3 and sum(tail) > 0  # it went on replaying from the restored store
