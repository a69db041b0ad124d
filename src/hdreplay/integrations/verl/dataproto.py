"""verl ``DataProto`` rows <-> hdreplay groups.

The batch ``RayPPOTrainer._update_actor`` receives holds B = groups x n rows (shape glossary of
:mod:`hdreplay.store.record`; P / R are the padded prompt / response widths of the batch):

    prompts         (B, P)     prompt ids, left-padded
    responses       (B, R)     response ids, right-padded (tool / observation tokens included)
    input_ids       (B, P+R)   prompts ; responses
    attention_mask  (B, P+R)   1 on real tokens (prompt suffix + response prefix)
    position_ids    (B, P+R)   clip(cumsum(attention_mask) - 1, 0)  (text models); (B, K, P+R) for multimodal
                               rotary VLMs (Qwen2-VL: K = 4), see :mod:`.mm`
    response_mask   (B, R)     1 where the policy generated the token (tool tokens 0): the loss mask
    old_log_probs   (B, R)     log-probs computed by verl before the update (= log pi_gen for replay)
    advantages      (B, R)     A_i * response_mask, one value per response for GRPO-style estimators
    rollout_is_weights (B, R)  with ``algorithm.rollout_correction.rollout_is``: verl's truncated pi_old / pi_rollout;
                               stored at birth and given back to the row when it is replayed
    uid             (B,)       non-tensor: one id per prompt, i.e. per GRPO group
    multi_modal_inputs (B,)    non-tensor: the processor's dict per row (empty for text); stored once per
                               group and given back to every replayed row (:mod:`.mm`)

A group's rows need not be consecutive (``_balance_batch`` reorders rows).  Replay rows are
rebuilt for *every* tensor key of the fresh batch (:data:`REPLAY_FILL`); a key this module does
not know fails loudly (:func:`check_batch_keys`) instead of being dropped.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask

from ...store.ingest import Rows, groups_from_rows
from ...store.ingest import response_advantages as ingest_response_advantages
from ...store.multimodal import Schema
from ...store.padding import PaddedGroups, pad_groups
from ...store.record import GroupRecord
from . import mm

#: fresh-batch key -> GroupRecord extras name, stored at ingress when the key is present
STORED_EXTRAS = {"ref_log_prob": "ref_logprobs", "rollout_log_probs": "rollout_logprobs",
                 "rollout_is_weights": "rollout_is_weights"}
#: how replay rows fill each tensor key (documentation of :func:`replay_rows`)
REPLAY_FILL = {
    "prompts": "stored prompt ids", "responses": "stored response ids", "input_ids": "prompts ; responses",
    "attention_mask": "from stored lengths",
    "position_ids": "clip(cumsum(attention_mask) - 1, 0); multi-row: stored prompt positions + text continuation",
    "response_mask": "stored loss mask", "old_log_probs": "stored generation-time log-probs",
    "advantages": "stored A_i * response_mask", "returns": "stored A_i * response_mask (GRPO: returns = advantages)",
    "ref_log_prob": "stored reference log-probs", "rollout_log_probs": "stored rollout log-probs",
    "rollout_is_weights": ("stored birth-time rollout IS weights "
                           "(algorithm.rollout_correction.rollout_is; 0 on padding)"),
    "token_level_scores": "stored reward on the last response token",
    "token_level_rewards": "stored reward on the last response token (no in-reward KL term)",
    "rm_scores": "stored reward on the last response token", "dummy_tensor": "zeros",
}
SEQ_KEYS = ("input_ids", "attention_mask", "position_ids")  # (B, P+R): prompt part left, response part right
PROMPT_KEYS = ("prompts",)  # (B, P) left-padded
ROW_KEYS = ("dummy_tensor",)  # (B, ...) not sequence-shaped
TOKEN_ID_KEYS = ("input_ids", "prompts", "responses")  # padded with the pad token id
#: non-tensor key marking replay rows in the actor batch (True) vs fresh rows (False)
REPLAY_FLAG = "hdr_replay"


def check_batch_keys(batch: DataProto) -> None:
    """Raise naming every tensor key replay rows could not fill, or position ids of an unknown shape."""
    unknown = sorted(k for k in batch.batch.keys() if k not in REPLAY_FILL)
    if unknown:
        raise RuntimeError(
            f"the actor batch has tensor key(s) {unknown} that hdreplay cannot fill for replayed rows (e.g. critic "
            "values, MoE routing replay, distillation targets). Disable the feature that "
            f"produces them or run with hdr.selector=none. Known keys: {sorted(REPLAY_FILL)}"
        )
    for k in ("input_ids", "attention_mask", "response_mask", "prompts", "responses", "old_log_probs", "advantages"):
        if k not in batch.batch.keys():
            raise RuntimeError(f"the actor batch has no `{k}`; hdreplay needs it to store and replay groups")
    if "uid" not in batch.non_tensor_batch:
        raise RuntimeError("the actor batch has no non-tensor `uid`; GRPO groups are identified by uid")
    pos = batch.batch["position_ids"] if "position_ids" in batch.batch.keys() else None
    width = batch.batch["input_ids"].shape[1]
    if pos is not None and not (pos.dim() == 2 or pos.dim() == 3) or pos is not None and pos.shape[-1] != width:
        raise RuntimeError(f"position_ids of shape {tuple(pos.shape)}: hdreplay replays (B, P+R) positions and "
                           f"(B, K, P+R) multimodal rotary positions (P+R = {width})")


def row_rewards(batch: DataProto) -> torch.Tensor:
    """(B,) reward of each row: sum of ``token_level_scores`` (or ``token_level_rewards``) over the response."""
    for key in ("token_level_scores", "token_level_rewards"):
        if key in batch.batch.keys():
            return batch.batch[key].float().sum(dim=-1).cpu()
    raise RuntimeError("the actor batch has neither token_level_scores nor token_level_rewards; ingress needs rewards")


def response_advantages(batch: DataProto, *, estimator: str = "?") -> torch.Tensor:
    """(B,) A_i: the advantage of each row, checked to be constant over its response_mask tokens."""
    return response_level(batch.batch["advantages"], batch.batch["response_mask"], estimator=estimator)


def response_level(advantages: torch.Tensor, mask: torch.Tensor, *, estimator: str = "?") -> torch.Tensor:
    """(B,) one advantage per row (:func:`hdreplay.store.ingest.response_advantages` with verl's setting named)."""
    return ingest_response_advantages(advantages, mask, hint=f"algorithm.adv_estimator={estimator}")


def groups_from_batch(
    batch: DataProto, *, step: int, group_size: int, estimator: str = "?", schema: Schema | None = None
) -> tuple[list[GroupRecord], list[str], int]:
    """One GroupRecord per uid of a fresh verl batch (:func:`hdreplay.store.ingest.groups_from_rows` builds and checks
    them; this function reads verl's layout and checks verl's conventions).

    Stores per group: the unpadded prompt (P,), the n responses concatenated (T,) (unpadded with
    the response part of ``attention_mask``), ``response_mask`` as the loss mask, ``old_log_probs``
    as generation-time log-probs, response-level advantages and rewards (n,), and
    :data:`STORED_EXTRAS` present in the batch.  Group ids are ``"<step>:<uid>"``.  ``schema``: the buffer's
    multimodal schema (None = the first group's).

    Returns:
        (groups, problems, num_uids): valid groups in first-appearance order of their uid, one message
        per uid that could not be stored (wrong row count, empty loss mask, ...), and the number of uids.
    """
    check_batch_keys(batch)
    t = {k: v.detach().cpu() for k, v in batch.batch.items()}
    P = t["prompts"].shape[1]
    attn = t["attention_mask"].bool()
    if "position_ids" in t and not mm.is_multirow(t["position_ids"]):
        expect = compute_position_id_with_mask(t["attention_mask"].long())
        if not torch.equal(t["position_ids"].long()[attn], expect[attn]):
            raise RuntimeError("position_ids do not follow verl's clip(cumsum(attention_mask) - 1, 0) convention; "
                               "hdreplay rebuilds them that way for replayed rows and cannot replay this batch")
    rows = Rows(prompt_ids=t["prompts"], prompt_mask=attn[:, :P], completion_ids=t["responses"],
                completion_mask=attn[:, P:], loss_mask=t["response_mask"], logprobs=t["old_log_probs"],
                advantages=t["advantages"], rewards=row_rewards(batch),
                extras={name: t[key] for key, name in STORED_EXTRAS.items() if key in t})
    mm_rows = batch.non_tensor_batch.get("multi_modal_inputs")
    got = groups_from_rows(rows, step=step, group_size=group_size, keys=batch.non_tensor_batch["uid"].tolist(),
                           group_id=lambda u: f"{step}:{u}", schema=schema, key_name="uid", size_name="rollout.n",
                           hint=f"algorithm.adv_estimator={estimator}",
                           mm_inputs=lambda idx: mm.capture(idx, mm_rows, t.get("position_ids"), attn, P))
    return got.groups, got.problems + got.empty, got.num_groups


def _pad(x: torch.Tensor, width: int, side: str, value) -> torch.Tensor:
    axis = 2 if x.dim() == 3 else 1  # (B, K, W) multi-row position ids: pad the sequence axis
    extra = width - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad width {x.shape[axis]} down to {width}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[axis] = extra
    pad = x.new_full(shape, value)
    return torch.cat([pad, x], dim=axis) if side == "left" else torch.cat([x, pad], dim=axis)


def pad_batch_tensors(tensors: dict[str, torch.Tensor], *, P: int, R: int, old_P: int,
                      pad_token_id: int) -> dict[str, torch.Tensor]:
    """Re-pad row tensors from prompt width ``old_P`` to widths (P, R) (prompt side left, response side right)."""
    out = {}
    for k, v in tensors.items():
        val = pad_token_id if k in TOKEN_ID_KEYS else 0
        if k in ROW_KEYS:
            out[k] = v
        elif k in PROMPT_KEYS:
            out[k] = _pad(v, P, "left", val)
        elif k in SEQ_KEYS:
            out[k] = torch.cat([_pad(v[..., :old_P], P, "left", val), _pad(v[..., old_P:], R, "right", val)], dim=-1)
        else:
            out[k] = _pad(v, R, "right", val)
    return out


def padded_rows(groups: Sequence[GroupRecord], *, pad_token_id: int) -> tuple[PaddedGroups, dict[str, torch.Tensor]]:
    """The rows of ``groups`` (each group's n responses consecutive) in verl's layout at tight widths.

    Returns (pg, tensors) with tensors ``prompts (Rr, P') , responses / response_mask / old_log_probs /
    advantages (Rr, R')``, ``input_ids / attention_mask / position_ids (Rr, P'+R')``, Rr = sum_g n_g.
    """
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    attn = torch.cat([pg.prompt_mask, pg.completion_mask], dim=1)
    lmask = pg.loss_mask.long()
    if groups and mm.POSITIONS in groups[0].mm_inputs:  # (Rr, K, P'+R') multimodal rotary positions
        P, R = pg.prompt_ids.shape[1], pg.completion_ids.shape[1]
        pos = torch.cat([mm.row_positions(g, P=P, R=R, like=attn) for g in groups])
    else:
        pos = compute_position_id_with_mask(attn)
    return pg, {
        "prompts": pg.prompt_ids, "responses": pg.completion_ids,
        "input_ids": torch.cat([pg.prompt_ids, pg.completion_ids], dim=1), "attention_mask": attn,
        "position_ids": pos, "response_mask": lmask,
        "old_log_probs": pg.logprobs, "advantages": pg.advantages[:, None] * lmask,
    }


def replay_rows(groups: Sequence[GroupRecord], *, like: DataProto, P: int, R: int,
                pad_token_id: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Replay rows with exactly the keys of the fresh batch ``like``, at widths (P, R).

    Tensor keys are filled as :data:`REPLAY_FILL` says (dtype of ``like``); non-tensor keys get
    ``uid`` = group id, ``multi_modal_inputs`` = the group's stored dict (one shared by its rows; empty for
    text groups) and None elsewhere, plus ``hdr_replay=True``.
    Raises RuntimeError naming a key that cannot be filled (e.g. reference log-probs not stored).
    """
    pg, base = padded_rows(groups, pad_token_id=pad_token_id)
    rows = pg.num_rows
    base["returns"] = base["advantages"]
    last = torch.zeros_like(pg.logprobs)
    last[torch.arange(rows), torch.tensor(pg.response_lengths) - 1] = pg.rewards
    for k in ("token_level_scores", "token_level_rewards", "rm_scores"):
        base[k] = last
    for key, name in STORED_EXTRAS.items():
        if key in like.batch.keys():
            if name not in pg.extras:
                raise RuntimeError(f"the actor batch has `{key}` but replayed groups carry no stored {name} "
                                   "(buffer filled without it, e.g. resumed with a different KL or rollout_is setting)")
            base[key] = pg.extras[name]
    tensors = {}
    for k, ref in like.batch.items():
        if k in ROW_KEYS:
            tensors[k] = torch.zeros((rows, *ref.shape[1:]), dtype=ref.dtype)
        elif k not in base:
            raise RuntimeError(f"hdreplay cannot fill actor-batch key `{k}` for replayed rows")
        else:
            tensors[k] = base[k].to(ref.dtype)
    tensors = pad_batch_tensors(tensors, P=P, R=R, old_P=pg.prompt_ids.shape[1], pad_token_id=pad_token_id)
    uid = np.array([groups[int(g)].group_id for g in pg.row_group.tolist()], dtype=object)
    non_tensors = {}
    for k in like.non_tensor_batch:
        if k == "uid":
            non_tensors[k] = uid
        elif k == "multi_modal_inputs":
            non_tensors[k] = mm.rows_object(groups, pg.row_group.tolist())
        else:
            non_tensors[k] = np.full(rows, None, dtype=object)
    non_tensors[REPLAY_FLAG] = np.ones(rows, dtype=bool)
    return tensors, non_tensors


def scoring_batch(groups: Sequence[GroupRecord], *, pad_token_id: int,
                  meta_info: dict | None = None) -> tuple[DataProto, PaddedGroups]:
    """A DataProto of the groups' rows for ``_compute_old_log_prob`` (re-scoring under the current policy).

    Returns (batch, pg); ``pg.split_by_group(old_log_probs)`` turns the ``(Rr, R')`` result back
    into one flat ``(T_g,)`` tensor per group.
    """
    pg, t = padded_rows(groups, pad_token_id=pad_token_id)
    keep = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
    meta = dict(meta_info or {})
    meta["global_token_num"] = t["attention_mask"].sum(dim=-1).tolist()
    uid = np.array([groups[int(g)].group_id for g in pg.row_group.tolist()], dtype=object)
    non_tensors = {"uid": uid}
    if any(g.mm_inputs for g in groups):
        non_tensors["multi_modal_inputs"] = mm.rows_object(groups, pg.row_group.tolist())
    return DataProto.from_dict(tensors={k: t[k] for k in keep}, non_tensors=non_tensors, meta_info=meta), pg
