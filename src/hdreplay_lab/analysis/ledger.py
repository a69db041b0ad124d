"""The asynchronous pipeline's ledger (``async.jsonl``, :mod:`hdreplay.staleness.ledger`) as a report section.

Where every generated group of a run went: trained fresh, diverted to the buffer (and later admitted, evicted
unused, or still buffered), dropped; Drift of diverted groups at their first scan and at admission; the
sampler-vs-trainer floor; ages and completion lengths of trained vs discarded groups.  ``async.jsonl`` is looked for
(by :func:`~.load.load_run`) in the run directory, its replay diagnostics directory, ``hdreplay/``
(HDRAsyncGRPOTrainer's default) and ``replay/``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .load import LEDGER_FILE, RunData
from .stats import sanitize, unavailable

__all__ = ["LEDGER_FILE", "async_ledger"]


def _hist_sum(series) -> Counter:
    out: Counter = Counter()
    for h in series:
        if isinstance(h, dict):
            out.update({int(k): int(v) for k, v in h.items()})
    return out


def _mean_of(c: Counter) -> float | None:
    n = sum(c.values())
    return sum(k * v for k, v in c.items()) / n if n else None


def async_ledger(run: RunData) -> dict[str, Any]:
    """The ledger section of one run (``{"available": False, ...}`` for a run without ``async.jsonl``): its records
    as :func:`~.load.load_run` read and checked them (``run.ledger``)."""
    path, df = run.ledger_source, run.ledger
    if path is None:
        return unavailable("no async.jsonl (not an asynchronous run, or its ledger was not written)")
    if not len(df):
        return unavailable(f"{path} holds no ledger record")
    tot = dict(df["totals"].iloc[-1])
    gen, gen_tok = max(tot.get("generated_groups", 0), 1), max(tot.get("generated_tokens", 0), 1)
    drift = lambda col: [x for xs in df[col] if isinstance(xs, list) for x in xs if x is not None]  # noqa: E731
    dd, da = drift("drift_divert"), drift("drift_admit")
    ages = {k: _hist_sum(df["ages"].map(lambda a, k=k: a.get(k) if isinstance(a, dict) else None))
            for k in ("generated", "fresh", "diverted", "dropped", "admitted")}
    lens = {k: _hist_sum(df["lengths"].map(lambda a, k=k: a.get(k) if isinstance(a, dict) else None))
            for k in ("trained", "discarded")}
    floor = df["floor"] if "floor" in df else None
    ready = df["floor_ready"] if "floor_ready" in df else None
    first_ready = (int(df["step"][ready.fillna(False).astype(bool)].iloc[0])
                   if ready is not None and ready.fillna(False).astype(bool).any() else None)
    div = max(tot.get("diverted_groups", 0), 1)
    return sanitize({
        "available": True, "file": str(path), "updates": len(df), "totals": tot,
        "share": {"fresh": tot.get("fresh_groups", 0) / gen, "diverted": tot.get("diverted_groups", 0) / gen,
                  "dropped": tot.get("dropped_groups", 0) / gen,
                  "useful_groups": (tot.get("fresh_mixed_groups", 0) + tot.get("admitted_groups", 0)) / gen,
                  "useful_tokens": (tot.get("fresh_mixed_tokens", 0) + tot.get("admitted_tokens", 0)) / gen_tok,
                  "discarded_groups": (tot.get("dropped_groups", 0) + tot.get("evicted_unused_groups", 0)) / gen},
        "diverted_fate": {"admitted": tot.get("admitted_groups", 0) / div,
                          "evicted_unused": tot.get("evicted_unused_groups", 0) / div},
        "drift_divert": {"n": len(dd), "mean": float(np.mean(dd)) if dd else None,
                         "median": float(np.median(dd)) if dd else None},
        "drift_admit": {"n": len(da), "mean": float(np.mean(da)) if da else None,
                        "median": float(np.median(da)) if da else None},
        "floor": {"last": None if floor is None else floor.iloc[-1], "first_ready_step": first_ready},
        "age_mean": {k: _mean_of(v) for k, v in ages.items()},
        "age_hist": {k: {str(a): c for a, c in sorted(v.items())} for k, v in ages.items()},
        "length_mean": {k: _mean_of(v) for k, v in lens.items()},
        "length_hist": {k: {str(a): c for a, c in sorted(v.items())} for k, v in lens.items()},
    })


#: the report table's rows (name, path in the section, kind)
ROWS = [("updates", "updates", "int"), ("generated groups", "totals/generated_groups", "int"),
        ("trained fresh", "share/fresh", "pct"), ("diverted to the buffer", "share/diverted", "pct"),
        ("dropped (stale, zero-variance)", "share/dropped", "pct"),
        ("diverted, admitted later", "diverted_fate/admitted", "pct"),
        ("diverted, evicted unused", "diverted_fate/evicted_unused", "pct"),
        ("generated groups giving gradient", "share/useful_groups", "pct"),
        ("generated tokens giving gradient", "share/useful_tokens", "pct"),
        ("generated groups discarded", "share/discarded_groups", "pct"),
        ("Drift at divert (first scan), median", "drift_divert/median", "num"),
        ("Drift at admission, median", "drift_admit/median", "num"),
        ("floor (last)", "floor/last", "num"), ("floor measured from step", "floor/first_ready_step", "int"),
        ("mean age generated", "age_mean/generated", "num"), ("mean age admitted", "age_mean/admitted", "num"),
        ("mean completion length, trained", "length_mean/trained", "num"),
        ("mean completion length, discarded", "length_mean/discarded", "num")]
