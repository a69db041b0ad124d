"""The v0 actor batch ``[replay ; fresh]`` as one ``DataProto``, laid out by :mod:`.minibatches`.

``RayPPOTrainer._update_actor`` (verl's v0 path) receives the fresh batch as a padded ``DataProto``;
:func:`build_actor_batch` prepends the replay rows (same keys, re-padded to common widths) and
permutes the rows with :func:`.minibatches.actor_order` so that replay fills the first mini-batches
on every rank.  The v0 recipe adds replay in whole mini-batches (no padding rows).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from verl import DataProto

from ...store.record import GroupRecord
from .dataproto import REPLAY_FLAG, pad_batch_tensors, replay_rows
from .minibatches import actor_order, layout_metrics
from .mm import images_seqlens


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
    if "images_seqlens" in meta and "multi_modal_inputs" in non_tensors:  # the flops counter's image sizes
        meta["images_seqlens"] = images_seqlens(non_tensors["multi_modal_inputs"])
    batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
    info = {"order": order, "layout": layout, "lengths": lengths, "num_replay_rows": n_rep,
            "metrics": layout_metrics(layout, lengths, n_rep)}
    return batch, info
