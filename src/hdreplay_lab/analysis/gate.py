"""Gate behaviour over training (report sections 1-3): acceptance, budget fill, rejections, replay KL, scan
depth and the share of accepted replay recovered from the top of the scan-ordered buffer.

Input: a :func:`~hdreplay_lab.analysis.load.step_frame` (StepRecord columns, one row per step).  Definitions:
    update       a step whose pre-step buffer was non-empty (``buffer_size > 0``): selection ran.  Means "per
                 update" and the early/middle/final intervals are over updates.
    rejections   gate rejections of the step = scanned - accepted_gate (0 when nothing was scanned).
    filled       the scan reached the replay target: accepted_gate >= k_rep (before truncation to u).
    prefix rank  1-based position of a replayed group in the scan order; for Headroom selectors the scan order is
                 the cached-Headroom order of the whole pre-step buffer, so rank / buffer_size is the relative
                 depth in the Headroom-ordered buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .stats import interval_means, numeric, opt, ratio, running_mean, sanitize, unavailable

#: relative prefix depths at which the cumulative accepted share is summarised, and the curve's grid
PREFIX_POINTS = (0.05, 0.1, 0.25, 0.5)
PREFIX_GRID = tuple(i / 100 for i in range(101))
HEADROOM_SELECTORS = ("headroom_drift", "headroom_only")


def col(df: pd.DataFrame, name: str) -> pd.Series:
    """Column ``name`` as float64 with missing / non-finite values NaN."""
    return numeric(df[name]) if name in df else pd.Series(np.nan, index=df.index)


def updates(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps whose pre-step buffer was non-empty (without buffer_size: anything scanned or replayed)."""
    size = col(steps, "buffer_size")
    busy = (col(steps, "scanned").fillna(0) > 0) | (col(steps, "accepted").fillna(0) > 0)
    return steps[size.gt(0) | (size.isna() & busy)]


def rejections(steps: pd.DataFrame) -> pd.Series:
    """Gate rejections per step (scanned - accepted_gate, never negative, 0 when nothing was scanned)."""
    scanned = col(steps, "scanned").fillna(0)
    return (scanned - col(steps, "accepted_gate").fillna(0)).clip(lower=0).where(scanned > 0, 0).astype(int)


def acceptance(steps: pd.DataFrame) -> dict[str, Any]:
    """Acceptance rate, budget fill and gate rejections.

    Returns {"series": {step, accept_rate, budget_fill, rejections}, "n_steps", "n_updates", "mean_accept_rate"
    (mean of per-step rates), "pooled_accept_rate" (sum accepted_gate / sum scanned), "mean_budget_fill",
    "mean_rejections" (per update), "by_interval": {metric: {early, middle, final}}}.
    """
    if not len(steps):
        return unavailable("no replay step records")
    upd = updates(steps)
    scanned = col(upd, "scanned").fillna(0)
    cols = {"accept_rate": col(upd, "accept_rate"), "budget_fill": col(upd, "budget_fill"),
            "rejections": rejections(upd)}
    return sanitize({
        "available": True,
        "series": {"step": steps["step"], "accept_rate": col(steps, "accept_rate"),
                   "budget_fill": col(steps, "budget_fill"), "rejections": rejections(steps)},
        "n_steps": len(steps), "n_updates": len(upd),
        "mean_accept_rate": opt(cols["accept_rate"].mean()),
        "pooled_accept_rate": ratio(float(col(upd, "accepted_gate").fillna(0)[scanned > 0].sum()),
                                    float(scanned.sum())),
        "mean_budget_fill": opt(cols["budget_fill"].mean()),
        "mean_rejections": opt(cols["rejections"].mean()),
        "by_interval": {k: interval_means(v) for k, v in cols.items()},
    })


def replay_kl(steps: pd.DataFrame, *, window: int = 15) -> dict[str, Any]:
    """Replay KL (k3 estimate over replayed tokens) over steps.

    Returns {"series": {step, replay_kl}, "running": {step, replay_kl} (trailing mean over the last ``window``
    available points), "window", "mean", "by_interval" (over updates), "final_over_early"}.  Steps without
    replay have no replay KL and are skipped.
    """
    if not len(steps):
        return unavailable("no replay step records")
    kl = col(steps, "replay_kl")
    if kl.isna().all():
        return unavailable("no step has a replay KL (nothing replayed, or an unscored selector without "
                           "diagnose_ungated=True)")
    run = running_mean(steps["step"], kl, window)
    by = interval_means(col(updates(steps), "replay_kl"))
    return sanitize({"available": True, "series": {"step": steps["step"], "replay_kl": kl},
                     "running": {"step": run["step"], "replay_kl": run["value"]}, "window": window,
                     "mean": opt(kl.mean()), "by_interval": by, "final_over_early": ratio(by["final"], by["early"])})


def scan(steps: pd.DataFrame) -> dict[str, Any]:
    """Scan depth, filled vs underfilled updates, scan-budget stops and the prefix concentration of replay.

    Returns {"series": {step, scanned, filled}, "mean_scan_depth", "scan_depth_by_interval", "n_filled",
    "n_underfilled", "n_scan_capped" (over updates), "order": "headroom" | "recency", "prefix": see
    :func:`prefix_share`}.
    """
    if not len(steps):
        return unavailable("no replay step records")
    upd = updates(steps)
    depth = col(upd, "scanned")
    if not depth.gt(0).any():
        return unavailable(f"no step scanned the buffer (selector {steps['selector'].iloc[-1]!r} replays "
                           "without re-scoring)")
    k = col(upd, "k_rep")
    filled = (col(upd, "accepted_gate").fillna(0) >= k).astype(object).where(k.fillna(0) > 0, None)
    by_step = dict(zip(upd["step"], filled))
    return sanitize({
        "available": True,
        "series": {"step": steps["step"], "scanned": col(steps, "scanned").fillna(0).astype(int),
                   "filled": [by_step.get(s) for s in steps["step"]]},
        "mean_scan_depth": opt(depth.mean()), "scan_depth_by_interval": interval_means(depth),
        "n_filled": int((filled == True).sum()), "n_underfilled": int((filled == False).sum()),  # noqa: E712
        "n_scan_capped": int(upd["scan_capped"].eq(True).sum()),
        "order": "headroom" if steps["selector"].iloc[-1] in HEADROOM_SELECTORS else "recency",
        "prefix": prefix_share(steps),
    })


def accepted_ranks(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per replayed group with a scan position: step, rank (1-based), buffer_size, k_rep.  A step's
    replayed groups are its first ``accepted`` gate passes (truncation keeps the highest-priority prefix)."""
    df = steps.assign(buffer_size=col(steps, "buffer_size"), k_rep=col(steps, "k_rep").fillna(0),
                      accepted=col(steps, "accepted").fillna(0))
    ex = df[df["buffer_size"] > 0][["step", "buffer_size", "k_rep", "accepted", "scan_pass"]]
    ex = ex.explode("scan_pass").reset_index(drop=True)
    ex["rank"] = ex.groupby("step").cumcount() + 1
    ex = ex[ex["scan_pass"].eq(True)]
    return ex[ex.groupby("step").cumcount() < ex["accepted"]]


def prefix_share(steps: pd.DataFrame) -> dict[str, Any]:
    """Cumulative share of all replayed groups whose relative scan depth rank / buffer_size <= q.

    Returns {"grid", "cumulative_share" (on the grid), "share_at": {"0.05": ...}, "share_within_k_rep"
    (rank <= k_rep), "n_accepted"}."""
    ranks = accepted_ranks(steps)
    if not len(ranks):
        return unavailable("no replayed group has a recorded scan position")
    rel = (ranks["rank"] / ranks["buffer_size"]).to_numpy(dtype=float)

    def cum(qs):
        return (rel[:, None] <= np.asarray(qs) + 1e-12).mean(axis=0)

    return sanitize({"available": True, "grid": list(PREFIX_GRID), "cumulative_share": cum(PREFIX_GRID),
                     "share_at": {f"{q:g}": v for q, v in zip(PREFIX_POINTS, cum(PREFIX_POINTS))},
                     "share_within_k_rep": (ranks["rank"] <= ranks["k_rep"]).mean(), "n_accepted": len(rel)})
