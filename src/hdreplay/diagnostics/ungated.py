"""Ungated diagnosis: what the Drift of the groups an ungated order replays was (recency replay, uniform).

An ungated selector (``recency``: "GRPO + replay") never re-scores what it replays; the paper's comparison of replay
KL gated vs. ungated (Sec. 4.3) needs it.  This observer scores the groups the selection took (one forward, no gate)
so their Drift, runtime Headroom and replay KL reach the step record as for a gated selector.  The decisions are
untouched: the same groups are replayed (the controller checks it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..rescore import Walk
from ..selectors import Selection


class UngatedDiagnosis:
    """An observer of :class:`~hdreplay.ReplayController`: scores an ungated selection's groups (see module)."""

    name = "diagnose_ungated"

    def on_select(self, controller, sel: Selection, scorer) -> Selection | None:
        ids = np.concatenate([sel.accepted, sel.truncated])
        if sel.scored or not len(ids) or scorer is None:
            return None
        cfg, buffer = controller.config, controller.buffer
        walk = Walk(lambda limit: ids[:limit], buffer.get, scorer, limit=len(ids), k=len(ids), gate=False, tau=0.0,
                    passes=1, refresh="finish", window=lambda need: need, drift_norm=cfg.drift_norm,
                    headroom_weighting=cfg.headroom_weighting)
        scan = tuple(walk)
        return dataclasses.replace(sel, scan=scan, passed=np.ones(len(scan), dtype=bool),
                                   cached=buffer.slot_values("cached_headroom", ids),
                                   age=sel.step - buffer.slot_values("birth_step", ids),
                                   streak=buffer.slot_values("reject_streak", ids), cost=walk.cost())
