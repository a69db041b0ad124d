"""Entropy-collapse timing at a matched training score (report section 8; paper Appendix E.3.1).

For a run with training score S and policy entropy H logged at log points (train_log.jsonl), a score
anchor s0 and entropy thresholds H_L < H_U:

    t_first    = t_first(S >= s0): the step of the first log point with S >= s0
    t_entry    = t_entry(H <= H_L): the step of the first log point that starts ``entry_hold`` (10)
                 consecutive log points all with H <= H_L (the onset of the held run)
    t_rebound  = t_rebound(H >= H_U): the step of the first log point at or after t_entry that starts
                 ``rebound_hold`` (5) consecutive log points all with H >= H_U
    Delta_entry   = t_entry - t_first      (may be negative if entropy collapses before the anchor)
    Delta_rebound = t_rebound - t_entry

"Consecutive log points" are consecutive entries of the series that has the key (log entries without
a finite value for it are dropped first).  Times and delays are in trainer steps.  An event that never
happens is None, with the reason in ``notes``; a delay is None when either end is None.
The defaults are the paper's: s0 = 0.40, H_L = 0.03, H_U = 0.04.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from .load import AnalysisInputError
from .stats import num


@dataclass(frozen=True)
class EntropyThresholds:
    """s0 (score anchor), H_L < H_U (entropy thresholds) and the hold lengths in log points."""

    score_anchor: float = 0.40
    entropy_low: float = 0.03
    entropy_high: float = 0.04
    entry_hold: int = 10
    rebound_hold: int = 5

    def __post_init__(self) -> None:
        for name in ("score_anchor", "entropy_low", "entropy_high"):
            if num(getattr(self, name)) is None:
                raise AnalysisInputError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not self.entropy_low < self.entropy_high:
            raise AnalysisInputError(f"need entropy_low (H_L) < entropy_high (H_U), got H_L={self.entropy_low:g}, "
                             f"H_U={self.entropy_high:g}; pass a smaller --entropy-low or larger --entropy-high")
        for name in ("entry_hold", "rebound_hold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AnalysisInputError(f"{name} must be an int >= 1 (log points), got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_reach(values: Sequence[float], pred: Callable[[float], bool]) -> int | None:
    """Index of the first value satisfying ``pred``, or None."""
    return next((i for i, v in enumerate(values) if pred(v)), None)


def first_held(values: Sequence[float], pred: Callable[[float], bool], hold: int, start: int = 0) -> int | None:
    """Index i >= start of the first run of ``hold`` consecutive values all satisfying ``pred``."""
    run = 0
    for i in range(start, len(values)):
        run = run + 1 if pred(values[i]) else 0
        if run == hold:
            return i - hold + 1
    return None


def collapse_timing(score: tuple[Sequence[int], Sequence[float]], entropy: tuple[Sequence[int], Sequence[float]],
                    th: EntropyThresholds = EntropyThresholds()) -> dict[str, Any]:
    """t_first, t_entry, t_rebound and the two delays (see module docstring).

    Args:
        score:   (steps, S) of the log points that have a score, step order.
        entropy: (steps, H) of the log points that have an entropy, step order.
    Returns {"t_first", "t_entry", "t_rebound", "delta_entry", "delta_rebound", "n_score_points",
    "n_entropy_points", "notes": [why an event is None]}.
    """
    s_steps, s_vals = score
    h_steps, h_vals = entropy
    notes: list[str] = []
    i_first = first_reach(s_vals, lambda v: v >= th.score_anchor)
    if not s_vals:
        notes.append("no score in the trainer log")
    elif i_first is None:
        notes.append(f"score never reached s0={th.score_anchor:g} (max {max(s_vals):.4g})")
    i_entry = first_held(h_vals, lambda v: v <= th.entropy_low, th.entry_hold)
    i_reb = None
    if not h_vals:
        notes.append("no entropy in the trainer log")
    elif i_entry is None:
        notes.append(f"entropy never stayed <= H_L={th.entropy_low:g} for {th.entry_hold} log points "
                     f"(min {min(h_vals):.4g})")
    else:
        i_reb = first_held(h_vals, lambda v: v >= th.entropy_high, th.rebound_hold, start=i_entry)
        if i_reb is None:
            notes.append(f"no rebound: entropy never stayed >= H_U={th.entropy_high:g} for "
                         f"{th.rebound_hold} log points after entry")
    t_first = s_steps[i_first] if i_first is not None else None
    t_entry = h_steps[i_entry] if i_entry is not None else None
    t_reb = h_steps[i_reb] if i_reb is not None else None
    return {
        "t_first": t_first,
        "t_entry": t_entry,
        "t_rebound": t_reb,
        "delta_entry": t_entry - t_first if t_entry is not None and t_first is not None else None,
        "delta_rebound": t_reb - t_entry if t_reb is not None and t_entry is not None else None,
        "n_score_points": len(s_vals),
        "n_entropy_points": len(h_vals),
        "notes": notes,
    }
