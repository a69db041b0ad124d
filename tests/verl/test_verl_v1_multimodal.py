"""verl v1 vision-language rows through hdreplay (real verl objects, no Ray except the TransferQueue round trip):
rows shaped as verl 0.9.1's ``AgentLoopWorkerTQ._agent_loop_postprocess`` writes them (unpadded, ``(4, P+L)``
mrope positions, a ``multi_modal_inputs`` dict per row) become groups that store the image once; replay, scoring
and padding rows carry the dict and rebuilt positions back, go through ``list_of_dict_to_tensordict`` and
TransferQueue with the fresh rows, and score exactly the stored log-probs through ``extract_multi_modal_inputs``."""

import dataclasses

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.multimodal]
pytest.importorskip("verl", minversion="0.9.1")

import torch  # noqa: E402
from verl.utils.model import extract_multi_modal_inputs  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

from hdreplay.integrations.verl.mm import POSITIONS  # noqa: E402
from hdreplay.integrations.verl.v1_rows import (  # noqa: E402
    fresh_groups,
    padding_rows,
    replay_rows,
    score_fields,
    scoring_rows,
)
from verl_helpers import compose_config  # noqa: E402
from verl_vlm import TASK, vlm_batch  # noqa: E402

N = 4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from hdreplay_lab.sandbox.vlm import build_tiny_vlm, load_vlm

    model, proc = load_vlm(build_tiny_vlm(tmp_path_factory.mktemp("vlm1"), chars=TASK.vocab, hidden=32))
    model.eval()
    with torch.no_grad():  # larger weights: a wrong position or image shows in the log-probs
        for p in model.parameters():
            p.mul_(3.0)
    return model, proc


def v1_rows(batch) -> tuple[list[dict], list[dict]]:
    """The v0-shaped batch's rows unpadded, as the v1 agent loop puts them into TransferQueue (+ old log-probs
    and advantages, as ``_update_actor`` reads them), and their tags."""
    t, P = batch.batch, batch.batch["prompts"].shape[1]
    rows, tags = [], []
    for i in range(len(batch)):
        a = t["attention_mask"][i].bool()
        L = int(a[P:].sum())
        prompt, resp = t["prompts"][i][a[:P]], t["responses"][i][:L]
        ids = torch.cat([prompt, resp])
        rows.append({"prompts": prompt, "responses": resp, "input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "position_ids": t["position_ids"][i][:, a], "response_mask": t["response_mask"][i][:L],
                     "loss_mask": t["response_mask"][i][:L], "old_log_probs": t["old_log_probs"][i][:L],
                     "advantages": t["advantages"][i][:L], "rm_scores": t["rm_scores"][i][:L],
                     "uid": str(batch.non_tensor_batch["uid"][i]),
                     "multi_modal_inputs": batch.non_tensor_batch["multi_modal_inputs"][i]})
        tags.append({"status": "success", "prompt_len": prompt.numel(), "response_len": L, "seq_len": ids.numel()})
    return rows, tags


@torch.no_grad()
def row_logprobs(model, td) -> list[torch.Tensor]:
    """(L_i,) teacher-forced response log-probs of every row of a v1 TensorDict, the images through verl's
    ``extract_multi_modal_inputs`` (the model call is the plain forward: verl's patched one needs flash-attn)."""
    out = []
    for ids, pos, prompt, mm in zip(td["input_ids"].unbind(0), td["position_ids"].unbind(0),
                                    td["prompts"].unbind(0), list(td["multi_modal_inputs"])):
        inputs = extract_multi_modal_inputs([mm]) if mm else {}
        inputs.pop("images_seqlens", None)
        logits = model(input_ids=ids[None], position_ids=pos[:, None, :], **inputs).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        out.append(lp[prompt.numel() - 1:])
    return out


@pytest.fixture(scope="module")
def fresh(vlm):
    model, proc = vlm
    batch = vlm_batch(model, proc, TASK.train_problems(3, seed=1), N, seed=0, config=compose_config())
    rows, tags = v1_rows(batch)
    return rows, tags, fresh_groups(list_of_dict_to_tensordict(rows), tags, step=2, group_size=N, estimator="grpo")


def test_v1_groups_store_the_image_once_and_the_prompt_positions(fresh):
    rows, _, fg = fresh
    assert fg.problems == [] and fg.num_uids == 3 == len(fg.groups) and fg.position_rows == 4
    assert "multi_modal_inputs" in fg.fields
    for k, g in enumerate(fg.groups):
        src = rows[k * N]
        assert set(g.mm_inputs) == {"pixel_values", "image_grid_thw", "images_seqlens", POSITIONS}
        for key, v in src["multi_modal_inputs"].items():
            assert g.mm_inputs[key].dtype == v.dtype and torch.equal(g.mm_inputs[key], v)
        assert torch.equal(g.mm_inputs[POSITIONS].T, src["position_ids"][:, :src["prompts"].numel()])


def test_v1_replay_rows_carry_images_and_positions_through_transfer_queue_and_score_exactly(vlm, fresh,
                                                                                         transfer_queue):
    """[replay ; fresh ; padding] written to and read back from TransferQueue with the update fields (as
    ``_write_actor_batch`` does): every replay row equals its original row field by field, images included, and
    its log-probs under verl's multimodal input path are the stored generation-time ones (Drift 0)."""
    tq = transfer_queue
    model, _ = vlm
    rows, tags, fg = fresh
    rep, rep_tags = replay_rows(fg.groups[:2], fields=fg.fields, dtypes=fg.dtypes)
    pad, pad_tags = padding_rows(2, fields=fg.fields, dtypes=fg.dtypes, token_id=1, uid="hdrpad",
                                 position_rows=fg.position_rows)
    everything = rep + [{k: r[k] for k in fg.fields} for r in rows] + pad
    keys = [f"mmv1n{i}_0_0" for i in range(len(everything))]
    tq.kv_batch_put(keys=keys, partition_id="mmv1", fields=list_of_dict_to_tensordict(everything),
                    tags=rep_tags + tags + pad_tags)
    try:
        td = tq.kv_batch_get(keys=keys, partition_id="mmv1", select_fields=list(fg.fields))
    finally:
        tq.kv_clear(keys=keys, partition_id="mmv1")
    assert td["position_ids"].dim() == 3 and list(td["multi_modal_inputs"])[-1] == {}
    back = [{k: td[k][i] if k != "multi_modal_inputs" else list(td[k])[i] for k in fg.fields}
            for i in range(len(everything))]
    lps = row_logprobs(model, td)
    for i in range(len(rep)):  # group k's rows in order: replay row i is original row i
        orig, got = rows[i], back[i]
        for k in ("prompts", "responses", "input_ids", "position_ids", "response_mask", "old_log_probs"):
            assert torch.equal(got[k], orig[k]), k
        assert got["multi_modal_inputs"].keys() == orig["multi_modal_inputs"].keys()
        assert all(torch.equal(got["multi_modal_inputs"][k], v) for k, v in orig["multi_modal_inputs"].items())
        m = orig["response_mask"].bool()
        assert (lps[i] - orig["old_log_probs"])[m].abs().max() < 1e-5 and (lps[i][m] != 0).all()
    # a batch with all three kinds goes through verl's engine input preparation
    cat = extract_multi_modal_inputs(list(td["multi_modal_inputs"]))
    assert cat["image_grid_thw"].shape == (len(rep) + len(rows), 3)
    assert all(lp.numel() == 1 for lp in lps[-2:])  # padding rows: text, 1 response token


def test_v1_scoring_rows_reproduce_the_stored_logprobs_and_a_wrong_image_would_show(vlm, fresh):
    model, _ = vlm
    _, _, fg = fresh
    groups = fg.groups[::-1]
    assert score_fields(groups)[-1] == "multi_modal_inputs"
    srows, _ = scoring_rows(groups)
    lps = row_logprobs(model, list_of_dict_to_tensordict(srows))
    i = 0
    for g in groups:
        for lm, lp_stored in zip(g.split(g.loss_mask), g.split(g.logprobs)):
            assert (lps[i] - lp_stored)[lm].abs().max() < 1e-5
            i += 1
    g = groups[0]
    swapped = dataclasses.replace(g, mm_inputs={**g.mm_inputs, "pixel_values": groups[1].mm_inputs["pixel_values"]})
    lp = row_logprobs(model, list_of_dict_to_tensordict(scoring_rows([swapped])[0]))[0]
    first = g.split(g.loss_mask)[0]
    assert (lp - g.split(g.logprobs)[0])[first].abs().max() > 1e-3


def test_v1_rows_that_break_the_position_rule_or_disagree_on_images_are_skipped(fresh):
    rows, tags, _ = fresh
    bad = [dict(r) for r in rows]
    bad[1]["multi_modal_inputs"] = {**rows[1]["multi_modal_inputs"],
                                    "pixel_values": rows[1]["multi_modal_inputs"]["pixel_values"] + 1.0}
    P = rows[N + 2]["prompts"].numel()
    pos = rows[N + 2]["position_ids"].clone()
    pos[1:, P + 1:] += 3  # an image inside the response: its positions jump
    bad[N + 2]["position_ids"] = pos
    fg = fresh_groups(list_of_dict_to_tensordict(bad), tags, step=3, group_size=N, estimator="grpo")
    assert [g.group_id.split(":")[1] for g in fg.groups] == [rows[2 * N]["uid"]] and len(fg.problems) == 2
    assert "not their multi_modal_inputs" in fg.problems[0] and "do not continue the prompt's" in fg.problems[1]


# ------------------------------------------------------------------- through verl's v1 PPOTrainer.fit() with a VLM
@pytest.fixture(scope="module")
def vlm_fit(worker_group, transfer_queue, tmp_path_factory):
    """3 steps of verl's v1 sync trainer with the recipe's seam, lr = 0: the CPU worker group loads a tiny Qwen2-VL
    (saved + reloaded with from_pretrained) and feeds each row's multi_modal_inputs and (4, L) positions to it; the
    stub agent loop writes geo images as verl's v1 agent loop does."""
    from hdreplay.integrations.verl import HDRPPOTrainerSync
    from hdreplay_lab.sandbox.vlm import build_tiny_vlm, load_vlm
    from verl_v1_harness import run_v1
    from verl_vlm import v1_trajectory

    model_dir = build_tiny_vlm(tmp_path_factory.mktemp("vlm_fit"), chars=TASK.vocab, hidden=32)
    model, proc = load_vlm(model_dir)
    return run_v1(HDRPPOTrainerSync, worker_group, proc.tokenizer, str(model_dir), tmp_path_factory.mktemp("ck"),
                  "hdr.k_rep=2", lr=0.0, steps=3, trajectory=v1_trajectory(model, proc))


def test_v1_fit_replays_image_groups_with_zero_drift_and_trains_them_with_their_images(vlm_fit):
    import numpy as np

    run = vlm_fit
    steps = run.trainer.steps
    assert [s["num_replay_rows"] for s in steps] == [0, 2 * N, 2 * N]
    for s in steps[1:]:  # the worker group re-scored stored groups with their images at unchanged weights
        sel = s["selection"]
        assert len(sel.scanned) and np.abs(sel.scanned_drift).max() < 1e-6 and sel.scanned_pass.all()
        assert all(POSITIONS in g.mm_inputs and "pixel_values" in g.mm_inputs for g in sel.groups)
    for update in (1, 2):  # every replayed and fresh row reached the loss with its one image, padding with none
        kind = run.kind_of(update)
        for rank in run.records:
            for mb in rank["history"][update]:
                for uid, images in zip(mb["uid"], mb["images"]):
                    assert images == (0 if kind(uid) == "pad" else 1), (uid, kind(uid))
        assert any(kind(u) == "replay" for rank in run.records for mb in rank["history"][update] for u in mb["uid"])
