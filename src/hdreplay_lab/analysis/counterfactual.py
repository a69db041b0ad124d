"""The same-buffer counterfactual (report section 7; paper Section 4.3, Figure A).

At each step with ``ReplayConfig(counterfactual=True)`` the core scores the subset recency replay
("GRPO + replay") would have taken from the same pre-step buffer, with the same size as the selected
subset, and writes cf_drift_selected / cf_drift_recency / cf_headroom_selected / cf_headroom_recency
(subset means under the current policy).  Per step:

    compatibility gain  x = cf_drift_recency - cf_drift_selected        (> 0: selected has lower Drift)
    learning-value gain y = cf_headroom_selected - cf_headroom_recency  (> 0: selected has higher Headroom)

Quadrants: "both" (x > 0, y > 0), "compatibility_only" (x > 0, y <= 0), "value_only" (x <= 0, y > 0),
"neither" (x <= 0, y <= 0, not both zero), "tie" (x == y == 0: typically the two subsets coincide).
"""

from __future__ import annotations

from typing import Any, Sequence

from .stats import interval_means, mean, num, unavailable

QUADRANTS = ("both", "compatibility_only", "value_only", "neither", "tie")
CF_KEYS = ("cf_drift_selected", "cf_drift_recency", "cf_headroom_selected", "cf_headroom_recency")


def quadrant(x: float, y: float) -> str:
    if x == 0 and y == 0:
        return "tie"
    if x > 0:
        return "both" if y > 0 else "compatibility_only"
    return "value_only" if y > 0 else "neither"


def counterfactual(steps: Sequence[dict]) -> dict[str, Any]:
    """Per-step gains of the selected subset over the recency subset.

    Returns {"series": {step, compat_gain, value_gain, quadrant, size}, "n_steps",
    "quadrant_share": {q: share}, "mean_compat_gain", "mean_value_gain", "share_compat_positive",
    "share_value_positive", "by_interval": {"compat_gain": {early, middle, final}, "value_gain": {...}}}.
    Only steps with all four cf_* values are used (thirds are over those steps).
    """
    rows = []
    for r in steps:
        v = [num(r.get(k)) for k in CF_KEYS]
        if any(x is None for x in v):
            continue
        ds, dr, hs, hr = v
        x, y = dr - ds, hs - hr
        rows.append((r["step"], x, y, quadrant(x, y), int(num(r.get("cf_size")) or 0)))
    if not rows:
        if any("cf_size" in r for r in steps):
            return unavailable("counterfactual keys present but no step replayed anything")
        return unavailable("run without ReplayConfig(counterfactual=True) (no cf_* keys in steps.jsonl)")
    n = len(rows)
    xs = [x for _, x, _, _, _ in rows]
    ys = [y for _, _, y, _, _ in rows]
    quads = [q for *_, q, _ in rows]
    return {
        "available": True,
        "series": {"step": [s for s, *_ in rows], "compat_gain": xs, "value_gain": ys,
                   "quadrant": quads, "size": [k for *_, k in rows]},
        "n_steps": n,
        "quadrant_share": {q: quads.count(q) / n for q in QUADRANTS},
        "mean_compat_gain": mean(xs),
        "mean_value_gain": mean(ys),
        "share_compat_positive": sum(x > 0 for x in xs) / n,
        "share_value_positive": sum(y > 0 for y in ys) / n,
        "by_interval": {"compat_gain": interval_means(xs), "value_gain": interval_means(ys)},
    }
