"""verl vision-language rows through hdreplay (v0 recipe pieces, real verl objects, no Ray): a tiny Qwen2-VL,
verl-shaped rows with multi_modal_inputs and 4-row mrope position ids; groups store the images once; replay and
scoring rows carry them back through verl's own no-padding path with Drift exactly 0 at unchanged weights."""

import dataclasses

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.multimodal]
pytest.importorskip("verl", minversion="0.9.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.utils.model import extract_multi_modal_inputs  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from hdreplay import ReplayConfig, ReplayController  # noqa: E402
from hdreplay.integrations.common import split_by_schema  # noqa: E402
from hdreplay.integrations.verl.actor_batch import build_actor_batch  # noqa: E402
from hdreplay.integrations.verl.dataproto import REPLAY_FLAG, groups_from_batch, scoring_batch  # noqa: E402
from hdreplay.integrations.verl.mm import POSITIONS  # noqa: E402
from verl_helpers import compose_config  # noqa: E402
from verl_vlm import TASK, vlm_batch, vlm_logprobs, vlm_rows  # noqa: E402

N = 4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from hdreplay_lab.sandbox.vlm import build_tiny_vlm, load_vlm

    model, proc = load_vlm(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), chars=TASK.vocab, hidden=32))
    model.eval()
    with torch.no_grad():  # larger weights: log-probs far from uniform, so a wrong position or image shows
        for p in model.parameters():
            p.mul_(3.0)
    return model, proc


@pytest.fixture(scope="module")
def config():
    return compose_config()


@pytest.fixture(scope="module")
def batch(vlm, config):
    model, proc = vlm
    return vlm_batch(model, proc, TASK.train_problems(3, seed=1), N, seed=0, config=config)


def test_groups_store_the_images_once_and_the_prompt_positions(batch):
    groups, problems, num_uids = groups_from_batch(batch, step=0, group_size=N, estimator="grpo")
    assert problems == [] and num_uids == 3 == len(groups)
    mm_rows = batch.non_tensor_batch["multi_modal_inputs"]
    for k, g in enumerate(groups):
        row = k * N
        assert set(g.mm_inputs) == {"pixel_values", "image_grid_thw", "images_seqlens", POSITIONS}
        for key, v in mm_rows[row].items():
            assert g.mm_inputs[key].dtype == v.dtype and torch.equal(g.mm_inputs[key], v)
        pm = batch.batch["attention_mask"][row, : batch.batch["prompts"].shape[1]].bool()
        assert torch.equal(g.mm_inputs[POSITIONS].T, batch.batch["position_ids"][row][:, : pm.numel()][:, pm])
        # one copy for the group against n in the batch
        assert g.mm_nbytes * N == sum(v.numel() * v.element_size() for r in range(row, row + N)
                                      for v in mm_rows[r].values()) + N * g.mm_inputs[POSITIONS].numel() * 8


def test_replay_rows_rebuild_positions_and_images_and_score_exactly(vlm, batch, config):
    """[replay ; fresh] through verl's to_tensordict + left_right_2_no_padding + extract_multi_modal_inputs: the
    replayed rows' positions and images equal the originals and their log-probs equal the stored ones."""
    model, _ = vlm
    groups = groups_from_batch(batch, step=0, group_size=N, estimator="grpo")[0][:2]  # 8 rows: one mini-batch
    fresh = vlm_batch(model, vlm[1], TASK.train_problems(2, seed=5), N, seed=9, config=config)
    fresh.meta_info["images_seqlens"] = [16] * len(fresh)  # as RayPPOTrainer.fit sets it for the flops counter
    actor, info = build_actor_batch(groups, fresh, minibatch_rows=8, dp=2, pad_token_id=0)
    rep = np.flatnonzero(actor.non_tensor_batch[REPLAY_FLAG])
    assert len(rep) == 2 * N == info["num_replay_rows"]
    assert actor.meta_info["images_seqlens"] == [16] * len(actor)  # replay rows' images counted too
    uid_rows = {}
    for i, u in enumerate(batch.non_tensor_batch["uid"]):
        uid_rows.setdefault(u, []).append(i)
    a, b = actor.batch, batch.batch
    for k, g in enumerate(groups):
        rows = [r for r in rep if actor.non_tensor_batch["uid"][r] == g.group_id]
        assert len(rows) == N
        shared = {id(actor.non_tensor_batch["multi_modal_inputs"][r]) for r in rows}
        assert len(shared) == 1  # the n rows share one dict, as they share the prompt
        originals = uid_rows[g.group_id.split(":", 1)[1]]
        for r in rows:  # the actor order permutes rows: find each replay row's original by its tokens
            va = a["attention_mask"][r].bool()
            orig = [o for o in originals if torch.equal(a["input_ids"][r][va],
                                                        b["input_ids"][o][b["attention_mask"][o].bool()])]
            assert orig, "a replayed row's tokens are not those of any original row"
            vb = b["attention_mask"][orig[0]].bool()
            assert torch.equal(a["position_ids"][r][:, va], b["position_ids"][orig[0]][:, vb])
            orig = orig[0]
            mm_a, mm_b = (actor.non_tensor_batch["multi_modal_inputs"][r],
                          batch.non_tensor_batch["multi_modal_inputs"][orig])
            assert mm_a.keys() == mm_b.keys() and all(torch.equal(mm_a[x], mm_b[x]) for x in mm_a)
    # verl's engine-side preparation accepts the mixed batch
    td = left_right_2_no_padding(actor.to_tensordict())
    assert td["position_ids"][int(rep[0])].shape[0] == 4
    cat = extract_multi_modal_inputs(list(actor.non_tensor_batch["multi_modal_inputs"]))
    assert cat["image_grid_thw"].shape == (len(actor), 3) and cat["pixel_values"].shape == (16 * len(actor), 1176)
    # Drift 0 at unchanged weights: the replayed rows' log-probs are the stored generation-time ones
    lp = vlm_logprobs(model, actor)
    m = a["response_mask"].bool()
    assert (lp - a["old_log_probs"])[m].abs().max() < 1e-5
    assert (lp[m] != 0).all()


def test_scoring_batch_reproduces_the_stored_logprobs(vlm, batch):
    model, _ = vlm
    groups, _, _ = groups_from_batch(batch, step=0, group_size=N, estimator="grpo")
    data, pg = scoring_batch(groups[::-1], pad_token_id=0, meta_info={"temperature": 1.0})  # other order + padding
    per_group = pg.split_by_group(vlm_logprobs(model, data).float())
    for g, lp in zip(groups[::-1], per_group):
        assert (lp - g.logprobs)[g.loss_mask].abs().max() < 1e-5


def test_a_wrong_image_or_position_would_show(vlm, batch):
    """The equality above is not vacuous: another group's image, or text-style 1-D positions, change the
    log-probs of the same tokens."""
    model, _ = vlm
    groups, _, _ = groups_from_batch(batch, step=0, group_size=N, estimator="grpo")
    swapped = [dataclasses.replace(groups[0], mm_inputs={**groups[0].mm_inputs,
                                                         "pixel_values": groups[1].mm_inputs["pixel_values"]})]
    data, pg = scoring_batch(swapped, pad_token_id=0, meta_info={"temperature": 1.0})
    lp = pg.split_by_group(vlm_logprobs(model, data).float())[0]
    assert (lp - groups[0].logprobs)[groups[0].loss_mask].abs().max() > 1e-3
    data, pg = scoring_batch(groups[:1], pad_token_id=0, meta_info={"temperature": 1.0})
    pos = data.batch["position_ids"]
    data.batch["position_ids"] = pos[:, :1].expand_as(pos).contiguous()  # the text row in every row
    lp = pg.split_by_group(vlm_logprobs(model, data).float())[0]
    assert (lp - groups[0].logprobs)[groups[0].loss_mask].abs().max() > 1e-3


def test_groups_that_cannot_be_replayed_are_skipped_with_a_reason(vlm, batch, config):
    model, proc = vlm
    bad = vlm_batch(model, proc, TASK.train_problems(3, seed=2), N, seed=4, config=config)
    mm_rows = bad.non_tensor_batch["multi_modal_inputs"]
    uids = bad.non_tensor_batch["uid"]
    rows = {u: [i for i in range(len(bad)) if uids[i] == u] for u in dict.fromkeys(uids)}
    u0, u1, u2 = list(rows)
    r = rows[u0][1]  # one row of the first group sees a different image (augmentation)
    mm_rows[r] = {**mm_rows[r], "pixel_values": mm_rows[r]["pixel_values"] + 1.0}
    r = rows[u1][2]  # an image inside a response: its positions jump
    L = int(bad.batch["attention_mask"][r].sum())
    pos = bad.batch["position_ids"][r]
    Pw = bad.batch["prompts"].shape[1]
    pos[1:, Pw + 1:] += 3
    r = rows[u2][0]  # a non-tensor entry
    mm_rows[r] = {**mm_rows[r], "note": "x"}
    for i in rows[u2]:
        mm_rows[i] = mm_rows[r]
    groups, problems, num_uids = groups_from_batch(bad, step=1, group_size=N, estimator="grpo")
    assert groups == [] and num_uids == 3 and L > 0
    assert "share a uid but not their multi_modal_inputs" in problems[0]
    assert "do not continue the prompt's" in problems[1]
    assert "['note'] are not tensors" in problems[2]


def test_text_groups_in_a_vision_run_are_skipped_not_fatal(batch):
    ctrl = ReplayController(ReplayConfig(k_rep=2, capacity=8))
    groups, _, _ = groups_from_batch(batch, step=0, group_size=N, estimator="grpo")
    text = dataclasses.replace(groups[0], group_id="text", mm_inputs={POSITIONS: groups[0].mm_inputs[POSITIONS]})
    ok, problems = split_by_schema([*groups[1:], text], ctrl.buffer.mm_schema)
    assert [g.group_id for g in ok] == [g.group_id for g in groups[1:]]
    assert len(problems) == 1 and "'text' not stored" in problems[0] and "pixel_values" in problems[0]
    ctrl.select(step=0)
    ctrl.stage(ok, step=0)
    ctrl.commit()
    ok, problems = split_by_schema([text], ctrl.buffer.mm_schema)  # the buffer's schema now decides
    assert ok == [] and len(problems) == 1


def test_position_rule_matches_get_rope_index_on_longer_responses(vlm):
    """The continuation rule the replay rows use, checked against the model's own get_rope_index on rows with
    responses of every length up to 12 (the rule is what makes replay positions exact)."""
    from hdreplay.integrations.verl.mm import continuation

    model, proc = vlm
    t, _ = vlm_rows(model, proc, TASK.train_problems(2, seed=3), 6, seed=1, R=12)
    Pw = t["prompts"].shape[1]
    for pos, attn in zip(t["position_ids"], t["attention_mask"].bool()):
        prompt = pos[:, :Pw][:, attn[:Pw]]
        resp = pos[:, Pw:][:, attn[Pw:]]
        assert torch.equal(resp, continuation(prompt, resp.shape[1]))
