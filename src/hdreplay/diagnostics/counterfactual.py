"""The paper's same-buffer counterfactual (Sec. 4.3, App. D.3): what recency replay would have taken instead.

Each step, beside the groups the selection admitted, the subset recency replay would take from the same pre-step
buffer (the newest groups, as many as were admitted) is scored under the same policy: its Drift and runtime
Headroom against the selected subset's.  Groups the selection already scanned exactly reuse their scores; the
others cost one extra scorer call (added to the step's ``rescored_rows`` / ``rescored_tokens``).  Nothing here
touches the buffer or the selection (no cache refresh for counterfactual-only groups).  Drift is the raw value, as
the selection reports it.
"""

from __future__ import annotations

import math

import numpy as np

from ..scores import check_scorer_output, score_groups
from ..selectors import Selection


class Counterfactual:
    """An observer of :class:`~hdreplay.ReplayController` adding ``cf_size``, ``cf_drift_selected``,
    ``cf_drift_recency``, ``cf_headroom_selected`` and ``cf_headroom_recency`` to each step record."""

    name = "counterfactual"

    def __init__(self) -> None:
        self._pending: dict | None = None

    def on_select(self, controller, sel: Selection, scorer) -> None:
        self._pending = None
        if not len(sel.accepted) or not sel.scored or sel.selector == "recency" or scorer is None:
            return None
        cfg, buffer = controller.config, controller.buffer
        recent = buffer.order_by_recency(len(sel.accepted)).tolist()
        known = {r.insertion_id: (r.drift, r.headroom) for r in sel.scan if r.exact}  # early-rejected: rescored
        missing = [i for i in recent if i not in known]
        rows = tokens = 0
        if missing:
            groups = buffer.get(missing)
            sc = score_groups(groups, check_scorer_output(groups, scorer(groups)), drift_norm=cfg.drift_norm,
                              headroom_weighting=cfg.headroom_weighting)
            known.update(zip(missing, zip(sc.drift.tolist(), sc.headroom.tolist())))
            rows, tokens = sum(g.num_responses for g in groups), sum(g.num_tokens for g in groups)
        at = {r.insertion_id: r for r in sel.scan}
        chosen = [at[i] for i in sel.accepted.tolist()]
        self._pending = {
            "cf_size": len(recent),
            "cf_drift_selected": _mean([r.drift for r in chosen]),
            "cf_drift_recency": _mean([known[i][0] for i in recent]),
            "cf_headroom_selected": _mean([r.headroom for r in chosen]),
            "cf_headroom_recency": _mean([known[i][1] for i in recent]),
            "rows": rows, "tokens": tokens,
        }
        return None

    def on_commit(self, controller, record) -> dict:
        out, self._pending = self._pending or {}, None
        record.rescored_rows += out.pop("rows", 0)
        record.rescored_tokens += out.pop("tokens", 0)
        return out


def _mean(xs) -> float | None:
    m = float(np.mean(xs)) if len(xs) else float("nan")
    return m if math.isfinite(m) else None
