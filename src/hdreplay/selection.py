"""The scan: which buffered groups are replayed this step.

Selection is a function of (buffer view, scorer, config, step) that returns a
:class:`~hdreplay.selectors.Selection` and never mutates the buffer; the controller applies the
cache refresh and counters after the update.

Every selector is an (order, gate) pair, declared in :mod:`hdreplay.selectors` (the table of
names lives there; ``SELECTORS``, ``SelectorSpec``, ``Selection`` and ``empty_selection`` are
re-exported here).

Ties in cached Headroom go to the older group (smaller insertion id).  A random order (the peers of
:mod:`hdreplay.baselines.orders`) is its spec's ``draw``, called with the controller's seeded generator
(:mod:`hdreplay.sampling`), whose state is checkpointed with the buffer.  With ``max_age`` set, no group older
than ``max_age`` steps is ever selected, whatever the order.

The scan (paper Appendix A.5, Proposition 3): walk the order, re-score each group
under the current policy through the caller's ``scorer``, accept iff Drift <= tau,
stop at K_rep accepted or the end of the buffer.  Groups are re-scored in windows
(one scorer call per window), each group's responses a slice at a time with exact early
rejection (:mod:`hdreplay.scan`: a group stops being forwarded once its partial Drift
proves Drift > tau); groups of the last window that lie beyond the stopping index m*
are *not* scanned (their result is discarded, their cache not refreshed), so the
decisions equal a one-group-at-a-time scan forwarding whole groups exactly.  Ungated orders need
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
from .scan import _EARLY, _PASS, run_scan
from .scores import check_scorer_output, score_groups
from .selectors import SELECTORS, BufferView, Selection, SelectorSpec, empty_selection
from .selectors import frozen as _frozen
from .validate import check_real, check_reals, check_step

__all__ = ["BufferView", "MIN_ACCEPTANCE_RATE", "SELECTORS", "Scorer", "Selection", "SelectorSpec", "chunk_size",
           "empty_selection", "select_replay"]

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


def _eligible(buffer: BufferView, config: ReplayConfig, step: int) -> tuple[np.ndarray, int]:
    """(size,) bool, oldest first: within ``max_age`` steps of ``step`` and not skipped after a wide gate rejection
    (``skip_rejected``); and how many the skip left out."""
    ids = buffer.insertion_ids()
    ok = np.ones(len(ids), dtype=bool)
    if config.max_age is not None:
        ok = step - buffer.slot_values("birth_step", ids) <= config.max_age
    skip = buffer.slot_values("skip_until", ids) > step
    return ok & ~skip, int((ok & skip).sum())


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
    ok, skipped = _eligible(buffer, config, step)
    weights = None
    if spec.random:
        drawn, weights = spec.draw(buffer, config, rng, step, K, ok)
        order_fn = lambda limit: drawn[:limit]  # noqa: E731
    else:
        full = buffer.order_by_cached_headroom if spec.order == "headroom" else buffer.order_by_recency
        if ok.all():
            order_fn = full
        else:  # the whole order, then the eligible part of it (ages and skips are checked on every id)
            live = set(buffer.insertion_ids()[ok].tolist())
            allowed = np.asarray([i for i in full(size).tolist() if i in live], dtype=np.int64)
            order_fn = lambda limit: allowed[:limit]  # noqa: E731
    eligible = int(ok.sum())

    if not spec.needs_scoring(config.diagnose_ungated):
        kept, cut = _truncate(order_fn(K), u)
        sel = empty_selection(step, spec.name, size, tau)
        sel.accepted, sel.truncated, sel.groups = kept, cut, buffer.get(kept.tolist())
        sel.loss_weights = None if weights is None else weights[:len(kept)]
        sel.rng_state, sel.eligible, sel.skipped = _state(rng, spec), eligible, skipped
        return _frozen(sel)

    if scorer is None:
        raise ReplayInputError(f"scorer: selector {spec.name!r} re-scores groups under the current policy; "
                               "pass a scorer")
    limit = min(eligible, max(K, config.scan_budget))  # an ungated order always takes its K groups
    if spec.random:
        limit = len(drawn)
    window = ((lambda need: chunk_size(need, acceptance_rate, config)) if spec.gate else (lambda need: need))
    out = run_scan(order_fn, lambda ids: buffer.get(ids), scorer, limit=limit, k=K, gate=spec.gate, tau=tau,
                   passes=config.scan_passes, refresh=config.scan_refresh, window=window,
                   drift_norm=config.drift_norm, headroom_weighting=config.headroom_weighting,
                   floors=None if drift_floor is None else (lambda gs: _floors(drift_floor(gs), len(gs))))
    scanned = out.scanned
    cols = {"drift": [c.scores[0] for c in scanned], "headroom": [c.scores[1] for c in scanned],
            "kl": [c.scores[2] for c in scanned]}
    passed = [c.state == _PASS for c in scanned]
    acc = np.asarray([c.insertion_id for c, ok in zip(scanned, passed) if ok], dtype=np.int64)
    accepted_groups = [c.group for c, ok in zip(scanned, passed) if ok]
    kept, cut = _truncate(acc, u)
    sc_ids = np.asarray([c.insertion_id for c in scanned], dtype=np.int64)
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
        scanned_pass=np.asarray(passed, dtype=bool),
        scanned_tokens=np.asarray([c.group.num_loss_tokens for c in scanned], dtype=np.int64),
        groups=accepted_groups[: len(kept)],
        scored=True,
        scored_unused=out.unused,
        scorer_calls=out.calls,
        chunk_sizes=out.chunk_sizes,
        buffer_size=size,
        tau=tau,
        scanned_group_ids=buffer.group_ids(sc_ids),
        scan_capped=len(acc) < K and out.reached >= limit and limit < eligible,
        loss_weights=None if weights is None else weights[:len(kept)],
        rng_state=_state(rng, spec),
        eligible=eligible,
        rescored_rows=out.rows,
        rescored_tokens=out.tokens,
        scanned_exact=np.asarray([c.state != _EARLY or c.finish for c in scanned], dtype=bool),
        scanned_rescored_tokens=np.asarray([c.tokens for c in scanned], dtype=np.int64),
        unused_tokens=out.unused_tokens,
        skipped=skipped,
        scanned_streak=buffer.slot_values("reject_streak", sc_ids),
        scanned_floor=None if drift_floor is None else np.asarray([c.floor for c in scanned], dtype=float),
    )
    if config.scan_refresh == "keep":  # early-rejected groups keep their cached Headroom (the commit re-writes it)
        sel.scanned_headroom = np.where(sel.scanned_exact, sel.scanned_headroom, sel.scanned_cached)
    if config.counterfactual and len(kept) and spec.name != "recency":
        _counterfactual(sel, buffer, config, scorer, cols, drift_floor)
    return _frozen(sel)


def _counterfactual(sel: Selection, buffer: BufferView, config: ReplayConfig, scorer: Scorer,
                    cols: dict, drift_floor: DriftFloor | None = None) -> None:
    """Score the subset recency replay would take from the same pre-step buffer (same size).

    Groups already scanned reuse their scores; the others cost one extra scorer call (their Drift floored like the
    scan's when ``drift_floor`` is given).  Nothing here touches the buffer or the scan (no cache refresh for
    counterfactual-only groups)."""
    rec = buffer.order_by_recency(len(sel.accepted))
    exact = sel.scanned_exact if sel.scanned_exact is not None else np.ones(len(sel.scanned), bool)
    known = {g: j for j, g in enumerate(sel.scanned.tolist()) if exact[j]}  # early-rejected: scored in full here
    missing = [g for g in rec.tolist() if g not in known]
    extra = {}
    if missing:
        groups = buffer.get(missing)
        sel.rescored_rows += sum(g.num_responses for g in groups)
        sel.rescored_tokens += sum(g.num_tokens for g in groups)
        sc = score_groups(groups, check_scorer_output(groups, scorer(groups)), drift_norm=config.drift_norm,
                          headroom_weighting=config.headroom_weighting)
        floor = [0.0] * len(groups) if drift_floor is None else _floors(drift_floor(groups), len(groups))
        extra = {g: (max(d - f, 0.0), h) for g, d, h, f in zip(missing, sc.drift.tolist(), sc.headroom.tolist(), floor)}
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
