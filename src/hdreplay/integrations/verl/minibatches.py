"""Row order of an actor batch for verl's dispatch and mini-batch iteration (v0 and v1 alike).

How verl 0.9.1 trains an actor batch of N rows (``_update_actor`` -> ``update_actor`` nd-dispatch ->
``TrainingWorker.train_mini_batch``), identical on the v0 (``DataProto``) and v1 (``KVBatchMeta``) paths:

1. the batch is cut into ``dp`` contiguous slices; rank r gets rows ``[r*N/dp, (r+1)*N/dp)``;
2. each rank iterates its slice in order (``actor.shuffle=false``) in mini-batches of
   ``m/dp`` rows, m = ``ppo_mini_batch_size * rollout.n``; ``make_iterator`` asserts that they divide
   exactly (no remainder mini-batch); global mini-batch k = the k-th mini-batch of every rank, one
   optimizer step each.

:func:`actor_order` permutes the rows so that the rows rank r trains in global mini-batch k are exactly
``hdreplay.integrations.layout.minibatch_layout(...)[k][r]``: mini-batches are consecutive slices of
``[replay ; fresh]`` (replay fills the first ones), each balanced over the ranks by token count.

The v1 recipe pads ``[replay ; fresh]`` with :func:`padding_needed` zero-loss rows placed after the fresh
rows, so the last global mini-batch is the only one that holds them: with verl's default token-mean loss
that is exactly a smaller last mini-batch (padding rows add no loss and no loss tokens), which is what
lets v1 replay any number of groups (truncation unit u = 1 group).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..layout import minibatch_layout


def padding_needed(num_rows: int, *, minibatch_rows: int) -> int:
    """Zero-loss rows that complete ``num_rows`` to whole mini-batches of ``minibatch_rows`` (0..m-1)."""
    if minibatch_rows < 1 or num_rows < 0:
        raise ValueError(f"need num_rows >= 0 and minibatch_rows >= 1, got {num_rows}, {minibatch_rows}")
    return -num_rows % minibatch_rows


def actor_order(replay_lengths: Sequence[int], fresh_lengths: Sequence[int], *, minibatch_rows: int,
                dp: int) -> tuple[np.ndarray, list[list[list[int]]]]:
    """Row permutation of ``[replay ; fresh]`` for verl's contiguous dispatch + sequential mini-batches.

    Args:
        replay_lengths: (Rr,) tokens per replay row; fresh_lengths: (F,) tokens per fresh row (v1: padding
            rows appended at the end).
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
