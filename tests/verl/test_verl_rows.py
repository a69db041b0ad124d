"""Round trips between verl DataProto batches and hdreplay groups (no Ray, real verl objects)."""

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl import DataProto  # noqa: E402

from hdreplay.integrations.verl.actor_batch import build_actor_batch  # noqa: E402
from hdreplay.integrations.verl.dataproto import (  # noqa: E402
    REPLAY_FLAG,
    groups_from_batch,
    replay_rows,
    scoring_batch,
)
from verl_helpers import P_WIDTH, R_WIDTH, fresh_batch  # noqa: E402

N = 4


def _rows_by_uid(batch: DataProto) -> dict:
    out = {}
    for i, u in enumerate(batch.non_tensor_batch["uid"].tolist()):
        out.setdefault(u, []).append(i)
    return out


@pytest.fixture(scope="module")
def batch():
    return fresh_batch((1, 2, 3, 4, 5, 6), N, seed=3, ref=True)


def test_groups_store_unpadded_tokens_masks_logprobs_advantages(batch):
    groups, problems, num_uids = groups_from_batch(batch, step=7, group_size=N, estimator="grpo")
    assert problems == [] and num_uids == 6 and len(groups) == 6
    t = batch.batch
    rows_of = _rows_by_uid(batch)
    saw_tool_tokens = False
    for g in groups:
        step, uid = g.group_id.split(":", 1)
        assert step == "7" and g.birth_step == 7
        rows = rows_of[uid]
        for j, r in enumerate(rows):
            pm = t["attention_mask"][r, :P_WIDTH].bool()
            assert torch.equal(g.prompt_ids.long(), t["prompts"][r][pm])
            L = int(t["attention_mask"][r, P_WIDTH:].sum())
            assert int(g.response_lengths[j]) == L
            assert torch.equal(g.responses()[j].long(), t["responses"][r, :L])
            lm = g.split(g.loss_mask)[j]
            assert torch.equal(lm, t["response_mask"][r, :L].bool())  # tool tokens excluded from T(g)
            saw_tool_tokens |= bool((~lm).any())
            lp = g.split(g.logprobs)[j]
            assert torch.allclose(lp[lm], t["old_log_probs"][r, :L][lm])
            assert float(lp[~lm].abs().sum()) == 0.0
            ref = g.split(g.extras["ref_logprobs"])[j]
            assert torch.allclose(ref[lm], t["ref_log_prob"][r, :L][lm])
            assert float(g.rewards[j]) == pytest.approx(float(t["token_level_scores"][r].sum()))
            adv_tok = t["advantages"][r, :L][lm]
            assert torch.allclose(adv_tok, torch.full_like(adv_tok, float(g.advantages[j])))
    assert saw_tool_tokens


def test_replay_rows_rebuild_every_key_of_the_original_rows(batch):
    groups, _, _ = groups_from_batch(batch, step=1, group_size=N)
    rep_t, rep_nt = replay_rows(groups, like=batch, P=P_WIDTH, R=R_WIDTH, pad_token_id=0)
    assert set(rep_t) == set(batch.batch.keys())
    assert set(rep_nt) == set(batch.non_tensor_batch) | {REPLAY_FLAG}
    rows_of = _rows_by_uid(batch)
    orig = [r for g in groups for r in rows_of[g.group_id.split(":", 1)[1]]]  # same group / response order
    t = batch.batch
    attn = t["attention_mask"][orig].bool()
    resp = t["response_mask"][orig].bool()
    for k, v in rep_t.items():
        assert v.dtype == t[k].dtype and v.shape == t[k][orig].shape, k
    for k in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(rep_t[k][attn], t[k][orig][attn]), k
    for k in ("prompts", "responses", "response_mask"):
        assert torch.equal(rep_t[k], t[k][orig]), k
    for k in ("old_log_probs", "ref_log_prob", "advantages", "returns"):
        assert torch.allclose(rep_t[k][resp], t[k][orig][resp]), k
    for k in ("token_level_scores", "token_level_rewards", "rm_scores"):
        assert torch.allclose(rep_t[k], t[k][orig]), k  # outcome reward on the last response token
    assert float(rep_t["dummy_tensor"].abs().sum()) == 0
    assert rep_nt["uid"].tolist() == [g.group_id for g in groups for _ in range(N)]
    assert rep_nt[REPLAY_FLAG].all() and all(x == {} for x in rep_nt["multi_modal_inputs"])


def test_actor_batch_keeps_fresh_rows_and_prepends_replay(batch):
    groups, _, _ = groups_from_batch(batch, step=1, group_size=N)
    actor, info = build_actor_batch(groups[:2], batch, minibatch_rows=2 * N, dp=2, pad_token_id=0)
    assert len(actor) == len(batch) + 2 * N and info["num_replay_rows"] == 2 * N
    assert set(actor.batch.keys()) == set(batch.batch.keys())
    flag = actor.non_tensor_batch[REPLAY_FLAG]
    fresh_rows = actor.batch[torch.from_numpy(~flag)]
    # the fresh rows are the original rows, permuted
    key = lambda td: sorted(map(tuple, torch.cat([td["input_ids"], td["old_log_probs"]], 1).tolist()))  # noqa: E731
    assert key(fresh_rows) == key(batch.batch)
    assert actor.meta_info["global_token_num"] == actor.batch["attention_mask"].sum(-1).tolist()
    assert actor.meta_info["temperature"] == batch.meta_info["temperature"]


def test_wider_replay_rows_re_pad_the_fresh_batch(batch):
    groups, _, _ = groups_from_batch(batch, step=1, group_size=N)
    narrow = fresh_batch((1, 2), N, seed=5, ref=True)
    narrow = DataProto.from_dict(  # crop to a narrower response width than the stored groups need
        tensors={k: (v[:, : P_WIDTH + 3] if v.shape[-1] == P_WIDTH + R_WIDTH else
                     v if k in ("prompts", "dummy_tensor") else v[:, :3]) for k, v in narrow.batch.items()},
        non_tensors=dict(narrow.non_tensor_batch), meta_info=dict(narrow.meta_info))
    narrow.batch["responses"] = narrow.batch["input_ids"][:, P_WIDTH:]
    narrow.batch["attention_mask"][:, P_WIDTH:] = 1
    narrow.batch["response_mask"][:] = 1
    actor, _ = build_actor_batch(groups[:1], narrow, minibatch_rows=N, dp=2, pad_token_id=0)
    need = max(int(g.response_lengths.max()) for g in groups[:1])
    assert actor.batch["responses"].shape[1] == max(3, need)
    fresh = actor.batch[torch.from_numpy(~actor.non_tensor_batch[REPLAY_FLAG])]
    assert float(fresh["attention_mask"][:, P_WIDTH + 3:].sum()) == 0  # fresh rows padded on the right
    assert int(fresh["attention_mask"].sum()) == int(narrow.batch["attention_mask"].sum())


def test_scoring_batch_aligns_values_with_each_groups_tokens(batch):
    groups, _, _ = groups_from_batch(batch, step=1, group_size=N)
    data, pg = scoring_batch(groups, pad_token_id=0, meta_info={"temperature": 0.7})
    assert set(data.batch.keys()) == {"prompts", "responses", "input_ids", "attention_mask", "position_ids",
                                      "response_mask"}
    assert data.meta_info["temperature"] == 0.7
    flat = pg.split_by_group(data.batch["responses"].float())
    for g, v in zip(groups, flat):
        assert torch.equal(v.long(), g.completion_ids.long())


def test_groups_that_cannot_be_stored_are_skipped_with_a_reason():
    b = fresh_batch((1, 2, 3, 5), N, seed=1, shuffle=False)
    b.batch["response_mask"][N] = 0  # first response of the second prompt: no generated token (e.g. truncated)
    b.batch["response_mask"][3 * N:] = 0  # the fourth prompt: no generated token in any response
    keep = np.arange(len(b)) != 2 * N  # drop one row of the third prompt
    b = b.select_idxs(keep)
    groups, problems, num_uids = groups_from_batch(b, step=0, group_size=N)
    assert num_uids == 4 and [g.group_id.split(":")[1][-1] for g in groups] == ["1", "2"] and len(problems) == 2
    assert any("loss mask is all zero" in p for p in problems) and any("3 rows" in p for p in problems)
    masked = groups[1].split(groups[1].loss_mask)  # a masked-out response stays in its group (its outcome counts)
    assert not masked[0].any() and all(m.any() for m in masked[1:]) and groups[1].num_responses == N


@pytest.mark.parametrize("case,match", [
    ("unknown_key", "values"),
    ("varying_advantage", "adv_estimator=rloo"),
    ("positions", "position_ids"),
    ("no_uid", "uid"),
])
def test_unsupported_batches_fail_loudly(case, match):
    b = fresh_batch((1, 2), N, seed=2)
    if case == "unknown_key":
        b.batch["values"] = torch.zeros_like(b.batch["old_log_probs"])
    elif case == "varying_advantage":
        b.batch["advantages"][0, 0] += 1.0
    elif case == "positions":
        b.batch["position_ids"] = b.batch["position_ids"] + 1
    else:
        b.non_tensor_batch.pop("uid")
    with pytest.raises(RuntimeError, match=match):
        groups_from_batch(b, step=0, group_size=N, estimator="rloo")


@pytest.mark.multimodal
def test_a_group_whose_rows_disagree_on_their_images_is_skipped():
    """Vision-language rows are stored (tests/verl/test_verl_multimodal.py); a uid whose rows carry different
    multi_modal_inputs is skipped with a reason, the other groups are stored."""
    b = fresh_batch((1, 2), N, seed=2)
    r = 0
    b.non_tensor_batch["multi_modal_inputs"][r] = {"pixel_values": torch.zeros(1)}
    groups, problems, num_uids = groups_from_batch(b, step=0, group_size=N)
    assert num_uids == 2 and len(groups) == 1 and len(problems) == 1
    assert b.non_tensor_batch["uid"][r] in problems[0] and "not their multi_modal_inputs" in problems[0]


def test_reference_logprobs_must_be_stored_when_the_batch_has_them():
    plain = fresh_batch((1, 2), N, seed=2, ref=False)
    with_ref = fresh_batch((1, 2), N, seed=2, ref=True)
    groups, _, _ = groups_from_batch(plain, step=0, group_size=N)
    with pytest.raises(RuntimeError, match="ref_log_prob"):
        replay_rows(groups, like=with_ref, P=P_WIDTH, R=R_WIDTH, pad_token_id=0)
