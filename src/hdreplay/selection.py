"""The scan: which buffered groups are replayed this step.

Selection is a function of (buffer view, scorer, config, step) that returns a
:class:`~hdreplay.selectors.Selection` and never mutates the buffer; the controller applies the
cache refresh and counters after the update.

Every selector is an (order, gate) pair, declared in :mod:`hdreplay.selectors` (the table of
names lives there; ``SELECTORS``, ``SelectorSpec``, ``Selection`` and ``empty_selection`` are
re-exported here).

Ties in cached Headroom go to the older group (smaller insertion id).  The random orders draw from the
controller's seeded generator (:mod:`hdreplay.sampling`), whose state is checkpointed with the buffer;
``adv_priority`` stores single rollouts (``unit="rollout"``, see :mod:`hdreplay.controller`).  With
``max_age`` set, no group older than ``max_age`` steps is ever selected, whatever the order.

The scan (paper Appendix A.5, Proposition 3): walk the order, re-score each group
under the current policy through the caller's ``scorer``, accept iff Drift <= tau,
stop at K_rep accepted or the end of the buffer.  Groups are re-scored in chunks
(one scorer call per chunk); groups of the last chunk that lie beyond the stopping
index m* are *not* scanned (their result is discarded, their cache not refreshed),
so the outcome equals a one-group-at-a-time scan exactly.  Ungated orders need
no scoring except ``headroom_only``, whose same-pass refresh keeps its priority
current (the PER analogue of updating priorities when sampled).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch

from . import sampling
from .config import ReplayConfig
from .errors import ReplayInputError
from .record import GroupRecord
from .scores import check_scorer_output, score_groups
from .selectors import PRIORITY_EPS, SELECTORS, BufferView, Selection, SelectorSpec, empty_selection
from .selectors import frozen as _frozen
from .validate import check_real, check_reals, check_step

__all__ = ["BufferView", "MIN_ACCEPTANCE_RATE", "PRIORITY_EPS", "SELECTORS", "Scorer", "Selection", "SelectorSpec",
           "chunk_size", "empty_selection", "priorities", "select_replay"]

Scorer = Callable[[Sequence[GroupRecord]], Sequence[torch.Tensor]]
"""Takes G stored groups; returns G tensors ``(T_g,)``: current-policy log-probs of every
completion token of the group (responses concatenated, as in ``GroupRecord.completion_ids``)."""

DriftFloor = Callable[[Sequence[GroupRecord]], Sequence[float]]
"""Takes G scanned groups; returns G floors >= 0 subtracted from their Drift before the gate (asynchronous
pipelines whose stored log-probs are the sampler's, see :mod:`hdreplay.staleness`)."""

#: the running acceptance rate never drives chunk sizes beyond remaining / MIN_RATE.
MIN_ACCEPTANCE_RATE = 0.05


def chunk_size(remaining: int, acceptance_rate: float, config: ReplayConfig) -> int:
    """Groups to re-score next: the configured ``scan_chunk`` or remaining / running acceptance rate."""
    if config.scan_chunk is not None:
        return config.scan_chunk
    rate = max(float(acceptance_rate), MIN_ACCEPTANCE_RATE)
    return int(min(config.max_scan_chunk, max(1, math.ceil(remaining / rate))))


def _eligible(buffer: BufferView, config: ReplayConfig, step: int) -> np.ndarray:
    """(size,) bool, oldest first: within ``max_age`` steps of ``step`` (all True when max_age is unset)."""
    ids = buffer.insertion_ids()
    if config.max_age is None:
        return np.ones(len(ids), dtype=bool)
    return step - buffer.slot_values("birth_step", ids) <= config.max_age


def priorities(buffer: BufferView, config: ReplayConfig, step: int) -> np.ndarray:
    """(size,) oldest first: the base priority of every live unit ("reward": mean |r_i| + eps, "advantage":
    mean |A_i|) times exp(-age / age_decay) when ``age_decay`` is set (FreshPER's freshness factor)."""
    spec = SELECTORS[config.selector]
    base = buffer.group_means("rewards" if spec.priority == "reward" else "advantages")
    if spec.priority == "reward":
        base = base + PRIORITY_EPS
    if config.age_decay is not None:
        ages = step - buffer.slot_values("birth_step", buffer.insertion_ids())
        base = base * np.exp(-ages / config.age_decay)
    return base


def _random_order(buffer: BufferView, config: ReplayConfig, rng: np.random.Generator, step: int, k: int,
                  ok: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids drawn in order, their loss weights or None) of a random order over the eligible units ``ok``."""
    spec, ids = SELECTORS[config.selector], buffer.insertion_ids()
    pos = np.flatnonzero(ok)
    if spec.order == "uniform":
        return ids[pos[sampling.uniform_order(rng, len(pos), k)]], None
    w = priorities(buffer, config, step)[pos] ** config.priority_alpha
    drawn = sampling.proportional_order(rng, w, k)
    weights = None
    if config.is_beta > 0 and len(drawn):
        weights = sampling.importance_weights(w / w.sum(), drawn, config.is_beta)
    return ids[pos[drawn]], weights


def select_replay(
    buffer: BufferView,
    config: ReplayConfig,
    scorer: Scorer | None,
    *,
    step: int,
    acceptance_rate: float = 1.0,
    tau: float | None = None,
    rng: np.random.Generator | None = None,
    drift_floor: DriftFloor | None = None,
) -> Selection:
    """Choose this step's replay groups from the pre-existing buffer (does not modify it).

    Args:
        buffer, config: the buffer to choose from and the replay configuration.
        scorer: current-policy log-probs of stored groups (see :data:`Scorer`); required by the
            selectors that re-score (all but ``recency`` without ``diagnose_ungated``, and ``none``).
        step: the step selecting (an int in [0, 2**53)).
        acceptance_rate: running gate pass rate in [0, 1] that sizes the scan chunks.
        tau: overrides ``config.tau`` (used by the adaptive-tau controller); finite, >= 0.
        rng: the generator of the random orders (uniform, freshper, adv_priority); required by them.  It is
            advanced; its state afterwards is returned in ``Selection.rng_state``.
        drift_floor: per scanned group, a floor subtracted from its Drift before the gate (see :data:`DriftFloor`).
    Returns:
        a :class:`Selection` with read-only arrays; its ``groups`` are copies of the stored groups.
    """
    if not isinstance(buffer, BufferView):
        raise ReplayInputError(f"buffer: must be a ReplayBuffer (a BufferView), got {type(buffer).__name__}")
    if not isinstance(config, ReplayConfig):
        raise ReplayInputError(f"config: must be a ReplayConfig, got {type(config).__name__}")
    if scorer is not None and not callable(scorer):
        raise ReplayInputError(f"scorer: must be a callable or None, got {type(scorer).__name__}")
    if drift_floor is not None and not callable(drift_floor):
        raise ReplayInputError(f"drift_floor: must be a callable or None, got {type(drift_floor).__name__}")
    step = check_step("step", step)
    acceptance_rate = check_real("acceptance_rate", acceptance_rate, lo=0.0, hi=1.0)
    tau = config.tau if tau is None else check_real("tau", tau, lo=0.0)
    spec = SELECTORS[config.selector]
    if spec.random and not isinstance(rng, np.random.Generator):
        raise ReplayInputError(f"rng: selector {spec.name!r} draws at random; pass a numpy Generator")
    K, size, u = config.unit_budget, len(buffer), config.unit_multiple
    if spec.order is None or K == 0 or size == 0:
        return empty_selection(step, spec.name, size, tau)
    ok = _eligible(buffer, config, step)
    weights = None
    if spec.random:
        drawn, weights = _random_order(buffer, config, rng, step, K, ok)
        order_fn = lambda limit: drawn[:limit]  # noqa: E731
    else:
        full = buffer.order_by_cached_headroom if spec.order == "headroom" else buffer.order_by_recency
        if config.max_age is None:
            order_fn = full
        else:  # the whole order, then the eligible part of it (ages are checked on every id)
            live = set(buffer.insertion_ids()[ok].tolist())
            allowed = np.asarray([i for i in full(size).tolist() if i in live], dtype=np.int64)
            order_fn = lambda limit: allowed[:limit]  # noqa: E731
    eligible = int(ok.sum())

    if not spec.needs_scoring(config.diagnose_ungated):
        kept, cut = _truncate(order_fn(K), u)
        sel = empty_selection(step, spec.name, size, tau)
        sel.accepted, sel.truncated, sel.groups = kept, cut, buffer.get(kept.tolist())
        sel.loss_weights = None if weights is None else weights[:len(kept)]
        sel.rng_state, sel.eligible = _state(rng, spec), eligible
        return _frozen(sel)

    if scorer is None:
        raise ReplayInputError(f"scorer: selector {spec.name!r} re-scores groups under the current policy; "
                               "pass a scorer")
    scanned: list[int] = []
    cols: dict[str, list] = {k: [] for k in ("drift", "headroom", "kl", "pass", "tokens", "floor")}
    accepted: list[int] = []
    accepted_groups: list[GroupRecord] = []
    limit = min(eligible, max(K, config.scan_budget))  # an ungated order always takes its K groups
    if spec.random:
        limit = len(drawn)
    prefix = order_fn(min(limit, max(K, chunk_size(K, acceptance_rate, config))))
    pos, calls, unused, chunks, cost = 0, 0, 0, [], [0, 0]
    while len(accepted) < K and pos < limit:
        want = chunk_size(K - len(accepted), acceptance_rate, config) if spec.gate else K - len(accepted)
        want = min(want, limit - pos)
        if pos + want > len(prefix) and len(prefix) < limit:
            prefix = order_fn(min(limit, max(2 * len(prefix), pos + want)))
        ids = prefix[pos:pos + want]
        pos += len(ids)
        groups = buffer.get(ids.tolist())
        lps = check_scorer_output(groups, scorer(groups))
        calls += 1
        cost[0] += sum(g.num_responses for g in groups)
        cost[1] += sum(g.num_tokens for g in groups)
        chunks.append(len(ids))
        sc = score_groups(groups, lps, drift_norm=config.drift_norm, headroom_weighting=config.headroom_weighting)
        d, h, kl, ntok = (sc.drift.tolist(), sc.headroom.tolist(), sc.replay_kl.tolist(),
                          sc.num_loss_tokens.tolist())
        floor = [0.0] * len(d) if drift_floor is None else _floors(drift_floor(groups), len(d))
        d = [max(x - float(f), 0.0) for x, f in zip(d, floor)]
        for j, gid in enumerate(ids.tolist()):
            if len(accepted) == K:
                unused += len(ids) - j
                break
            ok = (not spec.gate) or d[j] <= tau
            scanned.append(gid)
            cols["drift"].append(d[j])
            cols["headroom"].append(h[j])
            cols["kl"].append(kl[j])
            cols["pass"].append(ok)
            cols["tokens"].append(ntok[j])
            cols["floor"].append(float(floor[j]))
            if ok:
                accepted.append(gid)
                accepted_groups.append(groups[j])
    acc = np.asarray(accepted, dtype=np.int64)
    kept, cut = _truncate(acc, u)
    sc_ids = np.asarray(scanned, dtype=np.int64)
    sel = Selection(
        step=step,
        selector=spec.name,
        accepted=kept,
        truncated=cut,
        scanned=sc_ids,
        scanned_drift=np.asarray(cols["drift"]),
        scanned_headroom=np.asarray(cols["headroom"]),
        scanned_kl=np.asarray(cols["kl"]),
        scanned_cached=buffer.slot_values("cached_headroom", sc_ids),
        scanned_age=step - buffer.slot_values("birth_step", sc_ids),
        scanned_pass=np.asarray(cols["pass"], dtype=bool),
        scanned_tokens=np.asarray(cols["tokens"], dtype=np.int64),
        groups=accepted_groups[: len(kept)],
        scored=True,
        scored_unused=unused,
        scorer_calls=calls,
        chunk_sizes=chunks,
        buffer_size=size,
        tau=tau,
        scanned_group_ids=buffer.group_ids(sc_ids),
        scan_capped=len(accepted) < K and pos >= limit and limit < eligible,
        loss_weights=None if weights is None else weights[:len(kept)],
        rng_state=_state(rng, spec),
        eligible=eligible,
        rescored_rows=cost[0],
        rescored_tokens=cost[1],
        scanned_floor=None if drift_floor is None else np.asarray(cols["floor"]),
    )
    if config.counterfactual and len(kept) and spec.name != "recency":
        _counterfactual(sel, buffer, config, scorer, cols)
    return _frozen(sel)


def _counterfactual(sel: Selection, buffer: BufferView, config: ReplayConfig, scorer: Scorer,
                    cols: dict) -> None:
    """Score the subset recency replay would take from the same pre-step buffer (same size).

    Groups already scanned reuse their scores; the others cost one extra scorer call.  Nothing
    here touches the buffer or the scan (no cache refresh for counterfactual-only groups)."""
    rec = buffer.order_by_recency(len(sel.accepted))
    known = {g: j for j, g in enumerate(sel.scanned.tolist())}
    missing = [g for g in rec.tolist() if g not in known]
    extra = {}
    if missing:
        groups = buffer.get(missing)
        sel.rescored_rows += sum(g.num_responses for g in groups)
        sel.rescored_tokens += sum(g.num_tokens for g in groups)
        sc = score_groups(groups, check_scorer_output(groups, scorer(groups)), drift_norm=config.drift_norm,
                          headroom_weighting=config.headroom_weighting)
        extra = {g: (d, h) for g, d, h in zip(missing, sc.drift.tolist(), sc.headroom.tolist())}
    val = lambda g: (cols["drift"][known[g]], cols["headroom"][known[g]]) if g in known else extra[g]  # noqa: E731
    sel.cf_ids = rec
    sel.cf_drift = np.asarray([val(g)[0] for g in rec.tolist()])
    sel.cf_headroom = np.asarray([val(g)[1] for g in rec.tolist()])


def _floors(values, size: int) -> list[float]:
    arr = check_reals("drift_floor", values, size)
    if (arr < 0).any():
        raise ReplayInputError(f"drift_floor: floors must be >= 0, got {arr.min():g}")
    return arr.tolist()


def _state(rng: np.random.Generator | None, spec: SelectorSpec) -> dict | None:
    return sampling.rng_state(rng) if spec.random else None


def _truncate(ids: np.ndarray, u: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the highest-priority prefix of length u * floor(m / u)."""
    keep = (len(ids) // u) * u
    return ids[:keep], ids[keep:]
