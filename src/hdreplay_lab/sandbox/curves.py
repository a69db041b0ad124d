"""Efficiency curves: held-out Mean@n against steps, fresh responses and wall-clock.

Each run writes ``curve.jsonl`` (runner.py): macro Mean@n on a fixed prompt subset every k steps and at
step 0, with the fresh responses, the wall-clock (held-out evaluation excluded) and the cumulative
generated tokens at that point.  From the curves of one method's seeds this module computes:

* the seed-mean curve (all seeds evaluate at the same steps);
* area under the curve: the trapezoid mean of macro Mean@n over the steps, per seed (the mean accuracy
  held during training, in Mean@n units);
* the cost to reach a target accuracy: the first point where the seed-mean curve reaches it, linearly
  interpolated between evaluation points, in steps, fresh responses and wall-clock seconds.

Wall-clock under another rollout cost: a run made with ``c`` ms/token and generating ``T`` tokens up to a
point took ``w`` seconds; with ``c'`` it takes ``w + (c' - c) T / 1000`` (the cost is a sleep, see
instrument.py): :func:`wall_at_cost`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np


def read_curve(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "curve.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def wall_at_cost(wall_s, cum_gen_tokens, run_ms_per_token: float, ms_per_token: float):
    """Wall-clock seconds of the same run under another modelled per-token rollout cost."""
    return np.asarray(wall_s, dtype=np.float64) + (ms_per_token - run_ms_per_token) / 1000.0 * np.asarray(
        cum_gen_tokens, dtype=np.float64)


def stack(curves: Sequence[list[dict]], key: str) -> np.ndarray:
    """(seeds, points) array of ``key`` over the evaluation points every seed has (shortest curve wins)."""
    k = min(len(c) for c in curves)
    steps = [[p["step"] for p in c[:k]] for c in curves]
    if any(s != steps[0] for s in steps):
        raise ValueError("the seeds' curves were evaluated at different steps")
    return np.asarray([[p[key] for p in c[:k]] for c in curves], dtype=np.float64)


def auc(steps, values) -> np.ndarray:
    """Trapezoid mean of ``values`` over ``steps``: values (..., points) -> (...)."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if x.size < 2 or x[-1] <= x[0]:
        raise ValueError("area under the curve needs at least two evaluation points at increasing steps")
    return np.trapezoid(y, x, axis=-1) / (x[-1] - x[0])


def first_reach(x, y, target: float) -> float | None:
    """The x where y first reaches ``target`` (linear interpolation between points); None if it never does."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    hit = np.nonzero(y >= target)[0]
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0))


def method_curve(curves: Sequence[list[dict]], *, run_ms_per_token: float, model_ms_per_token: float) -> dict:
    """Seed-mean curve of one method and its per-seed areas (see the module docstring)."""
    steps = stack(curves, "step")[0]
    acc = stack(curves, "macro_mean_at_n")
    wall = stack(curves, "wall_s")
    tokens = stack(curves, "cum_gen_tokens")
    return {
        "step": steps.tolist(),
        "fresh_responses": stack(curves, "fresh_responses")[0].tolist(),
        "mean_at_n": acc.mean(axis=0).tolist(),
        "mean_at_n_seeds": acc.tolist(),
        "wall_s": wall.mean(axis=0).tolist(),
        "wall_s_modelled": wall_at_cost(wall, tokens, run_ms_per_token, model_ms_per_token).mean(axis=0).tolist(),
        "auc_seeds": auc(steps, acc).tolist(),
    }


def cost_to_target(curve: dict, target: float) -> dict:
    """Steps, fresh responses and wall-clock (native and modelled) at which the seed-mean curve reaches target."""
    out = {}
    for key in ("step", "fresh_responses", "wall_s", "wall_s_modelled"):
        out[key] = first_reach(curve[key], curve["mean_at_n"], target)
    return out
