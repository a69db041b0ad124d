"""Where the gate's re-scoring goes (issue 27): re-scored rows and tokens per admitted one, the share spent on
rejected groups and on groups beyond the stopping index, how far above tau the rejected groups were, and how
often the same group is re-scored and rejected again.

Input: a :func:`~hdreplay_lab.analysis.load.step_frame` (StepRecord columns).  Definitions (over updates, i.e.
steps whose pre-step buffer was non-empty):
    admitted         the groups replayed (after truncation); rows = their responses, tokens = their completion tokens
    re-scored        rows / completion tokens of stored groups forwarded under the current policy to select them
    groups touched   scanned + ``scored_unused`` (groups forwarded at least in part)
    Drift / tau      of each rejected group; an early-rejected group's Drift is the lower bound that rejected it
                     (``scan_exact`` False), so the shares above 3 / 5 / 10 tau are lower bounds of the full scan's
    rejected again   a rejected group whose previous scan had rejected it too (``scan_streak`` > 0); the streak
                     histogram counts, per rejection, the consecutive rejecting scans it completes (1, 2, ...)
Records written before these counters existed give what they can (rows, tokens, scanned) and None elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .gate import col, updates
from .stats import ratio, sanitize, unavailable

STREAK_BINS = (1, 2, 3, 4)  # and ">= 5"


def _explode(steps: pd.DataFrame, names: tuple[str, ...]) -> pd.DataFrame:
    """One row per scanned group: step, tau and the per-group lists ``names`` (missing lists: None)."""
    have = [n for n in names if n in steps]
    df = steps[["step", *have]].assign(tau=col(steps, "tau"))
    df = df[df["scan_pass"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    if not len(df):
        return pd.DataFrame(columns=["step", "tau", *names])
    df = df.copy()
    for n in have:  # a list the record predates (written empty) or lacks: None per scanned group
        df[n] = [v if isinstance(v, list) and len(v) == len(p) else [None] * len(p)
                 for v, p in zip(df[n], df["scan_pass"])]
    out = df.explode(have).reset_index(drop=True)
    for n in names:
        if n not in out:
            out[n] = None
    return out


def gate_waste(steps: pd.DataFrame) -> dict[str, Any]:
    """The waste section: see the module docstring.

    Returns {"rows_per_admitted_row", "tokens_per_admitted_token", "groups_touched_per_admitted", "share_rejected",
    "share_unused" (of re-scored tokens), "early_rejected_share" (of rejections), "rejected": {"n", "median_over_tau",
    "share_gt": {"3", "5", "10"}, "exact_share"}, "rejected_again_share", "streaks": {"1".."4", ">=5"} (shares),
    "mean_skipped", "totals": {...}}."""
    if not len(steps):
        return unavailable("no replay step records")
    upd = updates(steps)
    if not col(upd, "scanned").fillna(0).gt(0).any():
        return unavailable("no step re-scored the buffer")
    tot = {k: float(col(upd, k).fillna(0).sum()) for k in (
        "rescored_rows", "rescored_tokens", "replayed_rows", "replayed_tokens", "accepted", "scanned",
        "scored_unused", "rescored_tokens_rejected", "rescored_tokens_unused", "early_rejected", "rejected_again",
        "skipped")}
    has_new = "replayed_tokens" in upd and col(upd, "replayed_tokens").notna().any()
    scan = _explode(upd, ("scan_pass", "scan_drift", "scan_exact", "scan_streak"))
    rej = scan[scan["scan_pass"].eq(False)]
    over = (pd.to_numeric(rej["scan_drift"], errors="coerce") / rej["tau"]).replace([np.inf, -np.inf], np.nan)
    over = over.dropna()
    streak = pd.to_numeric(rej["scan_streak"], errors="coerce").dropna() + 1  # this rejection included
    n_rej = float(len(rej))
    return sanitize({
        "available": True,
        "rows_per_admitted_row": ratio(tot["rescored_rows"], tot["replayed_rows"]),
        "tokens_per_admitted_token": ratio(tot["rescored_tokens"], tot["replayed_tokens"]) if has_new else None,
        "groups_touched_per_admitted": ratio(tot["scanned"] + tot["scored_unused"], tot["accepted"]),
        "groups_scanned_per_admitted": ratio(tot["scanned"], tot["accepted"]),
        "share_rejected": ratio(tot["rescored_tokens_rejected"], tot["rescored_tokens"]) if has_new else None,
        "share_unused": ratio(tot["rescored_tokens_unused"], tot["rescored_tokens"]) if has_new else None,
        "early_rejected_share": ratio(tot["early_rejected"], n_rej) if has_new else None,
        "rejected": {
            "n": int(n_rej),
            "median_over_tau": float(over.median()) if len(over) else None,
            "share_gt": {str(k): float((over > k).mean()) if len(over) else None for k in (3, 5, 10)},
            "exact_share": float(rej["scan_exact"].map(lambda v: v is not False).mean()) if n_rej else None,
        },
        "rejected_again_share": ratio(tot["rejected_again"], n_rej) if len(streak) else None,
        "streaks": ({**{str(k): float((streak == k).mean()) for k in STREAK_BINS},
                     ">=5": float((streak >= 5).mean())} if len(streak) else None),
        "mean_skipped": tot["skipped"] / len(upd) if has_new and len(upd) else None,
        "totals": tot,
    })


#: the markdown rows of the section: (label, path in the section, format)
WASTE_ROWS = (
    ("re-scored rows per admitted row", "rows_per_admitted_row", "num"),
    ("re-scored tokens per admitted token", "tokens_per_admitted_token", "num"),
    ("groups touched per admitted group", "groups_touched_per_admitted", "num"),
    ("groups scanned per admitted group", "groups_scanned_per_admitted", "num"),
    ("re-scored tokens spent on rejected groups", "share_rejected", "pct"),
    ("re-scored tokens spent beyond the stopping index", "share_unused", "pct"),
    ("rejections made early (partial forward)", "early_rejected_share", "pct"),
    ("rejected groups", "rejected/n", "int"),
    ("median Drift / tau of a rejected group (>=)", "rejected/median_over_tau", "num"),
    ("rejected with Drift > 3 tau (>=)", "rejected/share_gt/3", "pct"),
    ("rejected with Drift > 5 tau (>=)", "rejected/share_gt/5", "pct"),
    ("rejected with Drift > 10 tau (>=)", "rejected/share_gt/10", "pct"),
    ("rejections whose previous scan also rejected", "rejected_again_share", "pct"),
    *((f"rejections ending a streak of {k}", f"streaks/{k}", "pct") for k in (*map(str, STREAK_BINS), ">=5")),
    ("groups skipped per update (skip_rejected)", "mean_skipped", "num"),
)
