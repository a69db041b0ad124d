"""The named selectors (order x gate), what one selection returns, and what a selector reads from a buffer.

A leaf of the core: it imports no other module of the package (only NumPy), so the configuration can list
the valid selector names and the diagnostics can read a :class:`Selection` without importing the scan
(:mod:`hdreplay.selection`) or the buffer (:mod:`hdreplay.buffer`).

=================  ======================================  =====  ====================================
name               order                                   gate   meaning
=================  ======================================  =====  ====================================
headroom_drift     cached Headroom, desc                   yes    the paper's method
headroom_only      cached Headroom, desc                   no     PER-style priority, no gate
drift_only         newest first                            yes    recency order + Drift gate
recency            newest first                            no     "GRPO + replay": latest K groups
uniform            uniform random, without replacement     no     uniform sampling from a FIFO
freshper           proportional to p^alpha, p = (mean|r| + no     FreshPER: PER priority x exp(-age /
                   eps) x exp(-age / age_decay)                   age_decay), PER importance weights
adv_priority       rollouts proportional to |A|^alpha      no     rollout-level |A|-prioritised replay
none               -                                       -      on-policy, nothing replayed
=================  ======================================  =====  ====================================

>>> SELECTORS["headroom_drift"].gate, SELECTORS["recency"].needs_scoring(diagnose_ungated=False)
(True, False)
>>> sorted(s.name for s in SELECTORS.values() if s.random)
['adv_priority', 'freshper', 'uniform']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SelectorSpec:
    name: str
    order: str | None  # "headroom" | "recency" | "uniform" | "proportional" | None
    gate: bool
    refresh: bool  # re-score selected groups even without a gate
    priority: str | None = None  # proportional orders: "reward" (mean |r| + eps) or "advantage" (mean |A|)
    unit: str = "group"  # "group" | "rollout" (single responses, see the controller)

    def needs_scoring(self, diagnose_ungated: bool) -> bool:
        return self.order is not None and (self.gate or self.refresh or diagnose_ungated)

    @property
    def random(self) -> bool:
        return self.order in ("uniform", "proportional")


SELECTORS: dict[str, SelectorSpec] = {
    s.name: s
    for s in (
        SelectorSpec("headroom_drift", "headroom", gate=True, refresh=True),
        SelectorSpec("headroom_only", "headroom", gate=False, refresh=True),
        SelectorSpec("drift_only", "recency", gate=True, refresh=True),
        SelectorSpec("recency", "recency", gate=False, refresh=False),
        SelectorSpec("uniform", "uniform", gate=False, refresh=False),
        SelectorSpec("freshper", "proportional", gate=False, refresh=False, priority="reward"),
        SelectorSpec("adv_priority", "proportional", gate=False, refresh=False, priority="advantage",
                     unit="rollout"),
        SelectorSpec("none", None, gate=False, refresh=False),
    )
}
#: FreshPER's epsilon added to the |reward| priority (``priority_functions.reward_fresh_priority``)
PRIORITY_EPS = 1e-6


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
                            buffer_size=size, tau=tau))


def frozen(sel: Selection) -> Selection:
    """Make the selection's arrays read-only (they drive the commit: nobody may edit them in place)."""
    for v in vars(sel).values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return sel
