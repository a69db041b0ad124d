"""The named selectors (order x gate), what one selection returns, and what a selector reads from a buffer.

A leaf of the core (it imports only NumPy), so the configuration can list the valid selector names and the records
can read a :class:`Selection` without importing the selection (:mod:`hdreplay.selection`) or the buffer.

The paper's selectors and ablations:

=================  ======================================  =====  ====================================
name               order                                   gate   meaning
=================  ======================================  =====  ====================================
headroom_drift     cached Headroom, desc                   yes    the paper's method
headroom_only      cached Headroom, desc                   no     PER-style priority, no gate
drift_only         newest first                            yes    recency order + Drift gate
recency            newest first                            no     "GRPO + replay": latest K groups
none               -                                       -      on-policy, nothing replayed
=================  ======================================  =====  ====================================

The peers whose order is random (``uniform``, ``freshper``, ``adv_priority``) join this registry through
:func:`register_selector` when :mod:`hdreplay.baselines` is imported (``import hdreplay`` does not import it): a
spec carries its own draw and (for single-rollout storage) its split, so the selection and the controller call them
without knowing the peers.

>>> SELECTORS["headroom_drift"].gate, SELECTORS["recency"].rescores
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SelectorSpec:
    """One named selector.

    Attributes:
        order: "headroom" | "recency" | the name of a random order (``draw`` set) | None (replays nothing).
        gate: replay iff Drift <= tau.  refresh: re-score selected groups even without a gate.
        priority: a proportional order's base priority ("reward" | "advantage"; read by its ``draw``).
        unit: what the buffer stores, "group" or "rollout" (single responses, cut by ``split``).
        draw: a random order, ``draw(buffer, config, rng, step, k, eligible) -> (ids, loss_weights or None)``:
            at most k insertion ids in draw order among the eligible units ((size,) bool, oldest first) and, if the
            order weights its draws, their (m,) loss weights.
        split: a rollout unit's stored records of one staged group (``GroupRecord -> list[GroupRecord]``).
    """

    name: str
    order: str | None
    gate: bool
    refresh: bool  # re-score selected groups even without a gate
    priority: str | None = None
    unit: str = "group"  # "group" | "rollout" (single responses, see the controller)
    draw: Callable | None = field(default=None, compare=False, repr=False)
    split: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def rescores(self) -> bool:
        """Its selection re-scores groups under the current policy (to gate them or to refresh their priority)."""
        return self.order is not None and (self.gate or self.refresh)

    @property
    def random(self) -> bool:
        return self.draw is not None


SELECTORS: dict[str, SelectorSpec] = {
    s.name: s
    for s in (
        SelectorSpec("headroom_drift", "headroom", gate=True, refresh=True),
        SelectorSpec("headroom_only", "headroom", gate=False, refresh=True),
        SelectorSpec("drift_only", "recency", gate=True, refresh=True),
        SelectorSpec("recency", "recency", gate=False, refresh=False),
        SelectorSpec("none", None, gate=False, refresh=False),
    )
}


def register_selector(spec: SelectorSpec) -> None:
    """Add (or replace) a selector declared above the core; ``none`` stays the last name listed."""
    if not isinstance(spec, SelectorSpec) or (spec.unit == "rollout") != (spec.split is not None):
        raise TypeError(f"register_selector: a SelectorSpec whose split is set iff its unit is 'rollout', got {spec!r}")
    none = SELECTORS.pop("none")
    SELECTORS[spec.name] = spec
    SELECTORS["none"] = none


#: what the cached Headroom of a group rejected early becomes (:mod:`hdreplay.rescore`)
SCAN_REFRESH = ("slice", "finish")


@runtime_checkable
class BufferView(Protocol):
    """What a selection reads from a buffer (:class:`~hdreplay.store.buffer.ReplayBuffer` provides it; the selection
    never mutates it).  Ids are insertion ids; arrays are oldest first unless an order is asked for."""

    def __len__(self) -> int: ...
    def insertion_ids(self) -> np.ndarray: ...
    def slot_values(self, name: str, ids) -> np.ndarray: ...
    def group_means(self, field: str, *, absolute: bool = True) -> np.ndarray: ...
    def group_ids(self, ids) -> list: ...
    def order_by_cached_headroom(self, limit: int) -> np.ndarray: ...
    def order_by_recency(self, limit: int) -> np.ndarray: ...
    def get(self, ids) -> list: ...


def _empty(dtype):
    return field(default_factory=lambda: np.zeros(0, dtype=dtype))


@dataclass(frozen=True)
class Selection:
    """Outcome of one step's selection (insertion ids index the buffer; arrays read-only).

    accepted:  (m',) ids replayed this step, priority order (after the truncation to a multiple of u)
    groups:    the accepted groups (copies), same order.  truncated: ids admitted by the gate, cut by the truncation
    scan:      the scanned groups in scan order (:class:`hdreplay.rescore.Rescored`: Drift, runtime Headroom -- the
               value the cache is refreshed to at commit -- replay KL, exactness, tokens forwarded)
    passed:    (s,) the gate's decision per scanned group.  cached / age / streak: (s,) per scanned group, its cached
               Headroom before the step, its age, the consecutive scans that rejected it before this one
    cost:      what the walk forwarded (:class:`hdreplay.rescore.WalkCost`); None when nothing was re-scored
    loss_weights, rng_state: a random order's (m',) loss weights and generator state after drawing (the peers)
    eligible / skipped: units the selection could draw from / that ``skip_rejected`` left out
    scan_capped: the scan stopped at ``max_scan`` with the replay budget unfilled
    """

    step: int
    selector: str
    tau: float
    accepted: np.ndarray = _empty(np.int64)
    groups: list = field(default_factory=list)
    truncated: np.ndarray = _empty(np.int64)
    scan: tuple = ()
    passed: np.ndarray = _empty(bool)
    cached: np.ndarray = _empty(float)
    age: np.ndarray = _empty(np.int64)
    streak: np.ndarray = _empty(np.int64)
    cost: Any = None
    buffer_size: int = 0
    eligible: int = 0
    skipped: int = 0
    scan_capped: bool = False
    loss_weights: np.ndarray | None = None
    rng_state: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for v in vars(self).values():  # they drive the commit: nobody may edit them in place
            if isinstance(v, np.ndarray):
                v.flags.writeable = False

    def _col(self, name: str, dtype=float) -> np.ndarray:
        return np.asarray([getattr(r, name) for r in self.scan], dtype=dtype)

    # per scanned group (s,), in scan order
    scored = property(lambda self: self.cost is not None, doc="groups were re-scored under the current policy")
    scanned = property(lambda self: self._col("insertion_id", np.int64), doc="(s,) insertion ids")
    scanned_drift = property(lambda self: self._col("drift"), doc="(s,) Drift (a lower bound > tau when not exact)")
    scanned_headroom = property(lambda self: self._col("headroom"), doc="(s,) runtime Headroom: the refreshed cache")
    scanned_kl = property(lambda self: self._col("kl"), doc="(s,) replay KL (k3) over the tokens forwarded")
    scanned_tau = property(lambda self: self._col("tau"), doc="(s,) the threshold each group was gated on")
    scanned_exact = property(lambda self: self._col("exact", bool), doc="(s,) Drift exact (False: rejected early)")
    scanned_rescored_tokens = property(lambda self: self._col("tokens", np.int64), doc="(s,) tokens forwarded")
    scanned_pass = property(lambda self: self.passed, doc="(s,) the gate's decisions")
    scanned_cached = property(lambda self: self.cached, doc="(s,) cached Headroom before the step")
    scanned_age = property(lambda self: self.age, doc="(s,) ages in steps")
    scanned_streak = property(lambda self: self.streak, doc="(s,) consecutive earlier rejections")
    scanned_group_ids = property(lambda self: [r.group.group_id for r in self.scan], doc="(s,) group ids")
    scanned_tokens = property(lambda self: np.asarray([r.group.num_loss_tokens for r in self.scan], dtype=np.int64),
                              doc="(s,) loss tokens per scanned group")
    # the walk's cost (0 when nothing was re-scored)
    scorer_calls = property(lambda self: self.cost.calls if self.cost else 0)
    chunk_sizes = property(lambda self: list(self.cost.chunk_sizes) if self.cost else [])
    rescored_rows = property(lambda self: self.cost.rows if self.cost else 0)
    rescored_tokens = property(lambda self: self.cost.tokens if self.cost else 0)
    scored_unused = property(lambda self: self.cost.unused if self.cost else 0)
    unused_tokens = property(lambda self: self.cost.unused_tokens if self.cost else 0)


def empty_selection(step: int, name: str, size: int, tau: float) -> Selection:
    """A selection that replays nothing (selector "none", K_rep = 0 or an empty buffer).

    >>> sel = empty_selection(3, "none", size=10, tau=1e-3)
    >>> len(sel.accepted), sel.buffer_size, sel.accepted.flags.writeable
    (0, 10, False)
    """
    return Selection(step, name, float(tau), buffer_size=size)
