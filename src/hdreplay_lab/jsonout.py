"""Strict JSON for the lab's result files: what ``jq``, JavaScript's ``JSON.parse`` and pandas' strict readers accept.

Python's ``json.dumps`` writes ``NaN`` / ``Infinity`` by default, which strict JSON readers reject.  Result files
write a non-finite float as: NaN -> ``null`` (not defined, e.g. a crossover neither method reaches), +inf ->
``"inf"``, -inf -> ``"-inf"`` (e.g. a crossover that is "never": ``float("inf")`` reads it back).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def finite(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, numbers, NumPy scalars / arrays) with every non-finite float replaced."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return finite(obj.tolist())
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if obj != obj else ("inf" if obj > 0 else "-inf")
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(obj)``, refusing anything non-finite left (``allow_nan=False``)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
