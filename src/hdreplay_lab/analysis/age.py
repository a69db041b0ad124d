"""Replay age (report sections 4 and 9): Drift-gate outcome by age, source staleness of the replay pool and of
the used subset, mixing structure, and the phase-wise replay mixture.

age_t(g) = t - t0(g) (paper Table of notation), >= 1 for every buffered group.  Populations:
    scanned  groups the gate examined at a step (``scan_age`` / ``scan_pass``): accepted = passed, rejected = failed
    used     groups actually replayed (``accepted_ages``, after truncation to a multiple of u)
    pool     every group in the pre-step buffer at every update, reconstructed from groups.jsonl: g is in the
             buffer at step t iff birth_step < t <= evicted_step (evicted_step null = still buffered at the end)
Mixing statistics are over updates that replayed at least one group.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from .gate import col, updates
from .stats import distribution, numeric, opt, pieces, sanitize, share, unavailable


def age_gate(steps: pd.DataFrame) -> dict[str, Any]:
    """Age of scanned groups by gate outcome.

    Returns {"ages": [1..max], "hist_accepted"/"hist_rejected": share of each population at each age,
    "cdf_accepted"/"cdf_rejected", "scanned_by_age": counts, "accept_rate_by_age": passes / scanned at each age
    (None where nothing was scanned), "accepted"/"rejected": distribution summaries, "reject_share_youngest":
    the rejected share at the youngest scanned age}.
    """
    same = steps["scan_age"].map(len) == steps["scan_pass"].map(len)
    ex = steps.loc[same, ["scan_age", "scan_pass"]].explode(["scan_age", "scan_pass"])
    ex = ex.assign(age=numeric(ex["scan_age"])).dropna(subset=["age"])
    if not len(ex):
        return unavailable("no scanned groups with recorded ages")
    top = int(ex["age"].max())
    counts = pd.crosstab(ex["age"].astype(int), ex["scan_pass"].eq(True)).reindex(
        index=range(1, top + 1), columns=[True, False], fill_value=0)
    acc, rej, tot = counts[True], counts[False], counts.sum(axis=1)

    def norm(c: pd.Series, cum: bool = False):
        return (c.cumsum() if cum else c) / c.sum() if c.sum() else [None] * len(c)

    youngest = int(tot.gt(0).idxmax())
    return sanitize({
        "available": True, "ages": list(range(1, top + 1)),
        "hist_accepted": norm(acc), "hist_rejected": norm(rej),
        "cdf_accepted": norm(acc, True), "cdf_rejected": norm(rej, True),
        "scanned_by_age": tot, "accept_rate_by_age": (acc / tot).where(tot > 0),
        "accepted": distribution(ex.loc[ex["scan_pass"].eq(True), "age"]),
        "rejected": distribution(ex.loc[~ex["scan_pass"].eq(True), "age"]),
        "reject_share_youngest": {"age": youngest, "share": rej[youngest] / tot[youngest]},
    })


def pool_ages(steps: pd.DataFrame, groups: pd.DataFrame) -> tuple[list[int], list[int]]:
    """Ages of every (update, buffered group) pair, and the steps whose reconstructed pool size differs from the
    recorded ``buffer_size`` (lifetime records missing, e.g. a run that did not close cleanly)."""
    birth = col(groups, "birth_step").to_numpy()
    evicted = col(groups, "evicted_step").fillna(np.inf).to_numpy()
    upd = updates(steps)
    t = upd["step"].to_numpy(dtype=float)[:, None]
    inside = (birth < t) & (evicted >= t)  # (updates, groups): g in the pre-step buffer of the update
    size = col(upd, "buffer_size").to_numpy()
    mismatch = [int(s) for s, k, n in zip(upd["step"], size, inside.sum(axis=1)) if not np.isnan(k) and int(k) != n]
    return (t - birth)[inside].astype(int).tolist(), mismatch


def _age_shares(ages: Sequence[int]) -> dict[str, Any]:
    a = pd.Series(ages, dtype=float)
    return {**distribution(a), "share_age_ge2": share(a >= 2), "share_age_ge3": share(a >= 3)}


def used_ages(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per replayed group: step, age (from ``accepted_ages``)."""
    ex = steps[["step", "accepted_ages"]].explode("accepted_ages")
    return ex.assign(age=numeric(ex["accepted_ages"]))[["step", "age"]].dropna()


def staleness(steps: pd.DataFrame, groups: pd.DataFrame) -> dict[str, Any]:
    """Source staleness of the replay pool and of the used subset.

    Returns {"pool": {n, mean, median, p90, max, share_age_ge2, share_age_ge3} or unavailable, "used": same,
    "pool_size_mismatch_steps": [...]}."""
    if not len(steps):
        return unavailable("no replay step records")
    used = used_ages(steps)["age"]
    out: dict[str, Any] = {"available": True,
                           "used": _age_shares(used) if len(used) else unavailable("nothing was replayed"),
                           "pool": unavailable("no groups.jsonl lifetime records"), "pool_size_mismatch_steps": []}
    if len(groups):
        ages, out["pool_size_mismatch_steps"] = pool_ages(steps, groups)
        out["pool"] = _age_shares(ages) if ages else unavailable("the buffer was never non-empty")
    return sanitize(out)


def mixing(steps: pd.DataFrame) -> dict[str, Any]:
    """Mixing structure of the used replay subset over the updates that replayed something.

    Returns {"n_replay_updates", "n_replay_groups", "mean_age", "share_age1", "share_age_ge3",
    "mean_distinct_ages", "share_updates_ge3_ages", "share_updates_age1_and_ge3"} (None when nothing replayed)."""
    used = used_ages(steps)
    per = used.groupby("step")["age"].agg(distinct="nunique", has1=lambda a: (a == 1).any(), top="max")
    return sanitize({
        "n_replay_updates": len(per), "n_replay_groups": len(used), "mean_age": opt(used["age"].mean()),
        "share_age1": share(used["age"] == 1), "share_age_ge3": share(used["age"] >= 3),
        "mean_distinct_ages": opt(per["distinct"].mean()) if len(per) else None,
        "share_updates_ge3_ages": share(per["distinct"] >= 3),
        "share_updates_age1_and_ge3": share(per["has1"].astype(bool) & (per["top"] >= 3)),
    })


def phase_mixture(steps: pd.DataFrame, *, n_phases: int = 4, bounds: Sequence[int] | None = None) -> dict[str, Any]:
    """The replay mixture (:func:`mixing`) in each training phase.

    Phases are ``n_phases`` contiguous equal-count pieces of the step records, or, with ``bounds = [b1, b2, ...]``
    (increasing steps), [first, b1), [b1, b2), ..., [b_last, end].
    Returns {"phases": [{"name", "first_step", "last_step", "n_steps", **mixing}], "how"}.
    """
    if not len(steps):
        return unavailable("no replay step records")
    if bounds:
        b = [int(x) for x in bounds]
        if any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"phase bounds must increase, got {b}")
        labels = pd.cut(steps["step"], [-np.inf, *b, np.inf], right=False, labels=False)
        n, how = len(b) + 1, f"step bounds {b}"
    else:
        if n_phases < 1:
            raise ValueError(f"n_phases must be >= 1, got {n_phases}")
        labels, n, how = pieces(len(steps), n_phases), n_phases, f"{n_phases} equal-count pieces of the step records"
    parts = dict(list(steps.groupby(np.asarray(labels))))
    phases = []
    for i in range(n):
        part = parts.get(i, steps.iloc[:0])
        phases.append({"name": f"phase {i + 1}", "n_steps": len(part),
                       "first_step": part["step"].iloc[0] if len(part) else None,
                       "last_step": part["step"].iloc[-1] if len(part) else None, **mixing(part)})
    return sanitize({"available": True, "phases": phases, "how": how})
