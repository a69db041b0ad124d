"""The actor batch ``[replay ; fresh]`` arranged for verl's dispatch and mini-batch iteration.

How verl 0.9.1 trains an actor batch of N rows (``RayPPOTrainer._update_actor`` ->
``update_actor`` nd-dispatch -> ``TrainingWorker.train_mini_batch``):

1. the batch is cut into ``dp`` contiguous slices; rank r gets rows ``[r*N/dp, (r+1)*N/dp)``;
2. each rank iterates its slice in order (``actor.shuffle=false``) in mini-batches of
   ``m/dp`` rows, m = ``ppo_mini_batch_size * rollout.n``; global mini-batch k = the k-th
   mini-batch of every rank, one optimizer step each.

:func:`actor_order` permutes the rows so that the rows rank r trains in global mini-batch k are
exactly ``hdreplay.layout.minibatch_layout(...)[k][r]``: mini-batches are consecutive slices of
``[replay ; fresh]`` (replay fills the first ones), each balanced over the ranks by token count.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from verl import DataProto

from ...layout import minibatch_layout
from ...record import GroupRecord
from .dataproto import REPLAY_FLAG, pad_batch_tensors, replay_rows


def actor_order(replay_lengths: Sequence[int], fresh_lengths: Sequence[int], *, minibatch_rows: int,
                dp: int) -> tuple[np.ndarray, list[list[list[int]]]]:
    """Row permutation of ``[replay ; fresh]`` for verl's contiguous dispatch + sequential mini-batches.

    Args:
        replay_lengths: (Rr,) tokens per replay row; fresh_lengths: (F,) tokens per fresh row.
        minibatch_rows: m, rows per global mini-batch; dp: data-parallel ranks (m % dp == 0).
    Returns:
        (order, layout): ``order`` (N,) int64 with ``actor_batch = concat[order]``; ``layout[k][r]``
        = rows (indices into ``[replay ; fresh]``) that rank r trains in global mini-batch k.
    """
    n = len(replay_lengths) + len(fresh_lengths)
    if dp < 1 or minibatch_rows % dp:
        raise RuntimeError(f"mini-batch of {minibatch_rows} rows cannot be split over dp={dp} ranks; verl needs "
                           "ppo_mini_batch_size * rollout.n to be a multiple of the actor's data-parallel size")
    if n % minibatch_rows:
        raise RuntimeError(f"{n} actor rows do not fill whole mini-batches of {minibatch_rows}; replay rows must be "
                           "a multiple of the mini-batch (this is a bug in hdreplay's truncation unit, please report)")
    layout = minibatch_layout(list(replay_lengths), list(fresh_lengths), num_minibatches=n // minibatch_rows, parts=dp)
    order = [i for r in range(dp) for mb in layout for i in mb[r]]
    return np.asarray(order, dtype=np.int64), layout


def rank_minibatches(order: Sequence[int], *, minibatch_rows: int, dp: int) -> list[list[list[int]]]:
    """What verl trains given ``order``: ``[k][r]`` = original row indices of rank r's k-th mini-batch
    (contiguous dp slices, then sequential slices of m/dp rows; mirrors the worker path)."""
    order = list(order)
    per_rank, per_mb = len(order) // dp, minibatch_rows // dp
    return [[order[r * per_rank + k * per_mb: r * per_rank + (k + 1) * per_mb] for r in range(dp)]
            for k in range(per_rank // per_mb)]


def layout_metrics(layout: list[list[list[int]]], lengths: Sequence[int], num_replay_rows: int) -> dict[str, float]:
    """Flat metrics: the largest per-mini-batch gap between the most and least loaded rank (tokens),
    and how many global mini-batches hold replay rows."""
    gap, replay_mbs = 0, 0
    for mb in layout:
        loads = [sum(int(lengths[i]) for i in part) for part in mb]
        gap = max(gap, max(loads) - min(loads))
        replay_mbs += any(i < num_replay_rows for part in mb for i in part)
    return {"replay/layout_token_gap": float(gap), "replay/minibatches_with_replay": float(replay_mbs),
            "replay/actor_minibatches": float(len(layout))}


def build_actor_batch(groups: Sequence[GroupRecord], fresh: DataProto, *, minibatch_rows: int, dp: int,
                      pad_token_id: int) -> tuple[DataProto, dict]:
    """``[replay rows of groups ; fresh rows]``, permuted by :func:`actor_order`, as one DataProto.

    Both parts carry exactly the fresh batch's keys (replay rows filled by :func:`replay_rows`) plus
    the non-tensor flag ``hdr_replay``; widths are the larger of the two parts.  ``meta_info`` is the
    fresh batch's with ``global_token_num`` recomputed for the new rows.

    Returns (actor_batch, info) with info = {"order", "layout", "lengths" (tokens per row of
    ``[replay ; fresh]``), "num_replay_rows", "metrics"}.
    """
    f_t = {k: v for k, v in fresh.batch.items()}
    f_nt = dict(fresh.non_tensor_batch)
    f_nt[REPLAY_FLAG] = np.zeros(len(fresh), dtype=bool)
    P, R = f_t["prompts"].shape[1], f_t["responses"].shape[1]
    if groups:
        need_p = max(g.prompt_ids.numel() for g in groups)
        need_r = max(int(g.response_lengths.max()) for g in groups)
        P2, R2 = max(P, need_p), max(R, need_r)
        r_t, r_nt = replay_rows(groups, like=fresh, P=P2, R=R2, pad_token_id=pad_token_id)
        if (P2, R2) != (P, R):
            f_t = pad_batch_tensors(f_t, P=P2, R=R2, old_P=P, pad_token_id=pad_token_id)
        tensors = {k: torch.cat([r_t[k], f_t[k].cpu()], dim=0) for k in f_t}
        non_tensors = {k: np.concatenate([r_nt[k], f_nt[k]], axis=0) for k in f_nt}
        n_rep = len(r_nt[REPLAY_FLAG])
    else:
        tensors, non_tensors, n_rep = {k: v.cpu() for k, v in f_t.items()}, f_nt, 0
    lengths = tensors["attention_mask"].sum(dim=-1).tolist()
    order, layout = actor_order(lengths[:n_rep], lengths[n_rep:], minibatch_rows=minibatch_rows, dp=dp)
    idx = torch.from_numpy(order)
    tensors = {k: v[idx] for k, v in tensors.items()}
    non_tensors = {k: v[order] for k, v in non_tensors.items()}
    meta = dict(fresh.meta_info)
    meta["global_token_num"] = tensors["attention_mask"].sum(dim=-1).tolist()
    batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
    info = {"order": order, "layout": layout, "lengths": lengths, "num_replay_rows": n_rep,
            "metrics": layout_metrics(layout, lengths, n_rep)}
    return batch, info
