"""The named selectors (order x gate), what one selection returns, and what a selector reads from a buffer.

A leaf of the core: it imports no other module of the package (only NumPy), so the configuration can list
the valid selector names and the diagnostics can read a :class:`Selection` without importing the scan
(:mod:`hdreplay.selection`) or the buffer (:mod:`hdreplay.buffer`).

The paper's selectors and ablations are declared here:

=================  ======================================  =====  ====================================
name               order                                   gate   meaning
=================  ======================================  =====  ====================================
headroom_drift     cached Headroom, desc                   yes    the paper's method
headroom_only      cached Headroom, desc                   no     PER-style priority, no gate
drift_only         newest first                            yes    recency order + Drift gate
recency            newest first                            no     "GRPO + replay": latest K groups
none               -                                       -      on-policy, nothing replayed
=================  ======================================  =====  ====================================

The peers whose order is random (``uniform``, ``freshper``, ``adv_priority``) are declared above the core, in
:mod:`hdreplay.baselines.orders`, and join this registry through :func:`register_selector` when ``hdreplay`` is
imported: a spec carries its own draw and (for single-rollout storage) its split, so the scan and the controller
call them without knowing the peers.

>>> SELECTORS["headroom_drift"].gate, SELECTORS["recency"].needs_scoring(diagnose_ungated=False)
(True, False)
>>> sorted(s.name for s in SELECTORS.values() if s.random)  # the peers, registered by hdreplay.baselines
['adv_priority', 'freshper', 'uniform']
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

    def needs_scoring(self, diagnose_ungated: bool) -> bool:
        return self.order is not None and (self.gate or self.refresh or diagnose_ungated)

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


#: what the cached Headroom of a group rejected early by the sliced scan becomes (:mod:`hdreplay.scan`)
SCAN_REFRESH = ("slice", "keep", "finish")


@runtime_checkable
class BufferView(Protocol):
    """What a selection reads from a buffer (:class:`~hdreplay.buffer.ReplayBuffer` provides it; the scan
    never mutates it).  Ids are insertion ids; arrays are oldest first unless an order is asked for."""

    def __len__(self) -> int: ...
    def insertion_ids(self) -> np.ndarray: ...
    def slot_values(self, name: str, ids) -> np.ndarray: ...
    def group_means(self, field: str, *, absolute: bool = True) -> np.ndarray: ...
    def group_ids(self, ids) -> list: ...
    def order_by_cached_headroom(self, limit: int) -> np.ndarray: ...
    def order_by_recency(self, limit: int) -> np.ndarray: ...
    def get(self, ids) -> list: ...


@dataclass
class Selection:
    """Outcome of one step's selection (insertion ids index the buffer).

    accepted:      (m',) ids replayed this step, priority order (after truncation to u)
    truncated:     ids accepted by the gate but cut by the multiple-of-u truncation
    scanned:       (s,) ids re-scored and counted as scanned, in scan order
    scanned_*:     (s,) per scanned group: drift, runtime headroom, replay kl, cached headroom
                   before the step, age, accepted-by-gate flag, loss-token count
    groups:        the accepted groups as GroupRecords, same order as ``accepted``
    scored_unused: groups re-scored in the last chunk beyond the stopping index (discarded)
    """

    step: int
    selector: str
    accepted: np.ndarray
    truncated: np.ndarray
    scanned: np.ndarray
    scanned_drift: np.ndarray
    scanned_headroom: np.ndarray
    scanned_kl: np.ndarray
    scanned_cached: np.ndarray
    scanned_age: np.ndarray
    scanned_pass: np.ndarray
    scanned_tokens: np.ndarray
    groups: list  # list[GroupRecord]
    scored: bool
    scored_unused: int = 0
    scorer_calls: int = 0
    chunk_sizes: list[int] = field(default_factory=list)
    buffer_size: int = 0
    tau: float = float("nan")
    #: same-buffer counterfactual (``config.counterfactual``): the recency subset of the same size
    cf_ids: np.ndarray | None = None
    cf_drift: np.ndarray | None = None
    cf_headroom: np.ndarray | None = None
    #: (s,) group ids of the scanned groups (scan order), for logs that outlive the buffer's slots
    scanned_group_ids: list = field(default_factory=list)
    #: the scan stopped at the scan budget (``ReplayConfig.scan_budget``) with the replay budget unfilled
    scan_capped: bool = False
    #: (m',) per accepted unit, the loss weight its rows get (PER importance weights, ``is_beta`` > 0); None = 1
    loss_weights: np.ndarray | None = None
    #: the random orders' generator state after this selection (the controller keeps it at commit)
    rng_state: dict[str, Any] | None = None
    #: units the selection could draw from (all live units, or those within ``max_age``)
    eligible: int = 0
    #: rows and completion tokens of stored units forwarded under the current policy (scan, discarded tail of the
    #: last chunk, counterfactual): the selection's forward cost
    rescored_rows: int = 0
    rescored_tokens: int = 0
    #: (s,) per scanned group: its Drift is exact (False: early-rejected, ``scanned_drift`` is the lower bound and
    #: ``scanned_headroom`` that of the responses forwarded, :mod:`hdreplay.scan`), and the completion tokens forwarded
    scanned_exact: np.ndarray | None = None
    scanned_rescored_tokens: np.ndarray | None = None
    #: completion tokens forwarded for groups beyond the stopping index (``scored_unused`` of them)
    unused_tokens: int = 0
    #: groups left out of this scan by ``skip_rejected`` (rejected widely at an earlier step)
    skipped: int = 0
    #: (s,) per scanned group: the consecutive scans that rejected it before this one
    scanned_streak: np.ndarray | None = None
    #: (s,) per scanned group, the Drift floor subtracted before the gate (``drift_floor``, asynchronous pipelines;
    #: None = no floor): ``scanned_drift`` is then max(raw Drift - floor, 0), the value the gate compared with tau
    scanned_floor: np.ndarray | None = None


def empty_selection(step: int, name: str, size: int, tau: float) -> Selection:
    """A selection that replays nothing (selector "none", K_rep = 0 or an empty buffer).

    >>> sel = empty_selection(3, "none", size=10, tau=1e-3)
    >>> len(sel.accepted), sel.buffer_size, sel.accepted.flags.writeable
    (0, 10, False)
    """
    z = np.zeros(0)
    zi = np.zeros(0, dtype=np.int64)
    return frozen(Selection(step, name, zi, zi, zi, z, z, z, z, zi, np.zeros(0, bool), zi, [], False,
                            buffer_size=size, tau=tau, scanned_exact=np.zeros(0, bool),
                            scanned_rescored_tokens=zi, scanned_streak=zi))


def frozen(sel: Selection) -> Selection:
    """Make the selection's arrays read-only (they drive the commit: nobody may edit them in place)."""
    for v in vars(sel).values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return sel
