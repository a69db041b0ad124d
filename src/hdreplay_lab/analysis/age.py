"""Replay age (report sections 4 and 9): Drift-gate outcome by age, source staleness of the replay
pool and of the used subset, mixing structure, and the phase-wise replay mixture.

age_t(g) = t - t0(g) (paper Table of notation), >= 1 for every buffered group.  Populations:
    scanned   groups the gate examined at a step (steps.jsonl ``scan_age`` / ``scan_pass``):
              accepted = passed the gate, rejected = failed it
    used      groups actually replayed (``accepted_ages``, after truncation to a multiple of u)
    pool      every group in the pre-step buffer at every update, reconstructed from groups.jsonl:
              g is in the buffer at step t iff birth_step < t <= evicted_step (evicted_step null =
              still buffered at the end)
Mixing statistics are over updates that replayed at least one group.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .gate import is_update
from .stats import distribution, finite, mean, num, share, split_thirds, unavailable


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (num(x) for x in (values or [])) if v is not None]


def age_gate(steps: Sequence[dict]) -> dict[str, Any]:
    """Age of scanned groups by gate outcome.

    Returns {"ages": [1..max], "hist_accepted"/"hist_rejected": share of each population at each age,
    "cdf_accepted"/"cdf_rejected": empirical CDF at each age, "scanned_by_age": counts,
    "accept_rate_by_age": passes / scanned at each age (None where nothing was scanned),
    "accepted"/"rejected": distribution summaries, "reject_share_youngest": rejected share at the
    youngest scanned age}.
    """
    acc: list[int] = []
    rej: list[int] = []
    for r in steps:
        for a, ok in zip(_ints(r.get("scan_age")), r.get("scan_pass") or []):
            (acc if ok else rej).append(a)
    if not acc and not rej:
        return unavailable("no scanned groups with recorded ages")
    top = max(acc + rej)
    ages = np.arange(1, top + 1)
    ca = np.bincount(np.asarray(acc, dtype=np.int64), minlength=top + 1)[1:]
    cr = np.bincount(np.asarray(rej, dtype=np.int64), minlength=top + 1)[1:]
    tot = ca + cr
    youngest = int(np.flatnonzero(tot)[0])

    def norm(c: np.ndarray) -> list[float | None]:
        return (c / c.sum()).tolist() if c.sum() else [None] * len(c)

    def cdf(c: np.ndarray) -> list[float | None]:
        return (np.cumsum(c) / c.sum()).tolist() if c.sum() else [None] * len(c)

    return {
        "available": True,
        "ages": ages.tolist(),
        "hist_accepted": norm(ca),
        "hist_rejected": norm(cr),
        "cdf_accepted": cdf(ca),
        "cdf_rejected": cdf(cr),
        "scanned_by_age": tot.tolist(),
        "accept_rate_by_age": [float(a / t) if t else None for a, t in zip(ca, tot)],
        "accepted": distribution(acc),
        "rejected": distribution(rej),
        "reject_share_youngest": {"age": youngest + 1, "share": float(cr[youngest] / tot[youngest])},
    }


def pool_ages(steps: Sequence[dict], groups: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Ages of every (update, buffered group) pair, and the steps whose reconstructed pool size differs
    from the recorded ``buffer_size`` (lifetime records missing, e.g. a run that did not close cleanly)."""
    birth = np.asarray([g["birth_step"] for g in groups], dtype=np.int64)
    ev = np.asarray([np.iinfo(np.int64).max if g.get("evicted_step") is None else g["evicted_step"]
                     for g in groups], dtype=np.int64)
    ages: list[int] = []
    mismatch: list[int] = []
    for r in steps:
        if not is_update(r):
            continue
        t = r["step"]
        inside = (birth < t) & (ev >= t)
        ages.extend((t - birth[inside]).tolist())
        size = num(r.get("buffer_size"))
        if size is not None and int(size) != int(inside.sum()):
            mismatch.append(t)
    return ages, mismatch


def _age_shares(ages: Sequence[int]) -> dict[str, Any]:
    d = distribution(ages)
    a = finite(ages)
    d["share_age_ge2"] = float((a >= 2).mean()) if a.size else None
    d["share_age_ge3"] = float((a >= 3).mean()) if a.size else None
    return d


def staleness(steps: Sequence[dict], groups: Sequence[dict]) -> dict[str, Any]:
    """Source staleness of the replay pool and of the used subset.

    Returns {"pool": {n, mean, median, p90, max, share_age_ge2, share_age_ge3} or unavailable,
    "used": same, "pool_size_mismatch_steps": [...]}.
    """
    used = [a for r in steps for a in _ints(r.get("accepted_ages"))]
    if not steps:
        return unavailable("no replay step records")
    out: dict[str, Any] = {"available": True, "used": _age_shares(used) if used else
                           unavailable("nothing was replayed")}
    if groups:
        ages, mismatch = pool_ages(steps, groups)
        out["pool"] = _age_shares(ages) if ages else unavailable("the buffer was never non-empty")
        out["pool_size_mismatch_steps"] = mismatch
    else:
        out["pool"] = unavailable("no groups.jsonl lifetime records")
        out["pool_size_mismatch_steps"] = []
    return out


def mixing(steps: Sequence[dict]) -> dict[str, Any]:
    """Mixing structure of the used replay subset over the updates that replayed something.

    Returns {"n_replay_updates", "n_replay_groups", "mean_age", "share_age1", "share_age_ge3",
    "mean_distinct_ages", "share_updates_ge3_ages", "share_updates_age1_and_ge3"}; values are None
    when no update replayed anything.
    """
    per = [_ints(r.get("accepted_ages")) for r in steps]
    per = [a for a in per if a]
    flat = [a for ages in per for a in ages]
    return {
        "n_replay_updates": len(per),
        "n_replay_groups": len(flat),
        "mean_age": mean(flat),
        "share_age1": share(a == 1 for a in flat),
        "share_age_ge3": share(a >= 3 for a in flat),
        "mean_distinct_ages": mean(len(set(a)) for a in per),
        "share_updates_ge3_ages": share(len(set(a)) >= 3 for a in per),
        "share_updates_age1_and_ge3": share(1 in a and max(a) >= 3 for a in per),
    }


def phase_mixture(steps: Sequence[dict], *, n_phases: int = 4,
                  bounds: Sequence[int] | None = None) -> dict[str, Any]:
    """The replay mixture (see :func:`mixing`) in each training phase.

    Phases are either ``n_phases`` contiguous equal-count pieces of the step records, or, with
    ``bounds = [b1, b2, ...]`` (increasing steps), [first, b1), [b1, b2), ..., [b_last, end].
    Returns {"phases": [{"name", "first_step", "last_step", "n_steps", **mixing}], "how"}.
    """
    if not steps:
        return unavailable("no replay step records")
    if bounds:
        b = [int(x) for x in bounds]
        if any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"phase bounds must increase, got {b}")
        edges = [-np.inf, *b, np.inf]
        parts = [[r for r in steps if lo <= r["step"] < hi] for lo, hi in zip(edges, edges[1:])]
        how = f"step bounds {b}"
    else:
        if n_phases < 1:
            raise ValueError(f"n_phases must be >= 1, got {n_phases}")
        parts = split_thirds(list(steps), parts=n_phases)
        how = f"{n_phases} equal-count pieces of the step records"
    phases = []
    for i, part in enumerate(parts, start=1):
        phases.append({
            "name": f"phase {i}",
            "first_step": part[0]["step"] if part else None,
            "last_step": part[-1]["step"] if part else None,
            "n_steps": len(part),
            **mixing(part),
        })
    return {"available": True, "phases": phases, "how": how}
