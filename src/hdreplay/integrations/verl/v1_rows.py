"""verl v1 TransferQueue rows <-> hdreplay groups.

At ``PPOTrainer._update_actor`` (verl 0.9.1, ``trainer.use_v1=true``) the batch is a ``KVBatchMeta``:
the keys of rows stored in TransferQueue.  ``tq.kv_batch_get`` returns them as a TensorDict of B rows in
which every token field is a jagged nested tensor, one *unpadded* 1-D row per trajectory (row i has
P_i prompt and L_i response tokens; shape glossary of :mod:`hdreplay.store.record`):

    prompts         (P_i,)       int64 prompt ids
    responses       (L_i,)       int64 response ids (tool / observation tokens included)
    input_ids       (P_i+L_i,)   prompts ; responses
    attention_mask  (P_i+L_i,)   ones
    position_ids    (P_i+L_i,)   arange (text models); (K, P_i+L_i) for multimodal rotary VLMs (Qwen2-VL: K = 4)
    response_mask   (L_i,)       1 where the policy generated the token: the loss mask
    loss_mask       (L_i,)       = response_mask (verl's agent loop writes both)
    old_log_probs   (L_i,)       log-probs of the trainer's policy before the update (pi_old)
    advantages      (L_i,)       A_i * response_mask (GRPO-style outcome estimators)
    rm_scores       (L_i,)       the reward on the last response token
    ref_log_prob    (L_i,)       with a reference policy (KL loss)
    rollout_is_weights (L_i,)    with ``algorithm.rollout_correction.rollout_is``: verl's truncated pi_old / pi_rollout
                                 (token or sequence level); a replayed row carries its birth value
    uid             str          non-tensor: one per prompt, i.e. per GRPO group
    multi_modal_inputs dict      non-tensor: the processor's tensors for the row's prompt ({} for text); the n
                                 rows of a uid hold copies -- stored once per group (:mod:`.mm`)
    ... plus fields the actor update does not read (:data:`NOT_READ`) and the dataset's non-tensor columns.

Rows tagged ``is_padding`` (verl's own synthetic rows) are not trajectories and are skipped.  Replay rows
are written as per-row dicts (``list_of_dict_to_tensordict``) holding exactly :func:`update_fields`;
the actor batch's ``KVBatchMeta.fields`` is set to that list, so the workers fetch the same fields for
fresh and replay rows (TransferQueue silently returns the *intersection* of the rows' fields).

Vision-language rows: a group stores its prompt's ``multi_modal_inputs`` once and, for K-row positions, the
prompt's ``(P, K)`` positions; responses must be text whose positions continue the prompt's (checked on every
row, else the group is skipped with a reason).  Replay and scoring rows get the dict back (shared by the group's
rows) and ``(K, P+L)`` positions rebuilt from that rule; padding rows get ``{}`` and K-row ``arange`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...store.ingest import Rows, groups_from_rows
from ...store.multimodal import Schema
from ...store.record import GroupRecord
from . import mm
from .dataproto import STORED_EXTRAS

#: fields the actor update reads, and how replay rows fill them
REPLAY_FILL = {
    "prompts": "stored prompt ids", "responses": "stored response ids", "input_ids": "prompts ; responses",
    "attention_mask": "ones", "position_ids": "arange(P + L), or the stored prompt's K-row positions continued",
    "response_mask": "stored loss mask",
    "loss_mask": "stored loss mask", "old_log_probs": "stored generation-time log-probs",
    "advantages": "stored A_i * loss mask", "ref_log_prob": "stored reference log-probs", "uid": "group id",
    "rollout_is_weights": "stored birth-time rollout IS weights (algorithm.rollout_correction.rollout_is)",
    "multi_modal_inputs": "the group's stored processor inputs (one dict shared by its rows; {} for text)",
}
#: tensor fields of a v1 batch that the actor update never reads (not sent to the workers for the update);
#: ``log_probs`` / ``entropy`` are the full-sequence outputs the log-prob passes leave in TransferQueue
NOT_READ = ("rm_scores", "rollout_log_probs", "log_probs", "entropy", "returns", "token_level_scores",
            "token_level_rewards", "dummy_tensor")
#: tensor fields the actor update reads that replayed rows cannot carry -> the run is refused
UNFILLABLE = {
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
    not know), a missing required field, and position ids of more than one row per token.
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
    pos = data.get("position_ids")
    if pos.dim() not in (2, 3):  # nested (B, j) for text; (B, K, j) for mrope vision-language models
        raise RuntimeError(f"position_ids with {pos.dim() - 1} dims per row: hdreplay replays (L,) and (K, L) "
                           "position ids only")
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
    position_rows: K for ``(K, L)`` multimodal rotary positions, None for ``(L,)``
    """

    groups: list[GroupRecord]
    problems: list[str]
    num_uids: int
    rows: list[int]
    fields: list[str]
    dtypes: dict[str, torch.dtype]
    position_rows: int | None = None


def _padded(nested: torch.Tensor, pad=0) -> tuple[torch.Tensor, torch.Tensor]:
    """A jagged (B, j) nested tensor as ``(values, mask)``, both (B, W) right-padded (mask: 1 on real entries)."""
    values = nested.to_padded_tensor(pad)
    lengths = torch.tensor([r.numel() for r in nested.unbind(0)], dtype=torch.long)
    return values, torch.arange(values.shape[1])[None, :] < lengths[:, None]


def fresh_groups(data, tags: Sequence[dict], *, step: int, group_size: int, estimator: str = "?",
                 schema: Schema | None = None) -> FreshGroups:
    """One GroupRecord per uid of the fresh rows (``data`` from ``tq.kv_batch_get``, ``tags`` of the meta);
    :func:`hdreplay.store.ingest.groups_from_rows` builds and checks them, this function reads verl's v1 layout and
    checks its conventions.

    Stores per group: the prompt (P,), the n responses concatenated, ``response_mask`` as the loss mask,
    ``old_log_probs`` as generation-time log-probs, response-level advantages, rewards = ``rm_scores`` summed,
    and the :data:`~.dataproto.STORED_EXTRAS` present, and a vision-language prompt's inputs
    (:func:`.mm.capture_rows`).  Group ids are ``"<step>:<uid>"``.  ``schema``: the buffer's multimodal schema
    (None = the first group's); a group that does not fit it is one of the ``problems``.
    """
    fields = update_fields(data)
    rows = [i for i, t in enumerate(tags) if not is_padding(t)]
    uids = [str(u) for u in _values(data, "uid")]
    pos = _rows(data["position_ids"])
    K = data["position_ids"].shape[1] if data["position_ids"].dim() == 3 else None
    for i in rows:
        if K is None and not torch.equal(pos[i].long(), torch.arange(pos[i].numel())):
            raise RuntimeError(f"row {i} (uid {uids[i]!r}) has position_ids that are not arange(P + L); hdreplay "
                               "rebuilds them that way for replayed rows and cannot replay this batch")
    mm_rows = _values(data, "multi_modal_inputs") if "multi_modal_inputs" in data.keys() else None
    (prompts, pmask), (responses, rmask) = _padded(data["prompts"]), _padded(data["responses"])
    prompt_lens = pmask.sum(1).tolist()
    batch = Rows(prompt_ids=prompts, prompt_mask=pmask, completion_ids=responses, completion_mask=rmask,
                 loss_mask=_padded(data["response_mask"])[0], logprobs=_padded(data["old_log_probs"], 0.0)[0],
                 advantages=_padded(data["advantages"], 0.0)[0],
                 rewards=_padded(data["rm_scores"], 0.0)[0].float().sum(-1),
                 extras={name: _padded(data[key], 0.0)[0] for key, name in STORED_EXTRAS.items() if key in data.keys()})
    got = groups_from_rows(batch, step=step, group_size=group_size, keys=uids, only=rows,
                           group_id=lambda u: f"{step}:{u}", schema=schema, key_name="uid", size_name="rollout.n",
                           hint=f"algorithm.adv_estimator={estimator}",
                           mm_inputs=lambda idx: mm.capture_rows(idx, mm_rows, pos, prompt_lens))
    dtypes = {k: data[k].dtype for k in fields if _is_tensor(data, k)}
    return FreshGroups(got.groups, got.problems + got.empty, got.num_groups, rows, fields, dtypes, K)


def _sequence(prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor,
              group: GroupRecord | None = None) -> dict[str, Any]:
    """The token fields of one row; a vision-language ``group`` adds its ``multi_modal_inputs`` and, when it
    stored K-row prompt positions, ``(K, P+L)`` positions continued over the response."""
    ids = torch.cat([prompt, response])
    row = {"prompts": prompt, "responses": response, "input_ids": ids, "attention_mask": torch.ones_like(ids),
           "position_ids": torch.arange(ids.numel()), "response_mask": mask, "loss_mask": mask,
           "multi_modal_inputs": {}}
    if group is not None and group.mm_inputs:
        row["multi_modal_inputs"] = mm.processor_inputs(group)
        if mm.POSITIONS in group.mm_inputs:
            row["position_ids"] = mm.sequence_positions(group, response.numel())
    return row


def _tag(prompt_len: int, response_len: int, **extra) -> dict:
    return {"status": "success", "prompt_len": prompt_len, "response_len": response_len,
            "seq_len": prompt_len + response_len, **extra}


def _cast(row: dict[str, Any], fields: Sequence[str], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    return {k: (row[k].to(dtypes[k]) if k in dtypes else row[k]) for k in fields}


def replay_rows(groups: Sequence[GroupRecord], *, fields: Sequence[str], dtypes: dict[str, torch.dtype],
                uid_of=lambda g: str(g.group_id)) -> tuple[list[dict], list[dict]]:
    """Per-row field dicts and tags for the groups' rows (each group's n responses in order).

    Rows carry exactly ``fields`` (from :func:`update_fields`), cast to the fresh rows' ``dtypes``; the
    :data:`~.dataproto.STORED_EXTRAS` among them (``ref_log_prob``, ``rollout_is_weights``) come from the group.
    Raises RuntimeError when the batch has one but a group does not carry it (buffer filled without it, e.g.
    resumed with a different KL or rollout_is setting).
    """
    stored = {key: name for key, name in STORED_EXTRAS.items() if key in fields}
    for key, name in stored.items():
        if any(name not in g.extras for g in groups):
            raise RuntimeError(f"the actor batch has `{key}` but replayed groups carry no stored {name} (buffer "
                               "filled without it, e.g. resumed with a different KL or rollout_is setting)")
    out, tags = [], []
    for g in groups:
        split = lambda t: g.split(t)  # noqa: E731
        extras = {key: split(g.extras[name]) for key, name in stored.items()}
        for j, (resp, lm, lp) in enumerate(zip(g.responses(), split(g.loss_mask), split(g.logprobs))):
            m = lm.long()
            row = _sequence(g.prompt_ids.long(), resp.long(), m, g)
            row.update(old_log_probs=lp, advantages=g.advantages[j] * m.float(), uid=uid_of(g))
            row.update({key: v[j] for key, v in extras.items()})
            out.append(_cast(row, fields, dtypes))
            tags.append(_tag(g.prompt_ids.numel(), resp.numel(), hdr_replay=True, birth_step=g.birth_step))
    return out, tags


def score_fields(groups: Sequence[GroupRecord]) -> list[str]:
    """Fields the scoring pass sends: :data:`SCORE_FIELDS`, plus ``multi_modal_inputs`` for vision-language
    groups (a buffer holds one multimodal schema, so the first group decides)."""
    return [*SCORE_FIELDS, "multi_modal_inputs"] if groups and groups[0].mm_inputs else list(SCORE_FIELDS)


def scoring_rows(groups: Sequence[GroupRecord]) -> tuple[list[dict], list[dict]]:
    """Per-row field dicts (:func:`score_fields`) and tags for re-scoring the groups' stored tokens."""
    out, tags = [], []
    fields = score_fields(groups)
    for g in groups:
        for resp, lm in zip(g.responses(), g.split(g.loss_mask)):
            row = _sequence(g.prompt_ids.long(), resp.long(), lm.long(), g)
            row["uid"] = str(g.group_id)
            out.append({k: row[k] for k in fields})
            tags.append(_tag(g.prompt_ids.numel(), resp.numel()))
    return out, tags


def padding_rows(count: int, *, fields: Sequence[str], dtypes: dict[str, torch.dtype], token_id: int,
                 uid: str, position_rows: int | None = None) -> tuple[list[dict], list[dict]]:
    """``count`` zero-loss rows (1 prompt + 1 response token, all masks 0) carrying exactly ``fields``.

    With ``response_mask = loss_mask = 0`` they add nothing to the loss or to the token count verl
    normalizes by; tagged ``is_padding`` like verl's own synthetic rows.  ``position_rows`` = K gives them
    ``(K, 2)`` positions (a batch's rows must agree on the position layout), and ``{}`` multimodal inputs;
    ``rollout_is_weights`` 0.
    """
    tok = torch.tensor([int(token_id)])
    row = _sequence(tok, tok.clone(), torch.zeros(1, dtype=torch.long))
    if position_rows is not None:
        row["position_ids"] = torch.arange(2).repeat(position_rows, 1)
    row.update(old_log_probs=torch.zeros(1), advantages=torch.zeros(1), ref_log_prob=torch.zeros(1),
               rollout_is_weights=torch.zeros(1), uid=uid)
    row = _cast(row, fields, dtypes)
    return [dict(row) for _ in range(count)], [_tag(1, 1, is_padding=True) for _ in range(count)]
