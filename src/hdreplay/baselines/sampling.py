"""Seeded stochastic orders of the peer strategies (pure functions of an explicit generator).

Every function takes an explicit :class:`numpy.random.Generator` (:func:`hdreplay.sampling.new_rng`) and never
touches global random state.

==========================  ========================================================================
uniform_order               k items uniformly without replacement (a prefix of a random permutation)
proportional_order          k items without replacement, successively proportional to weights w_i
                            (Efraimidis-Spirakis keys u_i^(1/w_i); zero weights are never drawn)
importance_weights          PER's (N P(i))^(-beta) / max_j (N P(j))^(-beta), the max over all N items
normal_bucket_weights       ExGRPO's bucket weights N(k; mu = n/2, sigma = 1) over success counts k
bucket_counts               a multinomial draw of counts over buckets, excess draws moved to buckets with
                            room in proportion to the weights (ExGRPO's overflow rule)
==========================  ========================================================================

>>> from hdreplay.sampling import new_rng
>>> sorted(uniform_order(new_rng(0), 10, 3).tolist()) == sorted(set(uniform_order(new_rng(0), 10, 3).tolist()))
True
>>> proportional_order(new_rng(0), [0.0, 1.0, 0.0], 3).tolist()  # weight 0 is never drawn
[1]
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ReplayInputError
from ..validate import check_int, check_real


def _weights(name: str, w) -> np.ndarray:
    a = np.asarray(w, dtype=np.float64)
    if a.ndim != 1 or not np.isfinite(a).all() or (a < 0).any():
        raise ReplayInputError(f"`{name}` must be a 1-D array of finite non-negative numbers, got {w!r:.80}")
    return a


def uniform_order(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """(min(k, n),) int64 positions in [0, n), uniformly without replacement, in draw order."""
    n, k = check_int("n", n), check_int("k", k)
    return rng.permutation(n)[:min(k, n)].astype(np.int64)


def proportional_order(rng: np.random.Generator, weights, k: int) -> np.ndarray:
    """Positions drawn without replacement, each draw proportional to ``weights`` among those left.

    Args:
        weights: (N,) finite, >= 0; items of weight 0 are never drawn.
        k: draws wanted; fewer come back when fewer than k items have positive weight.
    Returns:
        (m,) int64 positions in draw order (the order of successive sampling; Efraimidis & Spirakis 2006).
    """
    w = _weights("weights", weights)
    k = check_int("k", k)
    pos = np.flatnonzero(w > 0)
    if pos.size == 0 or k == 0:
        return np.zeros(0, dtype=np.int64)
    u = rng.random(pos.size)
    keys = np.log(np.maximum(u, np.finfo(np.float64).tiny)) / w[pos]  # log(u^(1/w)): larger is earlier
    order = np.argsort(-keys, kind="stable")[:min(k, pos.size)]
    return pos[order].astype(np.int64)


def importance_weights(probabilities, chosen, beta: float) -> np.ndarray:
    """PER importance weights of the ``chosen`` positions: (N P(i))^(-beta) normalised by the largest weight over
    all N items (the one of smallest probability), so every weight is in (0, 1].

    Args:
        probabilities: (N,) sampling probabilities (>= 0, summing to 1 over the items that can be drawn).
        chosen: (m,) positions whose weight is wanted (each with probability > 0).
        beta: the exponent in [0, 1]; 0 gives weights 1.
    """
    p = _weights("probabilities", probabilities)
    beta = check_real("beta", beta, lo=0.0, hi=1.0)
    idx = np.asarray(chosen, dtype=np.int64)
    live = p[p > 0]
    if idx.size and (idx.min() < 0 or idx.max() >= p.size or (p[idx] <= 0).any()):
        raise ReplayInputError("chosen: positions must index items of positive probability")
    if idx.size == 0:
        return np.zeros(0)
    n = live.size
    return (n * p[idx]) ** (-beta) / (n * live.min()) ** (-beta)


def normal_bucket_weights(ks, n: int, sigma: float = 1.0) -> np.ndarray:
    """ExGRPO's "normal" bucket weights: the N(mu = n/2, sigma) density at each success count k (count units, as
    the released code's ``weighted_bucket_sampler.py``)."""
    n = check_int("n", n, lo=1)
    sigma = check_real("sigma", sigma, lo=0.0, lo_open=True)
    k = np.asarray(ks, dtype=np.float64)
    return np.exp(-0.5 * ((k - n / 2) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def bucket_counts(rng: np.random.Generator, sizes, weights, total: int) -> np.ndarray:
    """How many items to take from each bucket: ``total`` draws ~ Multinomial(P = weights / sum over non-empty
    buckets); while a bucket got more draws than it holds, one excess draw moves to a bucket with room, chosen in
    proportion to the weights (ExGRPO's overflow rule).  Returns (B,) int64 counts, each <= its size, summing to
    min(total, sum(sizes))."""
    sz = np.asarray(sizes, dtype=np.int64)
    w = _weights("weights", weights)
    if sz.shape != w.shape or (sz < 0).any():
        raise ReplayInputError("sizes and weights must be (B,) arrays of the same length, sizes >= 0")
    total = min(check_int("total", total), int(sz.sum()))
    live = (sz > 0) & (w > 0)
    if total == 0 or not live.any():
        return np.zeros_like(sz)
    p = np.where(live, w, 0.0)
    counts = rng.multinomial(total, p / p.sum()).astype(np.int64)
    while (counts > sz).any():
        over = int(np.flatnonzero(counts > sz)[0])
        room = np.where((counts < sz) & live, p, 0.0)
        if room.sum() <= 0:  # only zero-weight buckets have room: take them in order
            room = (counts < sz).astype(np.float64)
        counts[over] -= 1
        counts[int(rng.choice(len(sz), p=room / room.sum()))] += 1
    return counts
