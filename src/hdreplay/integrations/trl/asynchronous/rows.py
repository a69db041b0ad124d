"""TRL async GRPO's ``RolloutSample``s <-> hdreplay groups, and re-scoring through TRL's tree packing.

A ``RolloutSample`` (trl 1.16, ``trl.experimental.async_grpo.async_rollout_worker``) is one completion:

    input_ids        (P + L,) int64  prompt ; completion (tool tokens included)
    completion_mask  (P + L,) int64  1 on the tokens the loss trains (the policy's), 0 on prompt / tool tokens
    old_log_probs    (P + L,) float  the sampler's (vLLM's) log-prob of each token (0 where not sampled)
    advantage        float           A_i, computed by the worker within the group
    model_version    int             the policy version the request was dispatched with
    group_id         int             one per prompt; the n samples of a group share it
    metrics          dict            per-sample rewards ("reward")

A group stores the prompt (the tokens before the first completion token, shared by all n samples), each
completion ``input_ids[P:]`` with ``completion_mask[P:]`` as loss mask and ``old_log_probs[P:]`` as its log-probs:
the sampler's, the ratio denominator TRL's loss uses for fresh rows, and so the one replayed rows use.
``birth_step = model_version - 1`` (the updates its policy had seen).  Replayed samples are rebuilt from the group
with ``model_version`` set to the version they are emitted at (their Drift was measured at it; TRL's own
staleness check would drop them otherwise) -- the true generation version is in the ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from ....errors import ReplayInputError
from ....store.ingest import one_group, rows_from_responses
from ....store.record import GroupRecord


def prompt_length(sample) -> int:
    """P: tokens before the first completion-mask token."""
    mask = np.asarray(sample.completion_mask)
    nz = np.flatnonzero(mask)
    if not len(nz):
        raise ReplayInputError(f"group {sample.group_id}: a sample has no completion token (completion_mask all 0)")
    return int(nz[0])


def check_sampler_logprobs(samples: Sequence) -> None:
    """Refuse a group whose sampler gave no log-probs (missing, misaligned, or exactly 0 on every completion token:
    vLLM without ``logprobs``), with the numbers."""
    total, zeros = 0, 0
    for s in samples:
        lp = s.old_log_probs
        if lp is None or len(lp) != len(s.input_ids):
            raise ReplayInputError(
                f"group {s.group_id}: old_log_probs has {0 if lp is None else len(lp)} values for {len(s.input_ids)} "
                "tokens; hdreplay needs the sampler's log-prob of every token (the rollout worker must request "
                "logprobs from the inference server)")
        m = np.asarray(s.completion_mask).astype(bool)
        total += int(m.sum())
        zeros += int((np.asarray(lp)[m] == 0).sum())
    if total and zeros == total:
        raise ReplayInputError(
            f"group {samples[0].group_id}: all {total} completion log-probs are exactly 0: the sampler returned no "
            "log-probs, so neither TRL's ratio nor hdreplay's Drift can be computed; request logprobs from the server")


def group_from_samples(samples: Sequence, *, gid=None, birth_step: int | None = None) -> GroupRecord:
    """The group of ``samples`` (one prompt, n completions) as a GroupRecord born at ``birth_step`` (default
    ``model_version - 1``)."""
    first = samples[0]
    P = prompt_length(first)
    prompt = np.asarray(first.input_ids[:P])
    comps, masks, lps, adv, rewards = [], [], [], [], []
    for s in samples:
        if prompt_length(s) != P or not np.array_equal(np.asarray(s.input_ids[:P]), prompt):
            raise ReplayInputError(f"group {s.group_id}: its samples do not share one prompt; hdreplay stores a group "
                                   "as one prompt with n completions (multi-turn forks are not supported)")
        comps.append(torch.as_tensor(np.asarray(s.input_ids[P:])))
        masks.append(torch.as_tensor(np.asarray(s.completion_mask[P:])))
        lps.append(torch.as_tensor(np.asarray(s.old_log_probs[P:], dtype=np.float32)))
        adv.append(float(s.advantage))
        rewards.append(float(s.metrics.get("reward", s.advantage)))
    rows = rows_from_responses(torch.as_tensor(prompt), comps, lps, loss_masks=masks, advantages=adv,
                               rewards=rewards)
    birth = int(first.model_version) - 1 if birth_step is None else birth_step
    return one_group(rows, step=birth, group_id=first.group_id if gid is None else gid)


def samples_from_group(group: GroupRecord, *, template, version: int) -> list:
    """The group's n completions as ``RolloutSample``s (``template``: any sample, for its dataclass; None: TRL's
    ``RolloutSample``), stamped with ``version``."""
    template = template or _blank_sample()
    P = group.prompt_ids.numel()
    prompt = group.prompt_ids.long().numpy()
    out = []
    for i, (c, m, lp) in enumerate(zip(group.responses(), group.split(group.loss_mask), group.split(group.logprobs))):
        out.append(dataclasses.replace(
            template, prompt=[], completion=[], input_ids=np.concatenate([prompt, c.long().numpy()]),
            completion_mask=np.concatenate([np.zeros(P, dtype=np.int64), m.long().numpy()]),
            old_log_probs=np.concatenate([np.zeros(P, dtype=np.float32), lp.numpy()]),
            advantage=float(group.advantages[i]), model_version=int(version), group_id=group.group_id,
            metrics={"reward": float(group.rewards[i])}, enqueued_at=None))
    return out


def _blank_sample():
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    z = np.zeros(0, dtype=np.int64)
    return RolloutSample(prompt=[], completion=[], input_ids=z, completion_mask=z, old_log_probs=z.astype(np.float32),
                         advantage=0.0, model_version=0, group_id=0, metrics={})


#: the array fields of a RolloutSample kept in a checkpoint, with the dtypes they may have
_ARRAYS = {"input_ids": ("int64", "int32"), "completion_mask": ("int64", "int32", "bool"),
           "old_log_probs": ("float32", "float64")}


def _float(x: float):
    return x if np.isfinite(x) else repr(float(x))  # JSON has no NaN / inf: "nan", "inf", "-inf"


def sample_to_json(sample) -> dict:
    """What TRL's dataset reads of a ``RolloutSample`` (prompt / completion messages are not kept), as JSON."""
    out = {k: [np.asarray(getattr(sample, k)).dtype.name, np.asarray(getattr(sample, k)).tolist()] for k in _ARRAYS}
    out["old_log_probs"][1] = [_float(x) for x in out["old_log_probs"][1]]
    out.update(advantage=_float(float(sample.advantage)), model_version=int(sample.model_version),
               group_id=sample.group_id, enqueued_at=sample.enqueued_at,
               metrics={str(k): _float(float(v)) for k, v in dict(sample.metrics).items()})
    return out


def sample_from_json(d, *, template=None):
    """The ``RolloutSample`` of :func:`sample_to_json` (CheckpointError saying what is malformed)."""
    from ....errors import CheckpointError

    def real(x):
        if isinstance(x, str) and x in ("nan", "inf", "-inf"):
            return float(x)
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise CheckpointError(f"routed sample: {x!r:.40} is not a number")
        return float(x)

    keys = {*_ARRAYS, "advantage", "model_version", "group_id", "enqueued_at", "metrics"}
    if not isinstance(d, dict) or set(d) != keys:
        raise CheckpointError(f"routed sample: expected the fields {sorted(keys)}, got {d!r:.80}")
    arrays = {}
    for k, dtypes in _ARRAYS.items():
        v = d[k]
        if not (isinstance(v, list) and len(v) == 2 and v[0] in dtypes and isinstance(v[1], list)):
            raise CheckpointError(f"routed sample: {k} must be [dtype in {dtypes}, values], got {v!r:.80}")
        vals = [real(x) for x in v[1]] if k == "old_log_probs" else v[1]
        if k != "old_log_probs" and not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise CheckpointError(f"routed sample: {k} must hold ints")
        arrays[k] = np.asarray(vals, dtype=v[0])
    if len({a.shape for a in arrays.values()}) != 1 or arrays["input_ids"].ndim != 1:
        raise CheckpointError(f"routed sample: input_ids, completion_mask and old_log_probs must be 1-D and of one "
                              f"length, got {[a.shape for a in arrays.values()]}")
    mv, gid, at, met = d["model_version"], d["group_id"], d["enqueued_at"], d["metrics"]
    if isinstance(mv, bool) or not isinstance(mv, int) or isinstance(gid, bool) or not isinstance(gid, (int, str)):
        raise CheckpointError(f"routed sample: model_version must be an int and group_id an int or str, got "
                              f"{mv!r:.20} / {gid!r:.20}")
    if at is not None:
        at = real(at)
    if not isinstance(met, dict):
        raise CheckpointError(f"routed sample: metrics must be a mapping, got {met!r:.40}")
    return dataclasses.replace(template or _blank_sample(), prompt=[], completion=[], **arrays,
                               advantage=real(d["advantage"]), model_version=mv, group_id=gid,
                               metrics={k: real(v) for k, v in met.items()}, enqueued_at=at)


def _row(groups: Sequence[GroupRecord]):
    """TRL's TreeRow of the groups' completions, every completion token a loss term (tool tokens too: the scorer
    returns a log-prob per completion token; Drift reads the loss-mask ones)."""
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for g in groups:
        P = g.prompt_ids.numel()
        for c in g.responses():
            ids = torch.cat([g.prompt_ids.long(), c.long()])
            row.add({"input_ids": ids, "completion_mask": torch.cat([torch.zeros(P, dtype=torch.long),
                                                                     torch.ones(c.numel(), dtype=torch.long)]),
                     "old_log_probs": torch.zeros(ids.numel()), "advantage": 0.0, "group_id": g.group_id})
    return row


@torch.no_grad()
def tree_logprobs(model, groups: Sequence[GroupRecord], *, device) -> list[torch.Tensor]:
    """Current-policy log-probs of the groups' stored completions: G flat ``(T_g,)`` tensors.

    One forward over TRL's tree-packed row (the prompt of a group forwarded once), called exactly as TRL's
    ``compute_loss`` calls the model (tree attention, ``fused_lm_head``), so the numbers are the loss's."""
    packed = _row(groups).pack()
    s = lambda k: packed[k].to(device)  # noqa: E731
    out = model(input_ids=s("input_ids")[None], position_ids=s("position_ids")[None],
                shift_labels=s("shift_labels")[None], fused_lm_head=True, tree_kv_index=s("tree_kv_index"),
                tree_cu_seqlens_q=s("tree_cu_seqlens_q"), tree_cu_seqlens_k=s("tree_cu_seqlens_k"),
                tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]))
    lp = out.log_probs.flatten()[s("token_index")].float().cpu()
    seg = packed["segment_id"]
    per_sample = [lp[seg == i] for i in range(int(seg.max()) + 1)]
    result, i = [], 0
    for g in groups:
        result.append(torch.cat(per_sample[i:i + g.num_responses]))
        i += g.num_responses
    return result
