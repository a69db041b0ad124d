"""BAPO (``replay_bapo``) through the real ``trainer.train()`` path: the trained batch is built as BAPO builds it --
fresh groups filtered to train_range, re-evaluated difficult prompts in the batch iff promoted, target groups
replayed with their stored pi_gen to fill b groups -- and every expectation is recomputed here from the rewards of
every generation round (independently of the controller's store)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import ReplayConfigError  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.peers.bapo import check_bapo  # noqa: E402
from trl_fixtures import RecordingTrainer, decoded_rows, make_args, prompts, reward_digit, tiny_model  # noqa: E402

B, N = 4, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def reward(completions, prompts, **kw):
    """Prompts whose length is a multiple of 3 are never solved (re-evaluation never promotes them); others: the
    digit reward (mixed, sometimes all wrong, sometimes 1 of 4: BAPO's target range at n = 4)."""
    return [0.0 if len(p) % 3 == 0 else reward_digit([c])[0] for c, p in zip(completions, prompts)]


class BapoTrainer(RecordingTrainer):
    """Records every generation round (fresh, then re-evaluation) with its prompts, completions and total rewards."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rounds: list[tuple[int, list, list, list]] = []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.rounds.append((self.state.global_step, list(prompts), list(completions), out.nansum(1).tolist()))
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.records[-1].update({k: inputs[k].cpu() for k in ("prompt_ids", "prompt_mask", "completion_mask")})
        return loss

    def _commit_step(self):  # BAPO keeps a uid store, not the buffer the parent hashes
        HDRGRPOTrainer._commit_step(self)


def _groups(prompts_, completions, rewards):
    """(prompt, sorted completions, mean reward, rewards) per group of N consecutive rows."""
    return [(prompts_[i], tuple(sorted(completions[i:i + N])), sum(rewards[i:i + N]) / N, rewards[i:i + N])
            for i in range(0, len(prompts_), N)]


def _trained(tok, rec):
    """(fresh groups, replay rows) of one loss call: fresh rows grouped by their generation index."""
    rows = decoded_rows(tok, rec)
    fresh: dict[int, list] = {}
    for (p, c), h in zip(rows, rec["hdr_row"].tolist()):
        if h >= 0:
            fresh.setdefault(h // N, []).append((p, c))
    groups = [(v[0][0], tuple(sorted(c for _, c in v))) for _, v in sorted(fresh.items())]
    return groups, [r for r, rep in zip(rows, rec["is_replay"].tolist()) if rep]


def _run(model_dir, out, steps=8, seed=3, **bapo):
    model, tok = tiny_model(model_dir)
    data = Dataset.from_dict({"prompt": list(dict.fromkeys(prompts()["prompt"]))})  # a prompt names one uid below
    args = make_args(out, replay_selector="none", replay_bapo={"seed": seed, **bapo}, gradient_accumulation_steps=1,
                     per_device_train_batch_size=B * N, num_generations=N, max_steps=steps, seed=seed,
                     loss_type="dapo", epsilon_high=0.28)
    tr = BapoTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    tr.train()
    return tr, tok


def test_bapo_builds_the_batch_from_filtered_fresh_promoted_and_target_groups(model_dir, tmp_path):
    # bad_thr 1/4: groups of 1 of 4 are difficult AND target, so re-evaluation moves stored groups with log-probs
    # out of (or keeps them in) the target range by their latest score
    tr, tok = _run(model_dir, tmp_path, max_reeval=3, bad_thr=0.25)
    logs = [x for x in tr.state.log_history if "bapo/reeval_prompts" in x]
    assert len(logs) == 8
    by_step: dict[int, list] = {}
    for r in tr.rounds:
        by_step.setdefault(r[0], []).append(r)
    alpha: dict[str, float] = {}  # prompt -> mean reward of its fresh group (one uid per prompt here)
    current: dict[str, list] = {}  # prompt -> its re-evaluation rewards
    records: list[tuple] = []  # stored groups with log-probs (trained at ingress), in birth order
    seen = {"promoted": 0, "replayed": 0, "reeval": 0, "full": 0, "left": 0}
    for t, log in enumerate(logs):
        rounds = by_step[t]
        fresh = _groups(*rounds[0][1:])
        assert len(fresh) == B
        kept = [g for g in fresh if 0.25 <= g[2] <= 0.75] or fresh  # train_range [1/8, 7/8]; else BAPO's fallback
        difficult = [p for p, m in alpha.items() if m <= 0.25]  # mean(alpha) <= bad_thr
        want_reeval = min(3, len(difficult)) if (t + 1) % 2 == 0 else 0  # BAPO's 1-based step numbers
        assert len(rounds) == 1 + (want_reeval > 0)
        assert log["bapo/reeval_prompts"] == want_reeval
        promoted = []
        if want_reeval:
            again = _groups(*rounds[1][1:])
            assert len(again) == want_reeval and {g[0] for g in again} <= set(difficult)
            promoted = [g for g in again if g[2] > alpha[g[0]]]  # mean(new) > mean(stored)
            for g in again:
                current[g[0]] = current.get(g[0], []) + list(g[3])
            seen["reeval"] += 1
        assert log["bapo/promoted"] == len(promoted)
        assert log["dynamic/generated_rows"] == (B + want_reeval) * N
        room = B - len(kept)
        budget = room - min(room, len(promoted))
        assert log["bapo/replay_budget"] == budget
        recs = [r for r in tr.records if r["global_step"] == t]
        trained = [g for r in recs for g in _trained(tok, r)[0]]
        replayed = [row for r in recs for row in _trained(tok, r)[1]]
        # the fresh part: the kept fresh groups, then promoted re-evaluated groups (all of them if they fit)
        assert trained[:len(kept)] == [g[:2] for g in kept]
        rest = trained[len(kept):]
        assert len(rest) == min(room, len(promoted)) and set(rest) <= {g[:2] for g in promoted}
        seen["promoted"] += len(rest)
        # replay: uniform among stored target groups, as many as the budget (and the store) allow
        sel = tr.selections[t]
        latest = {p: sum(current[p]) / len(current[p]) if current.get(p) else alpha[p] for p in alpha}
        targets = [k for k in records if 0.125 <= latest[k[0]] <= 0.25]
        seen["left"] += len(records) - len(targets)
        assert len(sel["groups"]) == min(budget, len(targets)) == log["replay/accepted"]
        assert len(replayed) == N * len(sel["groups"])
        for j in range(len(sel["groups"])):
            rows = replayed[j * N:(j + 1) * N]
            key = (rows[0][0], tuple(sorted(c for _, c in rows)))
            assert key in targets  # a stored kept group of an earlier step whose latest score is 1 of 4
        replay_recs = [r for r in recs if r["is_replay"].any()]
        if replay_recs:  # the replayed rows carry their stored pi_gen as old log-probs
            old = torch.cat([r["old"][r["is_replay"]] for r in replay_recs])
            mask = torch.cat([r["mask"][r["is_replay"]] for r in replay_recs]).bool()
            stored = torch.cat([torch.nn.functional.pad(lp, (0, 0)) for lp in sel["stored_logps"]])
            assert torch.allclose(old[mask], stored[torch.cat(sel["stored_mask"])], atol=1e-6)
        seen["replayed"] += len(sel["groups"])
        n_groups = len(trained) + len(sel["groups"])
        assert n_groups == B or (budget > len(targets) and n_groups == B - budget + len(targets))
        seen["full"] += n_groups == B
        # ingress after the update: unfiltered fresh groups with mean in [0, 1/8] or [1/8, 2/8]
        for p, comps, m, _ in fresh:
            if m <= 0.25:  # [0, bad_thr] or the target range
                alpha[p] = m
                if (p, comps) in [g[:2] for g in kept]:
                    records.append((p, comps))
        assert log["replay/buffer_size"] == len(alpha)
    assert seen["reeval"] >= 2 and seen["promoted"] >= 1 and seen["replayed"] >= 3 and seen["full"] >= 4
    assert seen["left"] >= 1  # some stored group with log-probs was not a target when selected


def test_bapo_eviction_caps_hold_during_training(model_dir, tmp_path):
    tr, _ = _run(model_dir, tmp_path, steps=8, max_uids=6, max_target=2, max_reeval=2)
    logs = [x for x in tr.state.log_history if "bapo/reeval_prompts" in x]
    assert max(x["replay/buffer_size"] for x in logs) == 6 and sum(x["bapo/evicted"] for x in logs) > 0
    for x in logs:
        assert x["replay/buffer_size"] <= 6 and x["bapo/reeval_prompts"] <= 2
        if x["bapo/evicted"]:
            assert x["bapo/target_uids"] <= 2
    store = tr.replay.store
    assert len(store) <= 6 and all(e.record is None or e.record.num_responses == N for e in store.values())


def test_bapo_settings_are_validated(tmp_path):
    for bad, field in (({"bad_thr": 2}, "replay_bapo"), ({"target_range": [0.5, 0.25]}, "replay_bapo"),
                       ({"reeval": 2}, "replay_bapo"), ({"max_target": 200}, "replay_bapo"), ("{x", "replay_bapo")):
        with pytest.raises(ReplayConfigError) as e:
            make_args(tmp_path, replay_selector="none", replay_bapo=bad)
        assert e.value.field == field
    with pytest.raises(ReplayConfigError) as e:
        make_args(tmp_path, replay_bapo={"max_reeval": 4})  # a selector as well
    assert e.value.field == "replay_bapo" and "replay_selector='none'" in e.value.message
    with pytest.raises(ReplayConfigError) as e:
        make_args(tmp_path, replay_selector="none", replay_bapo={}, replay_dynamic_sampling=True)
    assert e.value.field == "replay_bapo"
    args = make_args(tmp_path, replay_selector="none", replay_bapo={}, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="one process"):
        check_bapo(args, processes=2, vlm=False)
    with pytest.raises(ValueError, match="text only"):
        check_bapo(args, processes=1, vlm=True)
    check_bapo(args, processes=1, vlm=False)
    with pytest.raises(ValueError, match="steps_per_generation"):
        check_bapo(make_args(tmp_path, replay_selector="none", replay_bapo={}, gradient_accumulation_steps=2,
                             steps_per_generation=1), processes=1, vlm=False)


def test_bapo_state_round_trips_through_a_trainer_checkpoint_and_resumes(model_dir, tmp_path):
    from hdreplay.baselines.bapo import BapoController, BapoOptions
    from hdreplay.integrations.common import STATE_DIR

    model, tok = tiny_model(model_dir)
    data = Dataset.from_dict({"prompt": list(dict.fromkeys(prompts()["prompt"]))})
    kw = dict(replay_selector="none", replay_bapo={"seed": 3, "max_reeval": 3}, gradient_accumulation_steps=1,
              per_device_train_batch_size=B * N, num_generations=N, seed=3, loss_type="dapo", save_strategy="steps",
              save_steps=2)
    tr = BapoTrainer(model=model, reward_funcs=reward, args=make_args(tmp_path, max_steps=4, **kw),
                     train_dataset=data, processing_class=tok)
    tr.train()
    back = BapoController(BapoOptions(max_reeval=3))  # another seed: the state carries the generator
    back.load(tmp_path / "checkpoint-4" / STATE_DIR)
    assert back.last_step == 3 and list(back.store) == list(tr.replay.store) and len(back.store) > 0
    for (u, a), b in zip(tr.replay.store.items(), back.store.values()):
        assert (a.alpha, a.current, a.last_step, a.row) == (b.alpha, b.current, b.last_step, b.row), u
        assert (a.record is None) == (b.record is None)
        if a.record is not None:
            assert torch.equal(a.record.logprobs, b.record.logprobs)
            assert torch.equal(a.record.completion_ids, b.record.completion_ids)
    # the generator continues where it stopped: the same draws as the live controller
    assert back.reeval_candidates(5) == tr.replay.reeval_candidates(5)
    model, tok = tiny_model(model_dir)
    again = BapoTrainer(model=model, reward_funcs=reward, args=make_args(tmp_path, max_steps=6, **kw),
                        train_dataset=data, processing_class=tok)
    again.train(resume_from_checkpoint=True)
    logs = [x for x in again.state.log_history if "bapo/reeval_prompts" in x and x["step"] > 4]  # after the resume
    assert len(logs) == 2 and logs[0]["bapo/reeval_prompts"] == 0 and logs[1]["bapo/reeval_prompts"] > 0  # steps 4, 5
    assert [r[0] for r in again.rounds] == [4, 5, 5]  # fresh at step 4, fresh + re-evaluation at step 5
