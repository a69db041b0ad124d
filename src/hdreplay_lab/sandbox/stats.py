"""Paired bootstrap intervals for method differences over seeds and held-out prompts.

Design.  Every method of a comparison runs the same seeds (same warm start, same prompt order per
seed) and is evaluated on the same held-out prompts, so a difference is *paired* on both: for seed s and
prompt i of benchmark k, ``d[k][s, i] = score_B - score_A`` (per-prompt Mean@n).  The statistic is the
paper's macro Mean@n difference averaged over seeds::

    diff = mean_s  mean_k  mean_i  d[k][s, i]

Seeds and prompts are *crossed* (every seed sees every prompt), so one bootstrap replicate draws seeds
with replacement and, independently, prompts with replacement within each benchmark, the same prompt
draw for every seed (a prompt that is hard for every seed counts once per draw, as in the population it
samples).  Resampling is done with multinomial counts, so a replicate is one matrix product.  The
interval is the percentile interval of the replicates.

:func:`components` splits the half-width into its seed part (prompts held fixed) and prompt part (seeds
held fixed): the seed part shrinks as 1/sqrt(seeds), the prompt part does not, which gives the seeds a
target half-width needs (:func:`seeds_needed`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

Array = np.ndarray


def _check(d: Mapping[str, Array]) -> dict[str, Array]:
    if not d:
        raise ValueError("no benchmarks to compare")
    out = {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}
    seeds = {v.shape[0] if v.ndim == 2 else -1 for v in out.values()}
    if len(seeds) != 1 or -1 in seeds or min(v.shape[1] for v in out.values()) < 1:
        raise ValueError("each benchmark needs a (seeds, prompts) array with the same number of seeds, got "
                         f"shapes {[v.shape for v in out.values()]}")
    if not all(np.isfinite(v).all() for v in out.values()):
        raise ValueError("paired differences must be finite")
    return out


def paired_differences(a: Mapping[str, Array], b: Mapping[str, Array]) -> dict[str, Array]:
    """``b - a`` per benchmark; a[k], b[k]: (seeds, prompts) per-prompt scores, seeds and prompts aligned."""
    if set(a) != set(b):
        raise ValueError(f"benchmarks differ: {sorted(a)} vs {sorted(b)}")
    out = {}
    for k in a:
        x, y = np.asarray(a[k], dtype=np.float64), np.asarray(b[k], dtype=np.float64)
        if x.shape != y.shape:
            raise ValueError(f"benchmark {k}: shapes {x.shape} and {y.shape} are not paired (same seeds, prompts)")
        out[k] = y - x
    return out


def _replicates(d: dict[str, Array], reps: int, rng: np.random.Generator, *, seeds: bool, prompts: bool) -> Array:
    S = next(iter(d.values())).shape[0]
    per_seed = np.zeros((S, reps))  # macro difference of each seed under each replicate's prompt draw
    for v in d.values():
        P = v.shape[1]
        if prompts:
            w = rng.multinomial(P, np.full(P, 1.0 / P), size=reps).T / P  # (P, reps)
            per_seed += v @ w
        else:
            per_seed += v.mean(axis=1, keepdims=True)
    per_seed /= len(d)
    if not seeds:
        return per_seed.mean(axis=0)
    c = rng.multinomial(S, np.full(S, 1.0 / S), size=reps) / S  # (reps, S)
    return np.einsum("rs,sr->r", c, per_seed)


def paired_bootstrap(diffs: Mapping[str, Array], *, reps: int = 4000, level: float = 0.95,
                     seed: int = 0, also: Sequence[float] = ()) -> dict:
    """Point estimate and percentile interval of the seed-mean macro difference (see the module docstring).

    diffs[k]: (seeds, prompts_k) paired per-prompt differences of benchmark k.
    Returns diff, lo, hi, half_width, excludes_zero, seeds, prompts, reps, level; with ``also`` (further levels),
    ``also``: one {level, lo, hi, excludes_zero} per level from the same replicates (a Bonferroni level beside 95 %).
    """
    for lv in (level, *also):
        if not 0 < lv < 1:
            raise ValueError(f"level must be in (0, 1), got {lv}")
    if reps < 100:
        raise ValueError(f"reps must be >= 100 for a percentile interval, got {reps}")
    d = _check(diffs)
    point = float(np.mean([v.mean(axis=1) for v in d.values()], axis=0).mean())
    r = _replicates(d, reps, np.random.default_rng(seed), seeds=True, prompts=True)

    def interval(lv: float) -> dict:
        alpha = (1 - lv) / 2
        lo, hi = (float(x) for x in np.quantile(r, [alpha, 1 - alpha]))
        return {"level": lv, "lo": lo, "hi": hi, "excludes_zero": bool(lo > 0 or hi < 0)}

    main = interval(level)
    out = {"diff": point, "lo": main["lo"], "hi": main["hi"], "half_width": (main["hi"] - main["lo"]) / 2,
           "excludes_zero": main["excludes_zero"], "seeds": next(iter(d.values())).shape[0],
           "prompts": {k: v.shape[1] for k, v in d.items()}, "reps": reps, "level": level}
    if also:
        out["also"] = [interval(lv) for lv in also]
    return out


def components(diffs: Mapping[str, Array], *, reps: int = 4000, level: float = 0.95, seed: int = 0) -> dict:
    """Half-widths from resampling only seeds (prompts fixed) and only prompts (seeds fixed)."""
    d = _check(diffs)
    alpha = (1 - level) / 2
    out = {}
    for name, s, p in (("seed_half_width", True, False), ("prompt_half_width", False, True)):
        r = _replicates(d, reps, np.random.default_rng(seed), seeds=s, prompts=p)
        lo, hi = np.quantile(r, [alpha, 1 - alpha])
        out[name] = float(hi - lo) / 2
    return out


def seeds_needed(half_width_seed: float, half_width_prompt: float, seeds: int, target: float) -> int | None:
    """Seeds for a total half-width <= target, if the seed part shrinks as 1/sqrt(seeds) and the parts add
    in quadrature (at least 2, the fewest a seed interval takes); None when the prompt part alone is >= target
    (more held-out prompts are needed).  Below ``seeds`` when the measured half-width is already inside the
    target: how far the seed count could drop, by the same extrapolation."""
    if seeds < 1 or target <= 0:
        raise ValueError(f"seeds must be >= 1 and target > 0, got seeds={seeds}, target={target}")
    room = target ** 2 - half_width_prompt ** 2
    if room <= 0:
        return None
    return max(2, int(np.ceil(seeds * half_width_seed ** 2 / room)))


def seed_bootstrap(values_a: Array, values_b: Array, *, reps: int = 4000, level: float = 0.95, seed: int = 0) -> dict:
    """Paired interval of mean(b - a) over seeds for a per-seed quantity (e.g. area under the curve)."""
    a, b = np.asarray(values_a, dtype=np.float64), np.asarray(values_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"need two aligned per-seed vectors with >= 2 seeds, got {a.shape} and {b.shape}")
    return paired_bootstrap({"value": (b - a)[:, None]}, reps=reps, level=level, seed=seed)
