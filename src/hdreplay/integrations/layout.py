"""Actor-batch layout: truncation to a multiple of u, length-balanced partitioning, mini-batches.

Used by the verl recipe (:mod:`hdreplay.integrations.verl.minibatches`); it lives beside ``common.py`` rather than
under ``integrations/verl`` so that it imports without verl (the verl package refuses to import without it).
Moved here from ``hdreplay.layout``, which still resolves (deprecated).

The paper's batch (Appendix F): ``[replay groups ; fresh groups]`` split
sequentially into mini-batches, so replay fills the first mini-batches and is
consumed first; each mini-batch is then spread over P data-parallel ranks so
that every rank gets the same number of rows and nearly the same token load.
"""

from __future__ import annotations

import heapq
import warnings
from typing import Sequence

import numpy as np
import torch

from ..errors import ReplayInputError
from ..validate import MAX_COUNT, MAX_PARTS, MAX_STEP, check_int, check_sequence, is_int


def _lengths(name: str, value) -> list[int]:
    """Row lengths: a list/tuple of ints >= 0, or a 1-D integer NumPy array / torch tensor."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iu"):
            raise ReplayInputError(f"{name}: must be a 1-D integer array, got {value.dtype} {value.shape}")
        value = value.tolist()
    out = check_sequence(name, value)
    if not all(is_int(x) and 0 <= x < MAX_STEP for x in out):
        raise ReplayInputError(f"{name}: must hold ints >= 0 (row lengths), "
                               f"got {out[:8]}{'...' if len(out) > 8 else ''}")
    return [int(x) for x in out]


def truncate_to_multiple(items: Sequence, u: int) -> list:
    """Deprecated (nothing in the library calls it; the replay list is cut by ``ReplayConfig(truncate_multiple=u)``
    inside ``select_replay``): the first ``u * floor(len / u)`` items of a list/tuple/1-D array."""
    warnings.warn("hdreplay.truncate_to_multiple is deprecated and will be removed in the release after next; "
                  "ReplayConfig(truncate_multiple=u) cuts the replay list inside select_replay", DeprecationWarning,
                  stacklevel=2)
    u = check_int("u", u, lo=1, hi=MAX_COUNT)
    if isinstance(items, np.ndarray) and items.ndim == 1:
        items = items.tolist()
    items = check_sequence("items", items)
    return items[: (len(items) // u) * u]


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split rows into ``parts`` equal-count parts with nearly equal total length.

    Greedy longest-first assignment to the lightest part that still has room (ties:
    lower part index, then lower row index), then each part sorted by row index so
    relative order inside a part is preserved.

    Args:
        lengths: (N,) row lengths (e.g. prompt + completion tokens); N divisible by ``parts``.
        parts:   P >= 1.
    Returns:
        P lists of row indices, each of length N / P (N = 0 gives P empty lists).
    """
    lengths = _lengths("lengths", lengths)
    parts = check_int("parts", parts, lo=1, hi=MAX_PARTS)
    n = len(lengths)
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
    lengths = [*_lengths("replay_lengths", replay_lengths), *_lengths("fresh_lengths", fresh_lengths)]
    num_minibatches = check_int("num_minibatches", num_minibatches, lo=1, hi=MAX_COUNT)
    check_int("parts", parts, lo=1, hi=MAX_PARTS)
    n = len(lengths)
    if n % num_minibatches:
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
