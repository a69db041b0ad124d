"""Group lifetimes and the same-buffer counterfactual (report sections 5-7; paper Appendix A.4, D.3-D.4, Sec. 4.3).

Lifetime records (groups.jsonl): birth_step, ref_headroom (H_ref, the initial stored Headroom), replay_count
(N_rep), exposure (W_T = sum_t 1[g in A_t] / |A_t|, including the fresh use at birth), evicted_step (null = still
buffered when the run ended: its lifetime is censored; such groups are included and counted in n_still_buffered).

Counterfactual: with the counterfactual on (``replay_counterfactual``, :class:`hdreplay.diagnostics.Counterfactual`)
each step records the subset recency replay would have taken from the same pre-step buffer (same size) beside the
selection.  Per step:
    compatibility gain  x = cf_drift_recency - cf_drift_selected        (> 0: selected has lower Drift)
    learning-value gain y = cf_headroom_selected - cf_headroom_recency  (> 0: selected has higher Headroom)
Quadrants: both (x > 0, y > 0), compatibility_only (x > 0, y <= 0), value_only (x <= 0, y > 0), neither
(x <= 0, y <= 0, not both zero), tie (x == y == 0: typically the two subsets coincide).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .gate import col
from .stats import interval_means, opt, pieces, sanitize, unavailable

QUADRANTS = ("both", "compatibility_only", "value_only", "neither", "tie")
CF_KEYS = ("cf_drift_selected", "cf_drift_recency", "cf_headroom_selected", "cf_headroom_recency")


def headroom_deciles(groups: pd.DataFrame, *, n_bins: int = 10) -> dict[str, Any]:
    """Groups in ``n_bins`` equal-count bins of initial stored Headroom (ascending).

    Groups are sorted by (ref_headroom, insertion_id) and cut into contiguous equal-count bins (lower bins get the
    extra groups; fewer bins when there are fewer groups).  Returns {"bins": [{"bin", "n", "headroom_min",
    "headroom_max", "mean_replay_count", "p_replayed" = P(N_rep >= 1)}], "n_groups", "n_still_buffered"}.
    """
    if not len(groups):
        return unavailable("no groups.jsonl lifetime records")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    g = pd.DataFrame({"h": col(groups, "ref_headroom"), "n_rep": col(groups, "replay_count"),
                      "order": col(groups, "insertion_id").fillna(0)}).sort_values(["h", "order"], kind="stable")
    g["bin"] = pieces(len(g), min(n_bins, len(g))) + 1
    bins = g.groupby("bin").agg(n=("h", "size"), headroom_min=("h", "min"), headroom_max=("h", "max"),
                                mean_replay_count=("n_rep", "mean"), p_replayed=("n_rep", lambda n: (n >= 1).mean()))
    return sanitize({"available": True, "bins": bins.reset_index().to_dict("records"), "n_groups": len(groups),
                     "n_still_buffered": int(groups["evicted_step"].isna().sum())})


def multiplicity(groups: pd.DataFrame) -> dict[str, Any]:
    """Cohorts by lifetime replay count N_rep = 0, 1, ..., max.

    Returns {"cohorts": [{"n_rep", "n_groups", "cohort_share", "replay_events", "replay_event_share", "exposure",
    "exposure_share"}], "n_groups", "share_never_replayed", "total_replay_events", "total_exposure"}; replay
    events of a cohort = n_rep x n_groups, exposure = sum of W_T over it (a missing W_T counts 0).
    """
    if not len(groups):
        return unavailable("no groups.jsonl lifetime records")
    g = pd.DataFrame({"n_rep": col(groups, "replay_count").astype(int), "w": col(groups, "exposure").fillna(0.0)})
    if (g["n_rep"] < 0).any():
        raise ValueError("replay_count must be >= 0")
    c = g.groupby("n_rep").agg(n_groups=("w", "size"), exposure=("w", "sum")).reindex(
        range(g["n_rep"].max() + 1), fill_value=0).rename_axis("n_rep").reset_index()
    events, w = int((g["n_rep"]).sum()), float(g["w"].sum())
    c["cohort_share"] = c["n_groups"] / len(g)
    c["replay_events"] = c["n_rep"] * c["n_groups"]
    c["replay_event_share"] = c["replay_events"] / events if events else None
    c["exposure_share"] = c["exposure"] / w if w > 0 else None
    return sanitize({"available": True, "cohorts": c.to_dict("records"), "n_groups": len(g),
                     "share_never_replayed": (g["n_rep"] == 0).mean(), "total_replay_events": events,
                     "total_exposure": w})


def counterfactual(steps: pd.DataFrame) -> dict[str, Any]:
    """Per-step gains of the selected subset over the recency subset (steps with all four cf_* values).

    Returns {"series": {step, compat_gain, value_gain, quadrant, size}, "n_steps", "quadrant_share": {q: share},
    "mean_compat_gain", "mean_value_gain", "share_compat_positive", "share_value_positive",
    "by_interval": {"compat_gain": {early, middle, final}, "value_gain": {...}}} (thirds over those steps).
    """
    cf = pd.DataFrame({k: col(steps, k) for k in CF_KEYS}).assign(step=steps["step"], size=col(steps, "cf_size"))
    cf = cf.dropna(subset=list(CF_KEYS))
    if not len(cf):
        if col(steps, "cf_size").notna().any():
            return unavailable("counterfactual keys present but no step replayed anything")
        return unavailable("run without the counterfactual (replay_counterfactual / "
                           "hdreplay.diagnostics.Counterfactual) (no cf_* keys in steps.jsonl)")
    x = cf["cf_drift_recency"] - cf["cf_drift_selected"]
    y = cf["cf_headroom_selected"] - cf["cf_headroom_recency"]
    quad = pd.Series(np.select([(x == 0) & (y == 0), (x > 0) & (y > 0), x > 0, y > 0], QUADRANTS[4:] + QUADRANTS[:3],
                               QUADRANTS[3]), index=cf.index)
    return sanitize({
        "available": True,
        "series": {"step": cf["step"], "compat_gain": x, "value_gain": y, "quadrant": quad,
                   "size": cf["size"].fillna(0).astype(int)},
        "n_steps": len(cf), "quadrant_share": {q: (quad == q).mean() for q in QUADRANTS},
        "mean_compat_gain": opt(x.mean()), "mean_value_gain": opt(y.mean()),
        "share_compat_positive": (x > 0).mean(), "share_value_positive": (y > 0).mean(),
        "by_interval": {"compat_gain": interval_means(x), "value_gain": interval_means(y)},
    })
