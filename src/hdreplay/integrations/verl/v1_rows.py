"""verl v1 TransferQueue rows <-> hdreplay groups.

At ``PPOTrainer._update_actor`` (verl 0.9.1, ``trainer.use_v1=true``) the batch is a ``KVBatchMeta``:
the keys of rows stored in TransferQueue.  ``tq.kv_batch_get`` returns them as a TensorDict of B rows in
which every token field is a jagged nested tensor, one *unpadded* 1-D row per trajectory (row i has
P_i prompt and L_i response tokens; shape glossary of :mod:`hdreplay.record`):

    prompts         (P_i,)       int64 prompt ids
    responses       (L_i,)       int64 response ids (tool / observation tokens included)
    input_ids       (P_i+L_i,)   prompts ; responses
    attention_mask  (P_i+L_i,)   ones
    position_ids    (P_i+L_i,)   arange (text models)
    response_mask   (L_i,)       1 where the policy generated the token: the loss mask
    loss_mask       (L_i,)       = response_mask (verl's agent loop writes both)
    old_log_probs   (L_i,)       log-probs of the trainer's policy before the update (pi_old)
    advantages      (L_i,)       A_i * response_mask (GRPO-style outcome estimators)
    rm_scores       (L_i,)       the reward on the last response token
    ref_log_prob    (L_i,)       with a reference policy (KL loss)
    uid             str          non-tensor: one per prompt, i.e. per GRPO group
    ... plus fields the actor update does not read (:data:`NOT_READ`) and the dataset's non-tensor columns.

Rows tagged ``is_padding`` (verl's own synthetic rows) are not trajectories and are skipped.  Replay rows
are written as per-row dicts (``list_of_dict_to_tensordict``) holding exactly :func:`update_fields`;
the actor batch's ``KVBatchMeta.fields`` is set to that list, so the workers fetch the same fields for
fresh and replay rows (TransferQueue silently returns the *intersection* of the rows' fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...errors import ReplayInputError
from ...record import GroupRecord
from .dataproto import STORED_EXTRAS, response_level

#: fields the actor update reads, and how replay rows fill them
REPLAY_FILL = {
    "prompts": "stored prompt ids", "responses": "stored response ids", "input_ids": "prompts ; responses",
    "attention_mask": "ones", "position_ids": "arange(P + L)", "response_mask": "stored loss mask",
    "loss_mask": "stored loss mask", "old_log_probs": "stored generation-time log-probs",
    "advantages": "stored A_i * loss mask", "ref_log_prob": "stored reference log-probs", "uid": "group id",
}
#: tensor fields of a v1 batch that the actor update never reads (not sent to the workers for the update);
#: ``log_probs`` / ``entropy`` are the full-sequence outputs the log-prob passes leave in TransferQueue
NOT_READ = ("rm_scores", "rollout_log_probs", "log_probs", "entropy", "returns", "token_level_scores",
            "token_level_rewards", "dummy_tensor")
#: tensor fields the actor update reads that replayed rows cannot carry -> the run is refused
UNFILLABLE = {
    "rollout_is_weights": "rollout importance weights (algorithm.rollout_correction.rollout_is)",
    "values": "critic values (critic.enable)", "routed_experts": "MoE router replay",
    "teacher_ids": "distillation targets", "teacher_logprobs": "distillation targets",
}
#: fields the scoring pass (``compute_log_prob``) reads
SCORE_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                "loss_mask", "uid")
REQUIRED = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask", "old_log_probs",
            "advantages", "rm_scores", "uid")


def is_padding(tag: dict) -> bool:
    return bool(tag.get("is_padding", False))


def _is_tensor(td, key: str) -> bool:
    return isinstance(td.get(key), torch.Tensor)


def update_fields(data) -> list[str]:
    """Fields of the actor batch (fresh rows as read from TransferQueue): what replay rows must carry.

    Raises RuntimeError naming every tensor field replay rows could not fill (or that this module does
    not know), a missing required field, and multimodal rows.
    """
    keys = set(data.keys())
    missing = [k for k in REQUIRED if k not in keys]
    if missing:
        raise RuntimeError(f"the v1 actor batch has no {missing}; hdreplay needs them to store and replay groups")
    bad = sorted(k for k in keys if _is_tensor(data, k) and k not in REPLAY_FILL and k not in NOT_READ)
    if bad:
        why = "; ".join(f"{k}: {UNFILLABLE.get(k, 'unknown to hdreplay')}" for k in bad)
        raise RuntimeError(
            f"the v1 actor batch has tensor field(s) {bad} that replayed rows cannot carry ({why}). Disable the "
            f"feature that produces them or run with hdr.selector=none. Fields replay fills: {sorted(REPLAY_FILL)}"
        )
    if "multi_modal_inputs" in keys and any(bool(x) for x in _values(data, "multi_modal_inputs")):
        raise RuntimeError("the batch has non-empty multi_modal_inputs: hdreplay does not store images; text only")
    pos = data.get("position_ids")
    if pos.dim() != 2:  # nested (B, j) for text; (B, K, j) for mrope vision-language models
        raise RuntimeError(f"position_ids with {pos.dim() - 1} dims per row (multimodal rope): hdreplay replays "
                           "text models only")
    return [k for k in REPLAY_FILL if k in keys]


def _values(data, key: str) -> list:
    """The per-row Python values of a non-tensor field (``data[key]`` unwraps TensorDict's NonTensorStack)."""
    return list(data[key])


def _rows(nested: torch.Tensor) -> list[torch.Tensor]:
    return list(nested.unbind(0))


@dataclass
class FreshGroups:
    """This step's fresh trajectories as groups.

    groups:    valid groups in first-appearance order of their uid
    problems:  one message per uid that could not be stored (row count != n, empty loss mask, ...)
    num_uids:  groups in the fresh batch (|G_on|)
    rows:      indices (into the batch) of the real (non-padding) rows
    fields:    the update fields (see :func:`update_fields`)
    dtypes:    field -> dtype of the fresh rows (replay rows use the same)
    """

    groups: list[GroupRecord]
    problems: list[str]
    num_uids: int
    rows: list[int]
    fields: list[str]
    dtypes: dict[str, torch.dtype]


def fresh_groups(data, tags: Sequence[dict], *, step: int, group_size: int, estimator: str = "?") -> FreshGroups:
    """One GroupRecord per uid of the fresh rows (``data`` from ``tq.kv_batch_get``, ``tags`` of the meta).

    Stores per group: the prompt (P,), the n responses concatenated, ``response_mask`` as the loss mask,
    ``old_log_probs`` as generation-time log-probs, response-level advantages, rewards = ``rm_scores`` summed,
    and the :data:`~.dataproto.STORED_EXTRAS` present.  Group ids are ``"<step>:<uid>"``.
    """
    fields = update_fields(data)
    rows = [i for i, t in enumerate(tags) if not is_padding(t)]
    uids = [str(u) for u in _values(data, "uid")]
    prompts, responses = _rows(data["prompts"]), _rows(data["responses"])
    masks, lps, scores = _rows(data["response_mask"]), _rows(data["old_log_probs"]), _rows(data["rm_scores"])
    pos = _rows(data["position_ids"])
    extras = {name: _rows(data[key]) for key, name in STORED_EXTRAS.items() if key in data.keys()}
    adv = response_level(data["advantages"].to_padded_tensor(0.0), data["response_mask"].to_padded_tensor(0),
                         estimator=estimator)
    rows_of: dict[str, list[int]] = {}
    for i in rows:
        if not torch.equal(pos[i].long(), torch.arange(pos[i].numel())):
            raise RuntimeError(f"row {i} (uid {uids[i]!r}) has position_ids that are not arange(P + L); hdreplay "
                               "rebuilds them that way for replayed rows and cannot replay this batch")
        rows_of.setdefault(uids[i], []).append(i)
    groups, problems = [], []
    for u, idx in rows_of.items():
        if len(idx) != group_size:
            problems.append(f"uid {u!r}: {len(idx)} rows, expected rollout.n={group_size}")
            continue
        if any(not torch.equal(prompts[i], prompts[idx[0]]) for i in idx[1:]):
            raise RuntimeError(f"rows {idx} share uid {u!r} but not one prompt; GRPO groups must share a prompt")
        try:
            groups.append(GroupRecord.from_responses(
                group_id=f"{step}:{u}", prompt_ids=prompts[idx[0]], completion_ids=[responses[i] for i in idx],
                logprobs=[lps[i] for i in idx], loss_masks=[masks[i] for i in idx], advantages=adv[idx],
                rewards=torch.stack([scores[i].float().sum() for i in idx]), birth_step=step,
                extras={name: [v[i] for i in idx] for name, v in extras.items()},
            ))
        except ReplayInputError as e:
            problems.append(str(e))
    dtypes = {k: data[k].dtype for k in fields if _is_tensor(data, k)}
    return FreshGroups(groups, problems, len(rows_of), rows, fields, dtypes)


def _sequence(prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    ids = torch.cat([prompt, response])
    return {"prompts": prompt, "responses": response, "input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.numel()), "response_mask": mask, "loss_mask": mask}


def _tag(prompt_len: int, response_len: int, **extra) -> dict:
    return {"status": "success", "prompt_len": prompt_len, "response_len": response_len,
            "seq_len": prompt_len + response_len, **extra}


def _cast(row: dict[str, Any], fields: Sequence[str], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    return {k: (row[k].to(dtypes[k]) if k in dtypes else row[k]) for k in fields}


def replay_rows(groups: Sequence[GroupRecord], *, fields: Sequence[str], dtypes: dict[str, torch.dtype],
                uid_of=lambda g: str(g.group_id)) -> tuple[list[dict], list[dict]]:
    """Per-row field dicts and tags for the groups' rows (each group's n responses in order).

    Rows carry exactly ``fields`` (from :func:`update_fields`), cast to the fresh rows' ``dtypes``.
    Raises RuntimeError when the batch has ``ref_log_prob`` but the groups carry no stored reference
    log-probs (buffer filled without it, e.g. resumed with a different KL setting).
    """
    if "ref_log_prob" in fields and any("ref_logprobs" not in g.extras for g in groups):
        raise RuntimeError("the actor batch has `ref_log_prob` but replayed groups carry no stored ref_logprobs "
                           "(buffer filled without it, e.g. resumed with a different KL setting)")
    out, tags = [], []
    for g in groups:
        split = lambda t: g.split(t)  # noqa: E731
        ref = split(g.extras["ref_logprobs"]) if "ref_log_prob" in fields else None
        for j, (resp, lm, lp) in enumerate(zip(g.responses(), split(g.loss_mask), split(g.logprobs))):
            m = lm.long()
            row = _sequence(g.prompt_ids.long(), resp.long(), m)
            row.update(old_log_probs=lp, advantages=g.advantages[j] * m.float(), uid=uid_of(g))
            if ref is not None:
                row["ref_log_prob"] = ref[j]
            out.append(_cast(row, fields, dtypes))
            tags.append(_tag(g.prompt_ids.numel(), resp.numel(), hdr_replay=True, birth_step=g.birth_step))
    return out, tags


def scoring_rows(groups: Sequence[GroupRecord]) -> tuple[list[dict], list[dict]]:
    """Per-row field dicts (:data:`SCORE_FIELDS`) and tags for re-scoring the groups' stored tokens."""
    out, tags = [], []
    for g in groups:
        for resp, lm in zip(g.responses(), g.split(g.loss_mask)):
            row = _sequence(g.prompt_ids.long(), resp.long(), lm.long())
            row["uid"] = str(g.group_id)
            out.append(row)
            tags.append(_tag(g.prompt_ids.numel(), resp.numel()))
    return out, tags


def padding_rows(count: int, *, fields: Sequence[str], dtypes: dict[str, torch.dtype], token_id: int,
                 uid: str) -> tuple[list[dict], list[dict]]:
    """``count`` zero-loss rows (1 prompt + 1 response token, all masks 0) carrying exactly ``fields``.

    With ``response_mask = loss_mask = 0`` they add nothing to the loss or to the token count verl
    normalizes by; tagged ``is_padding`` like verl's own synthetic rows.
    """
    tok = torch.tensor([int(token_id)])
    row = _sequence(tok, tok.clone(), torch.zeros(1, dtype=torch.long))
    row.update(old_log_probs=torch.zeros(1), advantages=torch.zeros(1), ref_log_prob=torch.zeros(1), uid=uid)
    row = _cast(row, fields, dtypes)
    return [dict(row) for _ in range(count)], [_tag(1, 1, is_padding=True) for _ in range(count)]
