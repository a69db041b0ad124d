"""Group lifetimes (report sections 5 and 6): initial stored Headroom vs lifetime replay, and replay
multiplicity / exposure concentration (paper Appendix A.4 and D.3-D.4).

Inputs are groups.jsonl lifetime records: birth_step, ref_headroom (H_ref, the initial stored
Headroom), replay_count (N_rep), exposure (W_T = sum_t 1[g in A_t] / |A_t|, including the fresh use
at birth), evicted_step (null = still buffered when the run ended: its lifetime is censored; such
groups are included and counted in ``n_still_buffered``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .stats import num, unavailable


def headroom_deciles(groups: Sequence[dict], *, n_bins: int = 10) -> dict[str, Any]:
    """Groups bucketed into ``n_bins`` equal-count bins of initial stored Headroom (ascending).

    Groups are sorted by (ref_headroom, insertion_id) and cut with ``numpy.array_split`` (lower bins
    get the extra groups; fewer bins when there are fewer groups).  Returns {"bins": [{"bin", "n",
    "headroom_min", "headroom_max", "mean_replay_count", "p_replayed"}], "n_groups",
    "n_still_buffered"}.  ``p_replayed`` is P(N_rep >= 1).
    """
    if not groups:
        return unavailable("no groups.jsonl lifetime records")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    order = sorted(groups, key=lambda g: (float(g["ref_headroom"]), g.get("insertion_id", 0)))
    bins = []
    for i, part in enumerate(np.array_split(np.arange(len(order)), min(n_bins, len(order))), start=1):
        gs = [order[j] for j in part.tolist()]
        n_rep = np.asarray([g["replay_count"] for g in gs], dtype=np.float64)
        h = [float(g["ref_headroom"]) for g in gs]
        bins.append({"bin": i, "n": len(gs), "headroom_min": min(h), "headroom_max": max(h),
                     "mean_replay_count": float(n_rep.mean()), "p_replayed": float((n_rep >= 1).mean())})
    return {
        "available": True,
        "bins": bins,
        "n_groups": len(groups),
        "n_still_buffered": sum(1 for g in groups if g.get("evicted_step") is None),
    }


def multiplicity(groups: Sequence[dict]) -> dict[str, Any]:
    """Cohorts by lifetime replay count N_rep = 0, 1, ..., max.

    Returns {"cohorts": [{"n_rep", "n_groups", "cohort_share", "replay_events", "replay_event_share",
    "exposure", "exposure_share"}], "n_groups", "share_never_replayed", "total_replay_events",
    "total_exposure"}.  replay events of a cohort = n_rep x n_groups (the paper's "replay-use events");
    exposure = sum of W_T over the cohort (groups without an exposure value count 0).
    """
    if not groups:
        return unavailable("no groups.jsonl lifetime records")
    n_rep = np.asarray([g["replay_count"] for g in groups], dtype=np.int64)
    if (n_rep < 0).any():
        raise ValueError("replay_count must be >= 0")
    w = np.asarray([num(g.get("exposure")) or 0.0 for g in groups], dtype=np.float64)
    total_events = int(n_rep.sum())
    total_w = float(w.sum())
    cohorts = []
    for k in range(int(n_rep.max()) + 1):
        m = n_rep == k
        cohorts.append({
            "n_rep": k,
            "n_groups": int(m.sum()),
            "cohort_share": float(m.mean()),
            "replay_events": int(k * m.sum()),
            "replay_event_share": float(k * m.sum() / total_events) if total_events else None,
            "exposure": float(w[m].sum()),
            "exposure_share": float(w[m].sum() / total_w) if total_w > 0 else None,
        })
    return {
        "available": True,
        "cohorts": cohorts,
        "n_groups": len(groups),
        "share_never_replayed": float((n_rep == 0).mean()),
        "total_replay_events": total_events,
        "total_exposure": total_w,
    }
