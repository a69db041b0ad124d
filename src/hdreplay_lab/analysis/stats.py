"""Small numeric helpers shared by the sections (pure, deterministic).

Conventions used across the package:
    * a missing, ``None`` or non-finite value is "not available": means skip it, JSON shows ``null``;
    * shares are fractions in [0, 1] (the markdown shows percentages);
    * training *intervals* are three contiguous equal-count pieces (early / middle / final) of a run's records in
      step order; like ``numpy.array_split``, the first pieces take the extra records.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

INTERVALS = ("early", "middle", "final")


def num(x: Any) -> float | None:
    """``x`` as a finite float, or None (for None, NaN, inf, bools, strings, ...)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    return float(x) if math.isfinite(x) else None


def numeric(s: pd.Series) -> pd.Series:
    """A column as float64 with everything that is not a finite number (:func:`num`) as NaN."""
    if s.dtype.kind not in "iuf":
        s = s.map(num)
    return s.astype("float64").replace([np.inf, -np.inf], np.nan)


def pieces(n: int, k: int) -> np.ndarray:
    """The piece (0..k-1) of each of ``n`` ordered items cut into ``k`` contiguous near-equal pieces."""
    return np.repeat(np.arange(k), [n // k + (i < n % k) for i in range(k)])


def opt(x: Any) -> float | None:
    """A pandas/numpy scalar as float, NaN -> None."""
    return None if x is None or pd.isna(x) else float(x)


def interval_means(values: Iterable[Any]) -> dict[str, float | None]:
    """Mean of the finite values in each third of ``values`` (ordered by step): early/middle/final."""
    s = numeric(pd.Series(list(values), dtype=object))
    m = s.groupby(pieces(len(s), 3)).mean().reindex(range(3))
    return {name: opt(v) for name, v in zip(INTERVALS, m)}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b <= 0."""
    return None if a is None or b is None or b <= 0 else a / b


def running_mean(x: pd.Series, y: pd.Series, window: int) -> dict[str, list]:
    """Trailing mean of ``y`` over its last ``window`` available points: {"step": [...], "value": [...]}
    of the points whose y is finite."""
    if window < 1:
        raise ValueError(f"running-mean window must be >= 1, got {window}")
    s = pd.Series(numeric(pd.Series(list(y), dtype=object)).to_numpy(), index=list(x)).dropna()
    return {"step": s.index.tolist(), "value": s.rolling(window, min_periods=1).mean().tolist()}


def distribution(values: Iterable[Any]) -> dict[str, float | int | None]:
    """n, mean, median, P90 and max of the finite values.  P90 is the inverted-CDF percentile (the smallest
    observed v with P(X <= v) >= 0.9), so it is an observed value; the median is the midpoint of the two middle
    values for an even count."""
    a = numeric(pd.Series(list(values), dtype=object)).dropna().to_numpy()
    if not a.size:
        return {"n": 0, "mean": None, "median": None, "p90": None, "max": None}
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90, method="inverted_cdf")), "max": float(a.max())}


def share(flags: pd.Series) -> float | None:
    """Fraction of True, None if empty."""
    return float(flags.mean()) if len(flags) else None


def sanitize(obj: Any) -> Any:
    """A JSON-safe copy: non-finite floats -> None, numpy/pandas scalars and arrays -> Python, tuples -> lists."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray, pd.Series, pd.Index)):
        return [sanitize(v) for v in list(obj)]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(float(obj)) else None
    return None if obj is pd.NA else obj


def check_settings(obj: Any, *, counts: tuple = (), finite: tuple = (), fractions: tuple = (),
                   flags: dict = {}) -> None:
    """Refuse (AnalysisInputError naming the field and its flag) a count < 1, a non-finite number or a fraction
    outside [0, 1] among the named fields of a settings dataclass."""
    from .load import AnalysisInputError

    for names, ok, what in ((counts, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                             "an int >= 1"),
                            (finite, lambda v: num(v) is not None, "a finite number"),
                            (fractions, lambda v: num(v) is not None and 0 <= v <= 1, "a fraction in [0, 1]")):
        for name in names:
            if not ok(getattr(obj, name)):
                flag = flags.get(name, "--" + name.replace("_", "-"))
                raise AnalysisInputError(f"{name} ({flag}) must be {what}, got {getattr(obj, name)!r}")


def unavailable(reason: str) -> dict[str, Any]:
    """The marker a section returns when the run cannot provide it."""
    return {"available": False, "reason": reason}
