"""v1 TransferQueue rows <-> groups (no Ray): fresh rows shaped as verl's v1 agent loop + trainer leave them
at ``_update_actor`` (jagged nested fields from ``list_of_dict_to_tensordict``, the structure
``tq.kv_batch_get`` returns), GRPO advantages from verl's own ``compute_grpo_outcome_advantage``."""

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("verl", minversion="0.9.1")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402
from verl.workers.utils.padding import response_to_nested  # noqa: E402

from hdreplay.integrations.verl.v1_rows import fresh_groups, padding_rows, replay_rows, update_fields  # noqa: E402
from verl_v1_harness import stub_trajectory  # noqa: E402

N = 4


def fresh_rows(prompts=(1, 2, 3, 5), *, step=3, ref=True, extra=None, drop=None):
    """(rows, tags): the per-row dicts of a fresh v1 batch after advantages, plus one verl padding row."""
    rows, uids = [], []
    for p in prompts:
        for j in range(N):
            if drop == (p, j):
                continue
            r = stub_trajectory(p, j, step=step, flat=lambda q: q % 4 == 0)
            g = torch.Generator().manual_seed(7 * p + j)
            r.update(uid=f"u{p}", session_id=j, raw_prompt=[{"role": "user", "content": f"q{p}"}],
                     old_log_probs=-torch.rand(r["responses"].numel(), generator=g) * 3,
                     entropy=torch.rand(r["input_ids"].numel()))
            if ref:
                r["ref_log_prob"] = -torch.rand(r["responses"].numel(), generator=g) * 3
            r.update(extra or {})
            rows.append(r)
            uids.append(f"u{p}")
    td = list_of_dict_to_tensordict(rows)
    scores, mask = td["rm_scores"].to_padded_tensor(0.0), td["response_mask"].to_padded_tensor(0)
    adv, _ = compute_grpo_outcome_advantage(scores, mask, index=uids)
    nested = response_to_nested(adv, td["response_mask"])
    for r, a in zip(rows, nested.unbind(0)):
        r["advantages"] = a
    pad = dict(rows[0], uid="pad0", response_mask=torch.zeros(1, dtype=torch.long), responses=torch.tensor([1]))
    tags = [{"seq_len": r["input_ids"].numel()} for r in rows] + [{"is_padding": True, "seq_len": 128}]
    return rows + [pad], tags


def _td(rows):
    return list_of_dict_to_tensordict(rows)


def test_fresh_rows_become_one_group_per_uid_with_their_stored_state():
    rows, tags = fresh_rows()
    fg = fresh_groups(_td(rows), tags, step=3, group_size=N, estimator="grpo")
    assert fg.num_uids == 4 and not fg.problems and fg.rows == list(range(16))  # the padding row is skipped
    assert [g.group_id for g in fg.groups] == ["3:u1", "3:u2", "3:u3", "3:u5"]
    for gi, g in enumerate(fg.groups):
        src = rows[gi * N:(gi + 1) * N]
        assert g.birth_step == 3 and torch.equal(g.prompt_ids.long(), src[0]["prompts"])
        for j, (resp, lm, lp, ref) in enumerate(zip(g.responses(), g.split(g.loss_mask), g.split(g.logprobs),
                                                    g.split(g.extras["ref_logprobs"]))):
            m = src[j]["response_mask"].bool()
            assert torch.equal(resp.long(), src[j]["responses"]) and torch.equal(lm, m)
            assert torch.equal(lp[m], src[j]["old_log_probs"][m]) and torch.equal(ref[m], src[j]["ref_log_prob"][m])
            assert float(g.advantages[j]) == pytest.approx(float(src[j]["advantages"][m][0]))
            assert float(g.rewards[j]) == float(src[j]["rm_scores"].sum())
    assert (~fg.groups[0].loss_mask).any()  # tool tokens (response_mask 0) are kept out of T(g)
    assert fg.fields == ["prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                         "loss_mask", "old_log_probs", "advantages", "ref_log_prob", "uid"]


def test_replay_rows_rebuild_every_update_field_of_the_original_rows():
    rows, tags = fresh_rows()
    fg = fresh_groups(_td(rows), tags, step=3, group_size=N)
    rep, rep_tags = replay_rows(fg.groups, fields=fg.fields, dtypes=fg.dtypes)
    assert len(rep) == 16 and all(t["hdr_replay"] and t["birth_step"] == 3 for t in rep_tags)
    for orig, new, tag in zip(rows, rep, rep_tags):
        m = orig["response_mask"]
        assert list(new) == fg.fields and new["uid"] == f"3:{orig['uid']}"
        for k in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "loss_mask"):
            assert torch.equal(new[k], orig[k]) and new[k].dtype == orig[k].dtype, k
        for k in ("old_log_probs", "ref_log_prob", "advantages"):  # equal where the loss reads them
            assert torch.allclose(new[k] * m, orig[k] * m, atol=1e-6) and new[k].dtype == orig[k].dtype, k
        assert tag["seq_len"] == orig["input_ids"].numel()


def test_text_rows_with_verls_empty_multi_modal_inputs_replay_as_text():
    """verl's v1 agent loop writes ``multi_modal_inputs = {}`` on text rows: it is an update field, the groups are
    text groups, and replay and padding rows carry ``{}`` (the workers fetch one field list for all rows)."""
    rows, tags = fresh_rows(extra={"multi_modal_inputs": {}})
    fg = fresh_groups(_td(rows[:-1]), tags[:-1], step=3, group_size=N)
    assert "multi_modal_inputs" in fg.fields and fg.position_rows is None and not fg.problems
    assert all(g.mm_inputs == {} for g in fg.groups)
    rep, _ = replay_rows(fg.groups, fields=fg.fields, dtypes=fg.dtypes)
    pad, _ = padding_rows(2, fields=fg.fields, dtypes=fg.dtypes, token_id=1, uid="p")
    assert all(r["multi_modal_inputs"] == {} and r["position_ids"].dim() == 1 for r in rep + pad)
    td = _td(rep + pad)
    assert list(td["multi_modal_inputs"]) == [{}] * len(rep + pad)


def test_a_uid_with_missing_rows_is_reported_and_skipped():
    rows, tags = fresh_rows(drop=(2, 1))
    fg = fresh_groups(_td(rows), tags, step=1, group_size=N)
    assert [g.group_id for g in fg.groups] == ["1:u1", "1:u3", "1:u5"] and fg.num_uids == 4
    assert len(fg.problems) == 1 and "'u2': 3 rows" in fg.problems[0]


@pytest.mark.parametrize("extra,match", [
    ({"routed_experts": torch.zeros(3)}, r"routed_experts: MoE router replay"),
    ({"my_tensor": torch.zeros(2)}, r"my_tensor: unknown to hdreplay"),
])  # carried, not refused: multi_modal_inputs (tests/verl/test_verl_v1_multimodal.py), rollout_is_weights
#   (the birth weights of verl's decoupled rollout correction, tests/verl/test_verl_rollout_is.py)
def test_fields_replay_rows_cannot_carry_refuse_the_batch(extra, match):
    rows, tags = fresh_rows(extra=extra)
    with pytest.raises(RuntimeError, match=match):
        fresh_groups(_td(rows[:-1]), tags[:-1], step=1, group_size=N)


def test_non_text_position_ids_and_missing_fields_are_refused():
    rows, tags = fresh_rows()
    bad = [dict(r, position_ids=r["position_ids"] + 1) for r in rows[:-1]]
    with pytest.raises(RuntimeError, match="arange"):
        fresh_groups(_td(bad), tags[:-1], step=1, group_size=N)
    deep = [dict(r, position_ids=r["position_ids"].expand(2, 3, -1).contiguous()) for r in rows[:-1]]
    with pytest.raises(RuntimeError, match=r"position_ids with 3 dims per row"):
        fresh_groups(_td(deep), tags[:-1], step=1, group_size=N)
    gone = [{k: v for k, v in r.items() if k != "old_log_probs"} for r in rows[:-1]]
    with pytest.raises(RuntimeError, match="old_log_probs"):
        update_fields(_td(gone))


def test_advantages_varying_inside_a_response_are_refused():
    rows, tags = fresh_rows()
    rows[0]["advantages"] = torch.arange(rows[0]["responses"].numel(), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="gae"):
        fresh_groups(_td(rows), tags, step=1, group_size=N, estimator="gae")


def test_ref_log_prob_in_the_batch_needs_stored_reference_log_probs():
    rows, tags = fresh_rows(ref=False)
    fg = fresh_groups(_td(rows), tags, step=1, group_size=N)
    with pytest.raises(RuntimeError, match="ref_logprobs"):
        replay_rows(fg.groups, fields=[*fg.fields, "ref_log_prob"], dtypes=fg.dtypes)


def test_padding_rows_add_no_loss_tokens_and_carry_exactly_the_update_fields():
    rows, tags = fresh_rows()
    fg = fresh_groups(_td(rows), tags, step=1, group_size=N)
    pad, pad_tags = padding_rows(3, fields=fg.fields, dtypes=fg.dtypes, token_id=1, uid="hdrpad1")
    assert len(pad) == 3 and all(t["is_padding"] and t["seq_len"] == 2 for t in pad_tags)
    for p in pad:
        assert list(p) == fg.fields and p["uid"] == "hdrpad1"
        assert int(p["response_mask"].sum()) == 0 and int(p["loss_mask"].sum()) == 0
        assert p["prompts"].numel() == 1 and p["input_ids"].tolist() == [1, 1]
        assert p["old_log_probs"].dtype == rows[0]["old_log_probs"].dtype
    td = _td([*({k: r[k] for k in fg.fields} for r in rows[:-1]), *pad])  # stacks with replay-shaped rows
    assert td["loss_mask"].values().sum() == sum(int(r["loss_mask"].sum()) for r in rows[:-1])
