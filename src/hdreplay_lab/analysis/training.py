"""Trainer-log curves and entropy-collapse timing at a matched score (report section 8; paper Appendix E.3.1).

For a run with training score S and policy entropy H logged at log points, a score anchor s0 and entropy
thresholds H_L < H_U:

    t_first    the step of the first log point with S >= s0
    t_entry    the step of the first log point that starts ``entry_hold`` (10) consecutive log points all with
               H <= H_L (the onset of the held run)
    t_rebound  the step of the first log point at or after t_entry that starts ``rebound_hold`` (5) consecutive
               log points all with H >= H_U
    Delta_entry = t_entry - t_first (negative if entropy collapses before the anchor);
    Delta_rebound = t_rebound - t_entry

"Consecutive log points" are consecutive entries of the series that has the key (entries without a finite value
are dropped first).  Times are trainer steps.  An event that never happens is None with the reason in ``notes``;
a delay is None when either end is.  Defaults are the paper's: s0 = 0.40, H_L = 0.03, H_U = 0.04.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from .load import AnalysisInputError
from .stats import check_settings, interval_means, num, numeric, sanitize, unavailable


@dataclass(frozen=True)
class EntropyThresholds:
    """s0 (score anchor), H_L < H_U (entropy thresholds) and the hold lengths in log points."""

    score_anchor: float = 0.40
    """score anchor s0 of the entropy timing (paper: 0.40)"""
    entropy_low: float = 0.03
    """low-entropy threshold H_L (paper: 0.03)"""
    entropy_high: float = 0.04
    """rebound threshold H_U (paper: 0.04)"""
    entry_hold: int = 10
    """log points entropy must stay <= H_L for an entry"""
    rebound_hold: int = 5
    """log points entropy must stay >= H_U for a rebound"""

    def __post_init__(self) -> None:
        check_settings(self, finite=("score_anchor", "entropy_low", "entropy_high"),
                       counts=("entry_hold", "rebound_hold"))
        if not self.entropy_low < self.entropy_high:
            raise AnalysisInputError(f"need entropy_low (H_L) < entropy_high (H_U), got H_L={self.entropy_low:g}, "
                                     f"H_U={self.entropy_high:g}; pass a smaller --entropy-low or larger "
                                     "--entropy-high")


def log_series(log: pd.DataFrame, key: str) -> pd.Series:
    """``key`` of the log entries that have a numeric ``step`` and a finite value, indexed by step (sorted;
    a repeated step keeps its last entry).  ``"train/" + key`` is tried when no entry has ``key``."""
    for k in (key, f"train/{key}"):
        if k in log and "step" in log:
            d = pd.DataFrame({"step": numeric(log["step"]), "v": numeric(log[k])}).dropna()
            if len(d):
                d = d.drop_duplicates("step", keep="last").sort_values("step", kind="stable")
                return pd.Series(d["v"].to_numpy(), index=d["step"].astype(int).to_numpy(), name=key)
    return pd.Series(dtype=float, name=key)


def training(log: pd.DataFrame, *, score_key: str = "reward", entropy_key: str = "entropy") -> dict[str, Any]:
    """Score and entropy curves with their summaries: {"score": {"key", "step", "value", "n", "first_step",
    "last_step", "first", "last", "max", "min", "by_interval"}, "entropy": {...}} (a curve missing from the log is
    an unavailable marker with its key and empty step/value)."""
    if not len(log):
        return unavailable("no trainer log (train_log.jsonl, trainer_state.json or TensorBoard events)")
    out: dict[str, Any] = {"available": True}
    for name, key in (("score", score_key), ("entropy", entropy_key)):
        s = log_series(log, key)
        out[name] = {"key": key, "step": s.index, "value": s.to_numpy(), **(unavailable("key not in the trainer log")
                     if not len(s) else {"available": True, "n": len(s), "first_step": s.index[0],
                                         "last_step": s.index[-1], "first": s.iloc[0], "last": s.iloc[-1],
                                         "max": s.max(), "min": s.min(), "by_interval": interval_means(s)})}
    return sanitize(out)


def first_held(cond: pd.Series, hold: int, start: int = 0) -> int | None:
    """Position i >= start of the first run of ``hold`` consecutive True values of ``cond``, or None."""
    full = cond.iloc[start:].reset_index(drop=True).astype(int).rolling(hold).sum() == hold
    return int(full.idxmax()) - hold + 1 + start if full.any() else None


def collapse_timing(score: pd.Series, entropy: pd.Series,
                    th: EntropyThresholds = EntropyThresholds()) -> dict[str, Any]:
    """t_first, t_entry, t_rebound and the two delays (module docstring) from step-indexed score / entropy series.

    Returns {"t_first", "t_entry", "t_rebound", "delta_entry", "delta_rebound", "n_score_points",
    "n_entropy_points", "notes": [why an event is None]}."""
    notes: list[str] = []
    i_first = first_held(score >= th.score_anchor, 1)
    if not len(score):
        notes.append("no score in the trainer log")
    elif i_first is None:
        notes.append(f"score never reached s0={th.score_anchor:g} (max {score.max():.4g})")
    i_entry = first_held(entropy <= th.entropy_low, th.entry_hold)
    i_reb = None
    if not len(entropy):
        notes.append("no entropy in the trainer log")
    elif i_entry is None:
        notes.append(f"entropy never stayed <= H_L={th.entropy_low:g} for {th.entry_hold} log points "
                     f"(min {entropy.min():.4g})")
    else:
        i_reb = first_held(entropy >= th.entropy_high, th.rebound_hold, start=i_entry)
        if i_reb is None:
            notes.append(f"no rebound: entropy never stayed >= H_U={th.entropy_high:g} for {th.rebound_hold} "
                         "log points after entry")
    t = {name: (int(s.index[i]) if i is not None else None)
         for name, s, i in (("t_first", score, i_first), ("t_entry", entropy, i_entry), ("t_rebound", entropy, i_reb))}

    def delay(a: str, b: str) -> int | None:
        return t[b] - t[a] if t[a] is not None and t[b] is not None else None

    return {**t, "delta_entry": delay("t_first", "t_entry"), "delta_rebound": delay("t_entry", "t_rebound"),
            "n_score_points": len(score), "n_entropy_points": len(entropy), "notes": notes}


def final_metrics(metrics: dict | None) -> dict[str, float]:
    """The numeric top-level values of metrics.json (final evaluation), {} if absent."""
    return {k: v for k, v in ((k, num(v)) for k, v in (metrics or {}).items()) if v is not None}
