"""Argument checks shared by every public boundary, and the limits they enforce.

Every public call of the package checks *all* of its arguments with these helpers before it
changes anything, so a refused call leaves no trace.  Each helper raises the project's own error
(``err``: :class:`~hdreplay.errors.ReplayInputError` by default) with a message that names the
argument, shows what was passed and says what is expected; none of them coerces a value of the
wrong kind (a bool is not an int, a string is not a number, a float is not a token id).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np
import torch

from .errors import ReplayConfigError, ReplayInputError

#: upper bound on a buffer capacity (groups): a capacity is a promise the buffer can keep
MAX_CAPACITY = 1 << 24
#: upper bound on K_rep, chunk sizes, group sizes and the truncation multiple
MAX_COUNT = 1 << 24
#: steps (and birth steps) lie in [0, MAX_STEP): exact as float64 and as a JSON number everywhere
MAX_STEP = 1 << 53
#: largest token budget accepted (tokens of one forward)
MAX_TOKENS = 1 << 40
#: token ids are stored as int32: 0 <= id < MAX_TOKEN_ID
MAX_TOKEN_ID = 1 << 31
#: upper bound on data-parallel parts (ranks) of a batch layout
MAX_PARTS = 1 << 16


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(x: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x: Any) -> bool:
    """A Python or NumPy int/float, not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, value: Any, *, lo: int = 0, hi: int = MAX_COUNT, err=ReplayInputError) -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (Python or NumPy integer; bools refused)."""
    if not is_int(value) or not lo <= int(value) <= hi:
        raise err(f"{name}: must be an int in [{lo}, {hi}], got {_show(value)}", **_field(err, name))
    return int(value)


def check_step(name: str, value: Any, *, err=ReplayInputError) -> int:
    """A training step: an int in ``[0, MAX_STEP)``."""
    return check_int(name, value, lo=0, hi=MAX_STEP - 1, err=err)


def check_real(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, err=ReplayInputError) -> float:
    """``value`` as a finite ``float`` within the bounds (``lo_open``: ``lo`` itself excluded)."""
    ok = is_real(value) and math.isfinite(float(value))
    if ok and lo is not None:
        ok = float(value) > lo if lo_open else float(value) >= lo
    if ok and hi is not None:
        ok = float(value) <= hi
    if not ok:
        lb = "unbounded" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        ub = "" if hi is None else f" and <= {hi:g}"
        raise err(f"{name}: must be a finite number ({lb}{ub}), got {_show(value)}", **_field(err, name))
    return float(value)


def check_bool(name: str, value: Any, *, err=ReplayInputError) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise err(f"{name}: must be True or False, got {_show(value)}", **_field(err, name))
    return bool(value)


def check_str(name: str, value: Any, choices: tuple | list | Mapping, *, err=ReplayInputError) -> str:
    """One of ``choices`` (strings only: an unhashable or non-str value is refused, not looked up)."""
    if not isinstance(value, str) or value not in choices:
        raise err(f"{name}: unknown value {_show(value)}; valid: {sorted(choices)}", **_field(err, name))
    return value


def check_sequence(name: str, value: Any, *, err=ReplayInputError) -> list:
    """A list or tuple (not a string, mapping, tensor or generator) as a new list."""
    if not isinstance(value, (list, tuple)):
        raise err(f"{name}: must be a list or tuple, got {type(value).__name__}", **_field(err, name))
    return list(value)


def check_path(what: str, directory: Any) -> None:
    """A file-system path (str or os.PathLike)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ReplayInputError(f"{what}: directory must be a path, got {type(directory).__name__}")


def check_ids(name: str, value: Any, *, unique: bool = True) -> np.ndarray:
    """A 1-D sequence of integer ids (list/tuple of ints, or an integer NumPy array / torch tensor)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        if not all(is_int(v) for v in value):
            raise ReplayInputError(f"{name}: must hold ints only, got {_show(list(value))}")
        arr = np.asarray([int(v) for v in value], dtype=np.int64).reshape(-1)
    elif isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iu"):
            raise ReplayInputError(f"{name}: must be a 1-D integer array, got dtype {value.dtype}, "
                                   f"shape {value.shape}")
        arr = value.astype(np.int64)
    else:
        raise ReplayInputError(f"{name}: must be a list of ints or a 1-D integer array, got {type(value).__name__}")
    if unique and arr.size != np.unique(arr).size:
        raise ReplayInputError(f"{name}: holds duplicate ids {_show(arr.tolist())}; each id may appear once")
    return arr


def check_reals(name: str, value: Any, size: int) -> np.ndarray:
    """``size`` finite numbers (list/tuple of numbers, or a 1-D float/int NumPy array / torch tensor)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        if not all(is_real(v) for v in value):
            raise ReplayInputError(f"{name}: must hold numbers only, got {_show(list(value))}")
        arr = np.asarray([float(v) for v in value], dtype=np.float64)
    elif isinstance(value, np.ndarray) and value.ndim == 1 and (value.size == 0 or value.dtype.kind in "iuf"):
        arr = value.astype(np.float64)
    else:
        raise ReplayInputError(f"{name}: must be a 1-D sequence of numbers, got {_show(value)}")
    if arr.size != size:
        raise ReplayInputError(f"{name}: has {arr.size} values, expected {size} (one per group)")
    if not np.isfinite(arr).all():
        raise ReplayInputError(f"{name}: has non-finite values {_show(arr.tolist())}")
    return arr


def _field(err, name: str) -> dict:
    """ReplayConfigError carries the field name; the other error classes take only the text."""
    return {"field": name} if isinstance(err, type) and issubclass(err, ReplayConfigError) else {}
