"""Environment cost of a multi-turn (tool-calling) comparison: from counted calls to wall-clock at a per-call latency.

What is measured (instrument.py, per step of every run): the tool calls that reached the environment, the tool
*turns* (rounds of TRL's tool loop in which at least one row called a tool), the tokens the policy generated, and
the step's process CPU seconds ``cpu_s`` (one torch thread per process, env.py).  CPU time rather than wall-clock is
the compute: it excludes sleeps and the time spent waiting for a core, but not all contention -- beside other jobs
the same computation measured up to ~20 % more CPU seconds than on an idle machine (SMT siblings, caches;
docs/results/search, the slept checks), so compare methods run under the same load.

The model.  At per-call latency ``L`` a step takes its compute plus its wait for the environment::

    step_s(L) = cpu_s + wait(L)
    wait(L)   = L * turns    per_turn:   the calls of one turn in flight together across the batch, turns one after
                                         another (Search-R1's generation loop sends a turn's queries to the retriever
                                         as one batch and waits for it before the next turn)
              = L * calls    sequential: every call waits for the previous one (TRL 1.16 runs sync tools so)

Nothing overlaps generation with the environment (neither trainer does), and a batched turn costs one latency
whatever its size (a retriever serving the batch in parallel).  A run that actually sleeps L in the same pattern
(``--latency-ms``, ``--tool-concurrency``) checks the model: benchmarks/search_slept_check.py.

Wall-clock to a target.  The held-out curve (curves.py) carries, at each evaluation point, the cumulative CPU seconds,
calls and turns, so the time of a point at latency L is ``cum_cpu_s + wait`` of the cumulative counts.  Where the
seed-mean curve first reaches the target does not depend on L, so the time to target is linear in L:
``T(L) = C + U L / 1000`` (C: CPU seconds, U: turns or calls to the target, both interpolated like the step).  Two
methods' lines cross at most once: :func:`crossover` gives the latency above which one reaches the target sooner,
with a paired bootstrap interval over seeds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

CONCURRENCY = ("per_turn", "sequential")
#: the count each concurrency model charges a latency for
UNIT = {"per_turn": "tool_turns", "sequential": "tool_calls"}

#: the paper's Search-R1 (Qwen2.5-3B) figures: mean per-step wall-clock (Table "search_timing") and Avg Mean@32
PAPER_STEP_S = {"onpolicy_matched": 146.4, "recency_matched": 154.4, "headroom_drift": 166.3, "recency_larger": 187.3,
                "onpolicy_larger": 197.2, "dapo": 232.5}
PAPER_MEAN32 = {"headroom_drift": 0.3577, "recency_matched": 0.3548, "onpolicy_larger": 0.3212}


def check_concurrency(concurrency: str) -> str:
    if concurrency not in CONCURRENCY:
        raise ValueError(f"--tool-concurrency {concurrency!r}: choose one of {list(CONCURRENCY)}")
    return concurrency


def wait_s(calls, turns, latency_ms: float, concurrency: str) -> np.ndarray:
    """Seconds waited for the environment: ``latency_ms`` per turn (per_turn) or per call (sequential)."""
    units = turns if check_concurrency(concurrency) == "per_turn" else calls
    return np.asarray(units, dtype=np.float64) * (latency_ms / 1000.0)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def run_env_cost(run_dir: Path) -> dict:
    """Per-step means of one run (steps >= 2: the first carries one-off set-up, as mean_step_s): ``cpu_s``, ``step_s``
    (wall, with whatever latency the run slept), ``tool_calls``, ``tool_turns``, ``policy_tokens``, ``gen_tokens``;
    ``steps``; ``latency_ms`` and ``concurrency`` the run slept with (run.json)."""
    run_dir = Path(run_dir)
    log = [r for r in _jsonl(run_dir / "train_log.jsonl") if r.get("step", 0) >= 2]
    if not log or any(r.get("cpu_s") is None or "tool_turns" not in r for r in log):
        raise ValueError(f"{run_dir}: its train_log.jsonl has no per-step cpu_s / tool_turns (a run made before the "
                         "environment-cost counts; run it again)")
    spec = json.loads((run_dir / "run.json").read_text())
    out = {k: float(np.mean([r[k] for r in log])) for k in ("cpu_s", "step_s", "tool_calls", "tool_turns",
                                                            "policy_tokens", "gen_tokens")}
    extra = spec.get("extra", {})
    return {**out, "steps": len(log), "latency_ms": 1000.0 * float(extra.get("latency_s", 0.0)),
            "concurrency": extra.get("tool_concurrency", "per_turn")}


def modelled_step_s(cost: dict, latency_ms: float, concurrency: str) -> float:
    """One run's mean step time at ``latency_ms`` under the model (from :func:`run_env_cost`)."""
    return cost["cpu_s"] + float(wait_s(cost["tool_calls"], cost["tool_turns"], latency_ms, concurrency))


def _ms(xs) -> dict:
    a = np.asarray(xs, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0, "n": int(a.size)}


def step_time_table(costs: dict[str, list[dict]], latencies: Sequence[float], *, base: str | None = None,
                    reference: str | None = None, reps: int = 4000) -> dict:
    """Per concurrency model, per latency, per method: the modelled mean step time (seed mean and std), its ratio to
    ``base``'s (on-policy b), and for ``reference`` (Headroom-Drift) against each other method the paired seed
    bootstrap of the difference in step time.  ``costs``: method -> per-seed :func:`run_env_cost` dicts."""
    from .stats import seed_bootstrap

    out = {}
    for conc in CONCURRENCY:
        per = {}
        for lat in latencies:
            rows = {m: [modelled_step_s(c, lat, conc) for c in cs] for m, cs in costs.items()}
            cell = {m: _ms(v) for m, v in rows.items()}
            if base in rows:
                for m in rows:
                    cell[m]["ratio_to_base"] = cell[m]["mean"] / cell[base]["mean"]
            if reference in rows and len(rows[reference]) > 1:
                for m in rows:
                    if m != reference and len(rows[m]) == len(rows[reference]):
                        cell[m]["ref_minus"] = seed_bootstrap(rows[m], rows[reference], reps=reps)
            per[f"{lat:g}"] = cell
        out[conc] = per
    return out


def counts_table(costs: dict[str, list[dict]]) -> dict:
    """Per method: seed mean and std of the per-step counts and CPU seconds."""
    keys = ("cpu_s", "step_s", "tool_calls", "tool_turns", "policy_tokens", "gen_tokens")
    return {m: {k: _ms([c[k] for c in cs]) for k in keys} for m, cs in costs.items()}


# --- wall-clock to a target ------------------------------------------------------------------------------------------


def curve_arrays(curves: Sequence[list[dict]]) -> dict[str, np.ndarray]:
    """(seeds, points) arrays of a method's held-out curves: accuracy and the cumulative cpu / calls / turns."""
    from .curves import stack

    if any(not c or "cum_cpu_s" not in c[-1] for c in curves):
        raise ValueError("held-out curves without cumulative cpu_s / tool counts (runs made before the counts)")
    return {"step": stack(curves, "step")[0], "acc": stack(curves, "macro_mean_at_n"),
            "cpu": stack(curves, "cum_cpu_s"), "tool_calls": stack(curves, "cum_tool_calls"),
            "tool_turns": stack(curves, "cum_tool_turns")}


def reach_line(arr: dict[str, np.ndarray], target: float, concurrency: str, seeds=None) -> tuple[float, float] | None:
    """(C, U) of the time to target ``T(L) = C + U L / 1000`` of the seed-mean curve over ``seeds`` (indices, repeats
    allowed; None: all), or None when the curve never reaches the target."""
    idx = slice(None) if seeds is None else np.asarray(seeds)
    acc = arr["acc"][idx].mean(axis=0)
    hit = np.nonzero(acc >= target)[0]
    if hit.size == 0:
        return None
    cpu, units = arr["cpu"][idx].mean(axis=0), arr[UNIT[check_concurrency(concurrency)]][idx].mean(axis=0)
    i = int(hit[0])
    if i == 0:
        return float(cpu[0]), float(units[0])
    f = (target - acc[i - 1]) / (acc[i] - acc[i - 1])
    return float(cpu[i - 1] + f * (cpu[i] - cpu[i - 1])), float(units[i - 1] + f * (units[i] - units[i - 1]))


def time_at(line: tuple[float, float] | None, latency_ms: float) -> float | None:
    return None if line is None else line[0] + line[1] * latency_ms / 1000.0


def sooner_above(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float:
    """The smallest latency (ms) above which ``a`` reaches the target sooner than ``b``: 0 when it does at every
    latency, inf when at none above some latency (never, or only below a latency), nan when neither reaches the
    target (no answer: not "never")."""
    if a is None and b is None:
        return math.nan
    if a is None:
        return math.inf
    if b is None:
        return 0.0
    (ca, ua), (cb, ub) = a, b
    if ua < ub:  # a waits less per ms of latency: sooner above the crossing
        return max(0.0, 1000.0 * (ca - cb) / (ub - ua))
    if ua == ub and ca < cb:
        return 0.0
    return math.inf  # a waits as much or more: later at high latency (sooner below a crossing at most)


def crossover(arr_a: dict, arr_b: dict, target: float, concurrency: str, *, reps: int = 2000, level: float = 0.95,
              seed: int = 0) -> dict:
    """Latency above which method a reaches ``target`` sooner than method b (:func:`sooner_above`), from all seeds, and
    its percentile interval over paired seed resamples (the same seed indices for both methods); ``never_share``: the
    share of replicates with no such latency; ``neither_share``: the share where neither method reaches the target
    (left out of the interval; nan when every replicate is such)."""
    S = arr_a["acc"].shape[0]
    if arr_b["acc"].shape[0] != S:
        raise ValueError(f"crossover needs paired seeds, got {S} and {arr_b['acc'].shape[0]}")
    la, lb = reach_line(arr_a, target, concurrency), reach_line(arr_b, target, concurrency)
    point = sooner_above(la, lb)
    rng = np.random.default_rng(seed)
    reps_v = np.empty(reps)
    for r in range(reps):
        s = rng.integers(0, S, S)
        reps_v[r] = sooner_above(reach_line(arr_a, target, concurrency, s), reach_line(arr_b, target, concurrency, s))
    alpha = (1 - level) / 2
    answered = reps_v[~np.isnan(reps_v)]
    lo, hi = (np.quantile(answered, [alpha, 1 - alpha], method="lower")  # inf-safe percentiles
              if answered.size else (math.nan, math.nan))
    return {"latency_ms": point, "lo": float(lo), "hi": float(hi), "level": level, "reps": reps,
            "never_share": float(np.isinf(reps_v).mean()), "always_share": float((reps_v == 0).mean()),
            "neither_share": float(np.isnan(reps_v).mean()),
            "line_a": la, "line_b": lb, "seeds": S}


def target_grid(arrs: dict[str, dict], k: int = 25) -> np.ndarray:
    """Targets for the time-to-target curves: from the seed-mean start of the curves to the highest seed-mean value."""
    lo = min(float(a["acc"].mean(axis=0)[0]) for a in arrs.values())
    hi = max(float(a["acc"].mean(axis=0).max()) for a in arrs.values())
    return np.linspace(lo, hi, k)


#: the on-policy baselines the crossover is also computed against at lower targets (the issue's two comparisons)
ON_POLICY = ("onpolicy_larger", "onpolicy_matched")
#: lower targets: these fractions of the way from the warm start's curve value to the target
TARGET_FRACTIONS = (0.5, 0.75, 1.0)


def wallclock_summary(curves: dict[str, Sequence[list[dict]]], latencies: Sequence[float], target: float, *,
                      reference: str, others: Sequence[str], reps: int = 2000) -> dict:
    """Per concurrency model: time to ``target`` of every method at each latency, and the crossover latency of
    ``reference`` against each of ``others`` (with intervals); the same crossover against the on-policy baselines at
    :data:`TARGET_FRACTIONS` of the way from the start to ``target`` (one target is one point of a noisy curve); the
    time-to-target curves over :func:`target_grid`."""
    arrs = {m: curve_arrays(c) for m, c in curves.items()}
    grid = target_grid(arrs)
    start = float(arrs[reference]["acc"].mean(axis=0)[0])
    lower = [start + f * (target - start) for f in TARGET_FRACTIONS]
    out = {"target": target, "targets": grid.tolist(), "start": start, "crossover_targets": lower}
    for conc in CONCURRENCY:
        lines = {m: reach_line(a, target, conc) for m, a in arrs.items()}
        res = {"to_target_s": {m: {f"{lat:g}": time_at(ln, lat) for lat in latencies} for m, ln in lines.items()},
               "lines": lines,
               "curves": {m: {f"{lat:g}": [time_at(reach_line(a, t, conc), lat) for t in grid] for lat in latencies}
                          for m, a in arrs.items()},
               "crossover": {o: crossover(arrs[reference], arrs[o], target, conc, reps=reps)
                             for o in others if o in arrs},
               "crossover_by_target": [{"target": t, **{o: crossover(arrs[reference], arrs[o], t, conc, reps=reps)
                                                        for o in ON_POLICY if o in arrs and o in others}}
                                       for t in lower]}
        out[conc] = res
    return out
