"""Trainer-log series (train_log.jsonl: TRL log_history entries) and their interval summaries."""

from __future__ import annotations

from typing import Any, Sequence

from .stats import interval_means, num, unavailable


def log_series(train_log: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the log entries with an integer ``step`` and a finite ``key`` value.

    If no entry has ``key``, ``"train/" + key`` is tried.  Sorted by step (stable); when a step
    repeats, the last entry of that step wins.
    """
    for k in (key, f"train/{key}"):
        by_step: dict[int, float] = {}
        for e in train_log:
            s, v = e.get("step"), num(e.get(k))
            if isinstance(s, bool) or not isinstance(s, (int, float)) or v is None:
                continue
            by_step[int(s)] = v
        if by_step:
            steps = sorted(by_step)
            return steps, [by_step[s] for s in steps]
    return [], []


def series_summary(steps: Sequence[int], values: Sequence[float]) -> dict[str, Any]:
    """{"n", "first_step", "last_step", "first", "last", "max", "min", "by_interval"} of one series."""
    if not values:
        return unavailable("key not in the trainer log")
    return {"available": True, "n": len(values), "first_step": steps[0], "last_step": steps[-1],
            "first": values[0], "last": values[-1], "max": max(values), "min": min(values),
            "by_interval": interval_means(values)}


def training(train_log: Sequence[dict], *, score_key: str = "reward", entropy_key: str = "entropy") -> dict[str, Any]:
    """Score and entropy curves with their summaries.

    Returns {"score": {"key", "step", "value", **series_summary}, "entropy": {...}} or an unavailable
    marker when there is no trainer log.
    """
    if not train_log:
        return unavailable("no train_log.jsonl")
    out: dict[str, Any] = {"available": True}
    for name, key in (("score", score_key), ("entropy", entropy_key)):
        steps, vals = log_series(train_log, key)
        out[name] = {"key": key, "step": steps, "value": vals, **series_summary(steps, vals)}
    return out


def final_metrics(metrics: dict | None) -> dict[str, float]:
    """The numeric top-level values of metrics.json (final evaluation), {} if absent."""
    if not metrics:
        return {}
    return {k: v for k, v in ((k, num(v)) for k, v in metrics.items()) if v is not None}
