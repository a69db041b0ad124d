"""Actor-batch layout: replay prefix, truncation to a multiple of u, length-balanced partitioning.

The paper's batch (Appendix F): ``[replay groups ; fresh groups]`` split
sequentially into mini-batches, so replay fills the first mini-batches and is
consumed first; each mini-batch is then spread over P data-parallel ranks so
that every rank gets the same number of rows and nearly the same token load.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from .errors import ReplayInputError


def truncate_to_multiple(items: Sequence, u: int) -> list:
    """Keep the first ``u * floor(len / u)`` items (the highest-priority prefix)."""
    if not isinstance(u, int) or u < 1:
        raise ReplayInputError(f"u must be an int >= 1, got {u!r}")
    return list(items)[: (len(items) // u) * u]


def replay_prefix_order(num_replay_rows: int, num_fresh_rows: int) -> np.ndarray:
    """Row order of the actor batch when replay rows are stacked before fresh rows: ``[R ; F]``.

    Returns: (num_replay_rows + num_fresh_rows,) int64 — the identity, stated once so that
    callers never shuffle across the boundary.
    """
    if num_replay_rows < 0 or num_fresh_rows < 0:
        raise ReplayInputError("row counts must be >= 0")
    return np.arange(num_replay_rows + num_fresh_rows, dtype=np.int64)


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split rows into ``parts`` equal-count parts with nearly equal total length.

    Greedy longest-first assignment to the lightest part that still has room (ties:
    lower part index, then lower row index), then each part sorted by row index so
    relative order inside a part is preserved.

    Args:
        lengths: (N,) row lengths (e.g. prompt + completion tokens); N divisible by ``parts``.
        parts:   P >= 1.
    Returns:
        P lists of row indices, each of length N / P.
    """
    n = len(lengths)
    if not isinstance(parts, int) or parts < 1:
        raise ReplayInputError(f"parts must be an int >= 1, got {parts!r}")
    if n % parts:
        raise ReplayInputError(f"{n} rows cannot be split into {parts} equal-count parts; pad or drop rows first")
    cap = n // parts
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        load, p = heapq.heappop(heap)
        out[p].append(i)
        if len(out[p]) < cap:  # a full part leaves the heap
            heapq.heappush(heap, (load + int(lengths[i]), p))
    return [sorted(o) for o in out]


def minibatch_layout(
    replay_lengths: Sequence[int], fresh_lengths: Sequence[int], *, num_minibatches: int, parts: int
) -> list[list[list[int]]]:
    """Lay out ``[replay ; fresh]`` rows as mini-batches x ranks.

    Rows are indexed in the concatenated order (replay rows 0..R-1, then fresh). The
    sequence is cut into ``num_minibatches`` consecutive equal slices (replay lands in the
    first ones) and each slice is balanced over ``parts`` ranks.

    Returns: ``layout[k][p]`` = row indices of mini-batch k on rank p.
    """
    lengths = [*replay_lengths, *fresh_lengths]
    n = len(lengths)
    if num_minibatches < 1 or n % num_minibatches:
        raise ReplayInputError(
            f"{n} rows cannot be cut into {num_minibatches} equal mini-batches; "
            "truncate replay to a multiple of the mini-batch size (truncate_multiple)"
        )
    size = n // num_minibatches
    out = []
    for k in range(num_minibatches):
        idx = list(range(k * size, (k + 1) * size))
        parts_k = balanced_partition([lengths[i] for i in idx], parts)
        out.append([[idx[j] for j in part] for part in parts_k])
    return out
