"""Gate behaviour over training (report sections 1-3): acceptance, budget fill, rejections, replay KL,
scan depth and the share of accepted replay recovered from the top of the scan-ordered buffer.

Inputs are steps.jsonl records (dicts, sorted by step).  Definitions:
    update         a step whose pre-step buffer was non-empty (``buffer_size > 0``): selection ran.
                   Means "per update" and the early/middle/final intervals are over updates.
    rejections     gate rejections of the step = scanned - accepted_gate (0 when nothing was scanned).
    filled         the scan reached the replay target: accepted_gate >= k_rep (before truncation to u).
    prefix rank    1-based position of an accepted group in the scan order; for Headroom selectors
                   the scan order is the cached-Headroom order of the whole pre-step buffer, so
                   rank / buffer_size is the relative depth in the Headroom-ordered buffer.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .stats import interval_means, mean, num, ratio, running_mean, unavailable

#: relative prefix depths at which the cumulative accepted share is summarised
PREFIX_POINTS = (0.05, 0.1, 0.25, 0.5)
#: the grid (101 points, 0..1) of the cumulative-share curve
PREFIX_GRID = tuple(i / 100 for i in range(101))
HEADROOM_SELECTORS = ("headroom_drift", "headroom_only")


def is_update(rec: dict) -> bool:
    size = num(rec.get("buffer_size"))
    if size is not None:
        return size > 0
    return (num(rec.get("scanned")) or 0) > 0 or (num(rec.get("accepted")) or 0) > 0


def rejections(rec: dict) -> int:
    """Gate rejections at one step (scanned - accepted_gate, never negative)."""
    scanned = int(num(rec.get("scanned")) or 0)
    if scanned == 0:
        return 0
    return max(scanned - int(num(rec.get("accepted_gate")) or 0), 0)


def acceptance(steps: Sequence[dict]) -> dict[str, Any]:
    """Acceptance rate, budget fill and gate rejections.

    Returns {"series": {step, accept_rate, budget_fill, rejections}, "n_steps", "n_updates",
    "mean_accept_rate" (mean of per-step rates), "pooled_accept_rate" (sum accepted_gate / sum scanned),
    "mean_budget_fill", "mean_rejections" (per update), "by_interval": {metric: {early, middle, final}}}.
    """
    if not steps:
        return unavailable("no replay step records")
    upd = [r for r in steps if is_update(r)]
    scanned = sum(int(num(r.get("scanned")) or 0) for r in upd)
    passed = sum(int(num(r.get("accepted_gate")) or 0) for r in upd if (num(r.get("scanned")) or 0) > 0)
    cols = {
        "accept_rate": [num(r.get("accept_rate")) for r in upd],
        "budget_fill": [num(r.get("budget_fill")) for r in upd],
        "rejections": [rejections(r) for r in upd],
    }
    return {
        "available": True,
        "series": {
            "step": [r["step"] for r in steps],
            "accept_rate": [num(r.get("accept_rate")) for r in steps],
            "budget_fill": [num(r.get("budget_fill")) for r in steps],
            "rejections": [rejections(r) for r in steps],
        },
        "n_steps": len(steps),
        "n_updates": len(upd),
        "mean_accept_rate": mean(cols["accept_rate"]),
        "pooled_accept_rate": passed / scanned if scanned else None,
        "mean_budget_fill": mean(cols["budget_fill"]),
        "mean_rejections": mean(cols["rejections"]),
        "by_interval": {k: interval_means(v) for k, v in cols.items()},
    }


def replay_kl(steps: Sequence[dict], *, window: int = 15) -> dict[str, Any]:
    """Replay KL (k3 estimate over accepted replay tokens) over steps.

    Returns {"series": {step, replay_kl}, "running": {step, replay_kl} (trailing mean over the last
    ``window`` available points), "window", "mean", "by_interval": {early, middle, final} (over
    updates), "final_over_early"}.  Steps without replay have no replay KL and are skipped.
    """
    if not steps:
        return unavailable("no replay step records")
    vals = [num(r.get("replay_kl")) for r in steps]
    if all(v is None for v in vals):
        return unavailable("no step has a replay KL (nothing replayed, or an unscored selector "
                           "without diagnose_ungated=True)")
    rx, ry = running_mean([r["step"] for r in steps], vals, window)
    by = interval_means([num(r.get("replay_kl")) for r in steps if is_update(r)])
    return {
        "available": True,
        "series": {"step": [r["step"] for r in steps], "replay_kl": vals},
        "running": {"step": rx, "replay_kl": ry},
        "window": window,
        "mean": mean(vals),
        "by_interval": by,
        "final_over_early": ratio(by["final"], by["early"]),
    }


def scan_order(selector: Any) -> str:
    return "headroom" if selector in HEADROOM_SELECTORS else "recency"


def accepted_ranks(rec: dict) -> list[int]:
    """1-based scan positions of the groups replayed at this step (gate passes, truncation-kept prefix)."""
    kept = int(num(rec.get("accepted")) or 0)
    ranks = [i + 1 for i, ok in enumerate(rec.get("scan_pass") or []) if ok]
    return ranks[:kept]


def scan(steps: Sequence[dict]) -> dict[str, Any]:
    """Scan depth, filled vs underfilled steps, and the prefix concentration of accepted replay.

    Returns {"series": {step, scanned, filled}, "mean_scan_depth", "scan_depth_by_interval",
    "n_filled", "n_underfilled" (over updates), "order": "headroom" | "recency",
    "prefix": {"grid", "cumulative_share", "share_at": {"0.05": ..}, "share_within_k_rep",
    "n_accepted"} or an unavailable marker}.
    """
    if not steps:
        return unavailable("no replay step records")
    upd = [r for r in steps if is_update(r)]
    if not any((num(r.get("scanned")) or 0) > 0 for r in upd):
        return unavailable(f"no step scanned the buffer (selector {steps[-1].get('selector')!r} "
                           "replays without re-scoring)")
    filled = [_filled(r) for r in upd]
    by_step = {r["step"]: f for r, f in zip(upd, filled)}
    return {
        "available": True,
        "series": {"step": [r["step"] for r in steps],
                   "scanned": [int(num(r.get("scanned")) or 0) for r in steps],
                   "filled": [by_step.get(r["step"]) for r in steps]},
        "mean_scan_depth": mean(num(r.get("scanned")) for r in upd),
        "scan_depth_by_interval": interval_means([num(r.get("scanned")) for r in upd]),
        "n_filled": sum(1 for f in filled if f),
        "n_underfilled": sum(1 for f in filled if f is False),
        "order": scan_order(steps[-1].get("selector")),
        "prefix": prefix_share(steps),
    }


def _filled(rec: dict) -> bool | None:
    k = num(rec.get("k_rep"))
    if not k:
        return None
    return (num(rec.get("accepted_gate")) or 0) >= k


def prefix_share(steps: Sequence[dict]) -> dict[str, Any]:
    """Cumulative share of all replayed groups whose relative scan depth rank / buffer_size <= q."""
    rel: list[float] = []
    within_k: list[bool] = []
    for r in steps:
        size = num(r.get("buffer_size"))
        if not size:
            continue
        k = num(r.get("k_rep")) or 0
        for rank in accepted_ranks(r):
            rel.append(rank / size)
            within_k.append(rank <= k)
    if not rel:
        return unavailable("no replayed group has a recorded scan position")
    a = np.sort(np.asarray(rel))
    cum = np.searchsorted(a, np.asarray(PREFIX_GRID) + 1e-12, side="right") / a.size
    at = np.searchsorted(a, np.asarray(PREFIX_POINTS) + 1e-12, side="right") / a.size
    return {
        "available": True,
        "grid": list(PREFIX_GRID),
        "cumulative_share": cum.tolist(),
        "share_at": {f"{q:g}": float(v) for q, v in zip(PREFIX_POINTS, at)},
        "share_within_k_rep": sum(within_k) / len(within_k),
        "n_accepted": len(rel),
    }

