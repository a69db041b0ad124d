"""Which buffered groups are replayed this step: the paper's Algorithm 1, lines 6-14, as one function.

:func:`select_replay` ranks the pre-existing buffer by cached Headroom, walks it, re-scores each group under the
current policy (one teacher-forced pass gives Drift and the runtime Headroom), admits it iff Drift <= tau, and stops
at K_rep admitted groups or the end of the buffer.  It never mutates the buffer: the controller writes the refreshed
Headroom of every scanned group into the cache after the update (Appendix F, "D. Selection").

How Drift is computed is :mod:`hdreplay.rescore`: batched passes with exact early rejection (a group whose forwarded
responses already prove Drift > tau is not forwarded further), which gives the full scan's decisions.  The selectors
(order x gate: the paper's method and its ablations) are the table in :mod:`hdreplay.selectors`; ties in cached
Headroom go to the older group.  Engineering knobs that narrow the walk, all off in :meth:`ReplayConfig.paper`:
``max_scan`` (a cap on groups re-scored per step), ``max_age`` and ``skip_rejected`` (groups left out of the walk).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from . import sampling
from .config import ReplayConfig
from .errors import ReplayInputError
from .rescore import Walk
from .selectors import SELECTORS, BufferView, Selection, SelectorSpec, empty_selection
from .store.record import GroupRecord
from .validate import MAX_TOKENS, check_bool, check_int, check_real, check_step

__all__ = ["MIN_ACCEPTANCE_RATE", "Scorer", "Tau", "select_replay"]

Scorer = Callable[[Sequence[GroupRecord]], Sequence[torch.Tensor]]
"""Takes G stored groups; returns G tensors ``(T_g,)``: current-policy log-probs of every
completion token of the group (responses concatenated, as in ``GroupRecord.completion_ids``)."""

Tau = Callable[[Sequence[GroupRecord]], Sequence[float]]
"""A per-group threshold: takes G groups, returns G numbers >= 0 (a group is admitted iff its Drift <= its own)."""

#: the running acceptance rate never sizes a batch of the walk beyond remaining / MIN_ACCEPTANCE_RATE groups
MIN_ACCEPTANCE_RATE = 0.05


def select_replay(buffer: BufferView, config: ReplayConfig, scorer: Scorer | None, *, step: int,
                  tau: float | Tau | None = None, rng: np.random.Generator | None = None,
                    acceptance_rate: float = 1.0, scan_tokens: int | None = None,
                  latency_bound: bool = True) -> Selection:
    """Choose this step's replay groups from the pre-existing buffer (Algorithm 1; the buffer is not modified).

    Args:
        buffer, config: the buffer to choose from and the replay configuration.
        scorer: current-policy log-probs of stored groups (:data:`Scorer`); needed by the selectors that re-score.
        step: the step selecting (an int in [0, 2**53)).
        tau: the Drift threshold (default ``config.tau``): a number >= 0, or a :data:`Tau` giving each group its own.
        rng: the generator of a random order (the peers of :mod:`hdreplay.baselines`); advanced, state returned.
        acceptance_rate: running gate pass rate in [0, 1]; it only sizes the walk's batches.
        scan_tokens: the token budget of one scorer forward when ``config.scan_tokens`` is unset (a trainer passes its
            own forward's); it sizes the walk's batches and slices only.
        latency_bound: the scorer's device runs a partly filled forward at a full one's cost (a GPU; not a CPU):
            with a budget, a forward's room is scored speculatively and groups start whole where slices save none.
    Returns:
        a :class:`Selection` (read-only arrays; ``groups`` are copies of the stored groups).
    """
    spec, tau = _checked(buffer, config, scorer, tau, rng)
    step, K, u = check_step("step", step), config.unit_budget, config.unit_multiple
    rate = check_real("acceptance_rate", acceptance_rate, lo=0.0, hi=1.0)
    budget = None if scan_tokens is None else check_int("scan_tokens", scan_tokens, lo=1, hi=MAX_TOKENS)
    budget = config.scan_tokens if config.scan_tokens is not None else budget  # the configured one first
    latency_bound = check_bool("latency_bound", latency_bound)
    base = tau if not callable(tau) else float("nan")
    if spec.order is None or K == 0 or len(buffer) == 0:
        return empty_selection(step, spec.name, len(buffer), base)
    order, limit, weights, info = _ranked(buffer, spec, config, step, rng, K)  # l.6: rank by cached Headroom
    if not spec.rescores:  # recency, uniform: the first K_rep of the order, nothing re-scored
        first = order(K)
        keep = len(first) // u * u
        return Selection(step, spec.name, base, first[:keep], buffer.get(first[:keep].tolist()), first[keep:],
                         loss_weights=None if weights is None else weights[:keep], **info)
    _check_budget(buffer, budget, order(limit))
    walk = Walk(order, buffer.get, scorer, limit=limit, k=K, gate=spec.gate, tau=tau, passes=config.scan_passes,
                refresh=config.scan_refresh, drift_norm=config.drift_norm, headroom_weighting=config.headroom_weighting,
                window=(lambda need: _batch(need, rate, config)) if spec.gate else (lambda need: need),
                budget=budget, rate=rate, latency_bound=latency_bound,
                max_groups=config.scan_chunk or config.max_scan_chunk)
    scan, passed = [], []
    for g in walk:                                               # l.7: each group g in that order
        scan.append(g)                                           # l.11-12: one pass gives Drift(g) and runtime H(g)
        passed.append(not spec.gate or g.drift <= g.tau)         # l.13: admit g iff Drift(g) <= tau
        if sum(passed) == K:                                     # l.8-9: stop once K_rep groups are admitted
            break
    admitted = [g for g, ok in zip(scan, passed) if ok]
    keep = len(admitted) // u * u                                # App. F (E): keep a multiple of u, best first
    ids = np.asarray([g.insertion_id for g in scan], dtype=np.int64)
    cost = walk.cost()
    capped = len(admitted) < K and cost.reached >= limit and limit < info["eligible"]
    return Selection(step, spec.name, base, _ids(admitted[:keep]), [g.group for g in admitted[:keep]],
                     _ids(admitted[keep:]), tuple(scan), np.asarray(passed, dtype=bool),
                     buffer.slot_values("cached_headroom", ids), step - buffer.slot_values("birth_step", ids),
                     buffer.slot_values("reject_streak", ids), cost, scan_capped=capped,
                     loss_weights=None if weights is None else weights[:keep], **info)


def _ids(scanned) -> np.ndarray:
    return np.asarray([g.insertion_id for g in scanned], dtype=np.int64)


def _checked(buffer, config, scorer, tau, rng) -> tuple[SelectorSpec, float | Tau]:
    """Every argument of :func:`select_replay` but the step and the rate, checked before anything runs."""
    if not isinstance(buffer, BufferView):
        raise ReplayInputError(f"buffer: must be a ReplayBuffer (a BufferView), got {type(buffer).__name__}")
    if not isinstance(config, ReplayConfig):
        raise ReplayInputError(f"config: must be a ReplayConfig, got {type(config).__name__}")
    spec = SELECTORS[config.selector]
    if scorer is not None and not callable(scorer):
        raise ReplayInputError(f"scorer: must be a callable or None, got {type(scorer).__name__}")
    if scorer is None and spec.rescores and config.k_rep and len(buffer):
        raise ReplayInputError(f"scorer: selector {spec.name!r} re-scores groups under the current policy; "
                               "pass a scorer")
    if spec.random and not isinstance(rng, np.random.Generator):
        raise ReplayInputError(f"rng: selector {spec.name!r} draws at random; pass a numpy Generator")
    if tau is None:
        return spec, config.tau
    return spec, (_per_group(tau) if callable(tau) else check_real("tau", tau, lo=0.0))


def _per_group(tau: Tau) -> Tau:
    def thresholds(groups):
        out = np.asarray(tau(groups), dtype=float)
        if out.shape != (len(groups),) or not np.isfinite(out).all() or (out < 0).any():
            raise ReplayInputError(f"tau: a per-group threshold must return {len(groups)} finite numbers >= 0, "
                                   f"got {out!r:.80}")
        return out.tolist()
    return thresholds


def _ranked(buffer: BufferView, spec: SelectorSpec, config: ReplayConfig, step: int, rng, K: int):
    """The walk: (limit -> its first ids, how far it may go, a random order's loss weights or None, and the
    selection's bookkeeping).  Only eligible groups are walked: within ``max_age`` and not skipped."""
    ids = buffer.insertion_ids()
    ok = np.ones(len(ids), dtype=bool) if config.max_age is None else \
        step - buffer.slot_values("birth_step", ids) <= config.max_age
    skip = buffer.slot_values("skip_until", ids) > step  # rejected widely at an earlier step (skip_rejected)
    info = {"buffer_size": len(buffer), "eligible": int((ok & ~skip).sum()), "skipped": int((ok & skip).sum())}
    ok &= ~skip
    if spec.random:
        drawn, weights = spec.draw(buffer, config, rng, step, K, ok)
        return (lambda limit: drawn[:limit]), len(drawn), weights, {**info, "rng_state": sampling.rng_state(rng)}
    limit = min(info["eligible"], max(K, config.scan_budget))  # an ungated order always takes its K groups
    full = buffer.order_by_cached_headroom if spec.order == "headroom" else buffer.order_by_recency
    if ok.all():
        return full, limit, None, info
    live = set(ids[ok].tolist())
    allowed = np.asarray([i for i in full(len(ids)).tolist() if i in live], dtype=np.int64)
    return (lambda limit: allowed[:limit]), limit, None, info


def _check_budget(buffer: BufferView, budget: int | None, walk: np.ndarray) -> None:
    """A token budget must fit every group the walk may forward whole (checked before any forward)."""
    if budget is None or not len(walk):
        return
    if not hasattr(buffer, "forward_tokens"):
        raise ReplayInputError("scan_tokens: a token budget needs a buffer that counts its groups' tokens "
                               "(ReplayBuffer.forward_tokens); leave it unset for this buffer")
    tokens = buffer.forward_tokens(walk)
    j = int(np.argmax(tokens))
    if tokens[j] > budget:
        raise ReplayInputError(
            f"scan_tokens: a token budget of {budget} per forward cannot fit buffered group "
            f"{buffer.group_ids([int(walk[j])])[0]!r} ({int(tokens[j])} tokens: n x prompt + completion); raise it to "
            f">= {int(tokens[j])} or leave it unset")


def _batch(remaining: int, acceptance_rate: float, config: ReplayConfig) -> int:
    """Groups to re-score in one scorer call: ``scan_chunk``, or remaining / running acceptance rate."""
    if config.scan_chunk is not None:
        return config.scan_chunk
    rate = max(float(acceptance_rate), MIN_ACCEPTANCE_RATE)
    return int(min(config.max_scan_chunk, max(1, math.ceil(remaining / rate))))
