"""Small numeric helpers shared by the analysis sections (pure, deterministic).

Conventions used across the package:
    * a value that is missing, ``None`` or non-finite is "not available" and is skipped by means;
    * shares are fractions in [0, 1] (rendered as percentages in the markdown);
    * training *intervals* are the three contiguous, equal-count thirds (early / middle / final) of a
      run's records in step order (``numpy.array_split``: the first thirds get the extra records).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

INTERVALS = ("early", "middle", "final")


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (for None, NaN, inf, bools, strings, ...)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def finite(values: Iterable[Any]) -> np.ndarray:
    """The finite numbers of ``values`` as a float64 array (others dropped)."""
    return np.asarray([v for v in (num(x) for x in values) if v is not None], dtype=np.float64)


def mean(values: Iterable[Any]) -> float | None:
    """Mean of the finite values, or None if there are none."""
    a = finite(values)
    return float(a.mean()) if a.size else None


def split_thirds(items: Sequence[Any], parts: int = 3) -> list[list[Any]]:
    """``items`` cut into ``parts`` contiguous near-equal pieces (earlier pieces get the extras)."""
    idx = np.array_split(np.arange(len(items)), parts)
    return [[items[i] for i in ix.tolist()] for ix in idx]


def interval_means(values: Sequence[Any]) -> dict[str, float | None]:
    """Mean of the finite values in each third of ``values`` (ordered by step): early/middle/final."""
    return {name: mean(part) for name, part in zip(INTERVALS, split_thirds(list(values)))}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b <= 0."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def running_mean(xs: Sequence[Any], ys: Sequence[Any], window: int) -> tuple[list[float], list[float]]:
    """Trailing running mean over the last ``window`` available points.

    Points whose y is not finite are dropped first.  Returns (x, smoothed y) of the kept points.
    """
    if window < 1:
        raise ValueError(f"running-mean window must be >= 1, got {window}")
    pts = [(x, v) for x, v in zip(xs, (num(y) for y in ys)) if v is not None]
    if not pts:
        return [], []
    y = np.asarray([v for _, v in pts])
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - window, 0)
    sm = (c[i] - c[lo]) / (i - lo)
    return [x for x, _ in pts], sm.tolist()


def distribution(values: Iterable[Any]) -> dict[str, float | int | None]:
    """n, mean, median, P90 and max of the finite values.

    P90 is the inverted-CDF percentile (the smallest observed value v with P(X <= v) >= 0.9), so it is
    always an observed value (an integer for ages); the median is numpy's (midpoint of the two middle
    values for an even count).
    """
    a = finite(values)
    if not a.size:
        return {"n": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90, method="inverted_cdf")), "max": float(a.max())}


def share(flags: Iterable[bool]) -> float | None:
    """Fraction of True among ``flags``, None if empty."""
    f = [bool(x) for x in flags]
    return sum(f) / len(f) if f else None


def sanitize(obj: Any) -> Any:
    """A JSON-safe copy: non-finite floats -> None, numpy scalars/arrays -> Python, tuples -> lists."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return sanitize(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(float(obj)) else None
    return obj


def unavailable(reason: str) -> dict[str, Any]:
    """The marker a section returns when the run cannot provide it."""
    return {"available": False, "reason": reason}
