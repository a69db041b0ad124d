"""POPO (``replay_popo``) through the real ``trainer.train()`` path: every expectation is recomputed here from the
rewards of each generation and the rows each loss call trained on -- which fresh groups were swapped out, which
stored groups replaced them (the newest effective ones), their proximal log-probs (the policy before the update)
and their per-token advantages A x min(pi_prox / pi_behav, is_cap) -- and the store survives a TRL checkpoint."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import ReplayConfigError  # noqa: E402
from hdreplay.baselines import PopoController, PopoOptions  # noqa: E402
from hdreplay.integrations.common import STATE_DIR  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.peers.popo import check_popo  # noqa: E402
from trl_fixtures import RecordingTrainer, decoded_rows, make_args, prompts, reward_digit, tiny_model  # noqa: E402

B, N, CAP = 4, 4, 1.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def reward(completions, prompts, **kw):
    """Prompts whose length is a multiple of 3 are never solved (zero-variance groups every time); the others: the
    digit reward (mixed, sometimes all equal)."""
    return [0.0 if len(p) % 3 == 0 else reward_digit([c])[0] for c, p in zip(completions, prompts)]


class PopoTrainer(RecordingTrainer):
    """Records each generation's prompts, completions and rewards, the store before each selection and after each
    commit, and the prompt rows of every loss call."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rounds: list[tuple[int, list, list, list]] = []
        self.before: list[dict] = []
        self.after: list[list] = []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.rounds.append((self.state.global_step, list(prompts), list(completions), out.nansum(1).tolist()))
        return out

    def _select(self, step):
        self.before.append({g.group_id: g.clone() for g in self.replay.store})
        super()._select(step)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.records[-1].update({k: inputs[k].cpu() for k in ("prompt_ids", "prompt_mask", "completion_mask")})
        return loss

    def _commit_step(self):  # POPO keeps a FIFO of its own, not the buffer the parent hashes
        HDRGRPOTrainer._commit_step(self)
        self.after.append([g.group_id for g in self.replay.store])


def _groups(prompts_, completions, rewards):
    return [((prompts_[i], tuple(sorted(completions[i:i + N]))), rewards[i:i + N]) for i in range(0, len(prompts_), N)]


def test_popo_swaps_zero_variance_groups_for_the_newest_effective_ones_with_decoupled_weights(model_dir, tmp_path):
    model, tok = tiny_model(model_dir)
    data = Dataset.from_dict({"prompt": list(dict.fromkeys(prompts()["prompt"]))})
    args = make_args(tmp_path, replay_selector="none", replay_popo={"is_cap": CAP}, gradient_accumulation_steps=1,
                     per_device_train_batch_size=B * N, num_generations=N, max_steps=6, seed=3, loss_type="dapo",
                     save_strategy="steps", save_steps=3)
    tr = PopoTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    tr.train()
    logs = [x for x in tr.state.log_history if "popo/ineffective" in x]
    assert len(logs) == 6 and len(tr.rounds) == 6  # one generation per step: POPO generates nothing extra
    stored: list[tuple] = []  # (key, group id) of every effective fresh group trained so far, oldest first
    seen = {"swapped": 0, "capped": 0, "short": 0}
    for t, log in enumerate(logs):
        fresh = _groups(*tr.rounds[t][1:])
        ineffective = [key for key, r in fresh if max(r) == min(r)]
        k = min(len(ineffective), len(stored), B - 1)
        seen["short"] += k < len(ineffective)
        assert log["popo/ineffective"] == len(ineffective) and log["replay/accepted"] == k
        recs = [r for r in tr.records if r["global_step"] == t]
        rows = [(row, rec, i) for rec in recs for i, row in enumerate(decoded_rows(tok, rec))]
        by_group: dict[int, list] = {}  # fresh rows (TRL shuffles them) by their group in the trained batch
        for row, rec, i in rows:
            if rec["hdr_row"][i] >= 0:
                by_group.setdefault(int(rec["hdr_row"][i]) // N, []).append(row)
        replayed = [(row, rec, i) for row, rec, i in rows if rec["hdr_row"][i] < 0]
        # the fresh part: the batch without its first k zero-variance groups, in order
        kept = [key for key, _ in fresh if key not in ineffective[:k]]
        assert [(v[0][0], tuple(sorted(c for _, c in v))) for _, v in sorted(by_group.items())] == kept
        # the replay: the k newest stored groups, newest first, each one's rows in order
        want = stored[::-1][:k]
        sel = tr.selections[t]
        assert sel["groups"] == [gid for _, gid in want] and len(replayed) == k * N
        for j, (key, gid) in enumerate(want):
            group_rows = replayed[j * N:(j + 1) * N]
            assert (group_rows[0][0][0], tuple(sorted(c for (_, c), _, _ in group_rows))) == key
            orig = tr.before[t][gid]  # the stored group: pi_behav and its advantages
            behav = [lp[m] for lp, m in zip(orig.split(orig.logprobs), orig.split(orig.loss_mask))]
            adv = orig.advantages
            for r, (_, rec, i) in enumerate(group_rows):
                mask = rec["mask"][i].bool()
                prox = rec["now"][i][mask]  # the policy before this update (no optimizer step since selection)
                assert torch.allclose(rec["old"][i][mask], prox, atol=1e-5)  # the ratio denominator is pi_prox
                w = torch.exp(prox - behav[r]).clamp(max=CAP)
                assert torch.allclose(rec["advantages"][i][mask], adv[r] * w, atol=1e-5, rtol=1e-4)
                seen["capped"] += int((w == CAP).sum())
        seen["swapped"] += k
        # dapo normalises by the tokens of the trained batch: kept fresh rows + replayed rows
        assert all(rec["nib"] == int(sum(r["mask"].sum() for r in recs)) for rec in recs)
        # after the update the step's effective fresh groups enter the store, in batch order
        ids = [f"s{t}.0g{j}" for j in range(len(kept))]
        stored += [(key, gid) for key, gid in zip(kept, ids) if key not in ineffective]
        assert tr.after[t] == [gid for _, gid in stored]
    assert seen["swapped"] >= 3 and seen["short"] >= 1 and seen["capped"] >= 1
    # the store of step 2 went into checkpoint-3 through the validating store path
    back = PopoController(PopoOptions(is_cap=CAP))
    back.load(tmp_path / "checkpoint-3" / STATE_DIR)
    assert back.last_step == 2 and [g.group_id for g in back.store] == tr.after[2]


def test_popo_settings_are_validated(tmp_path):
    for bad in ({"capacity": 0}, {"is_cap": -1}, {"cap": 2}, "{x"):
        with pytest.raises(ReplayConfigError) as e:
            make_args(tmp_path, replay_selector="none", replay_popo=bad)
        assert e.value.field == "replay_popo"
    with pytest.raises(ReplayConfigError, match="replay_selector='none'"):
        make_args(tmp_path, replay_popo={})  # a selector as well
    with pytest.raises(ReplayConfigError, match="choose one"):
        make_args(tmp_path, replay_selector="none", replay_popo={}, replay_bapo={})
    args = make_args(tmp_path, replay_selector="none", replay_popo={}, gradient_accumulation_steps=1)
    check_popo(args, processes=1, vlm=False, loss_type="grpo")
    for kw, what in ((dict(processes=2), "processes"), (dict(vlm=True), "vision"), (dict(loss_type="vespo"), "vespo")):
        with pytest.raises(ValueError, match=what):
            check_popo(args, **{**dict(processes=1, vlm=False, loss_type="grpo"), **kw})
    with pytest.raises(ValueError, match="chunk"):
        check_popo(make_args(tmp_path, replay_selector="none", replay_popo={}, gradient_accumulation_steps=1,
                             replay_micro_step="grow"), processes=1, vlm=False, loss_type="grpo")
    with pytest.raises(ValueError, match="steps_per_generation"):
        check_popo(make_args(tmp_path, replay_selector="none", replay_popo={}, gradient_accumulation_steps=2,
                             steps_per_generation=4), processes=1, vlm=False, loss_type="grpo")
