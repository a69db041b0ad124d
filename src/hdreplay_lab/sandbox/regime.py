"""The regime numbers of a run, per step: is this a place where replay can matter?

Read from a run directory (runner.py):

* zero-variance share: fresh groups whose rewards are all equal / fresh groups, every step and every
  method (``train_log.jsonl``, measured at TRL's reward seam, instrument.py).  For mixed-outcome ingress
  it is also ``1 - ingress_admitted / ingress_candidates`` of ``replay/steps.jsonl`` (checked by the tests).
* acceptance: gate passes / groups scanned, per step with a scan (``replay/steps.jsonl``); budget fill,
  scan depth and replay KL beside it.
* generation share: seconds inside TRL's ``_generate`` / step seconds, natively and under a modelled
  per-token rollout cost ``c`` (``(gen_s + c T) / (step_s + c T)`` with T the step's generated tokens).

"While replay is active" = steps >= 1 (step 0 starts with an empty buffer); the same steps are used for
the on-policy methods so their shares are comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: the paper's regime: zero-variance share and acceptance bands at the default tau
ZERO_VAR_BAND = (0.40, 0.60)
ACCEPT_BAND = (0.30, 0.50)
GEN_SHARE_TARGET = 2 / 3


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def _summary(x) -> dict:
    a = np.asarray([v for v in x if v is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "p10": None, "p90": None, "n": 0}
    p10, p90 = np.quantile(a, [0.1, 0.9])
    return {"mean": float(a.mean()), "p10": float(p10), "p90": float(p90), "n": int(a.size)}


def generation_share(gen_s, step_s, gen_tokens, ms_per_token: float = 0.0) -> np.ndarray:
    """Per-step share of the step spent generating, with ``ms_per_token`` of modelled cost added."""
    extra = np.asarray(gen_tokens, dtype=np.float64) * ms_per_token / 1000.0
    return (np.asarray(gen_s, dtype=np.float64) + extra) / (np.asarray(step_s, dtype=np.float64) + extra)


def cost_for_share(run_dirs, share: float = GEN_SHARE_TARGET) -> float:
    """The per-token rollout cost (ms) that makes generation ``share`` of the mean step of these runs.

    Solves (g + c T) / (s + c T) = share for c with the runs' mean native generation seconds g, step
    seconds s and generated tokens T per step (steps >= 2); 0 when generation already takes that share.
    """
    g = s = t = 0.0
    k = 0
    for d in run_dirs:
        d = Path(d)
        run_ms = float(json.loads((d / "run.json").read_text()).get("rollout_ms_per_token", 0.0))
        for r in _jsonl(d / "train_log.jsonl"):
            if r.get("step", 0) >= 2 and r.get("step_s") and r.get("gen_s") is not None:
                extra = run_ms / 1000.0 * r["gen_tokens"]
                g, s, t, k = g + r["gen_s"] - extra, s + r["step_s"] - extra, t + r["gen_tokens"], k + 1
    if not k or t <= 0:
        raise ValueError("no timed steps with generated tokens to calibrate the rollout cost from")
    c = (share * s - g) / ((1 - share) * t)  # seconds per token
    return max(0.0, 1000.0 * c)


def run_regime(run_dir: Path, *, model_ms_per_token: float = 0.0) -> dict:
    """Per-step series and their summaries for one run (see the module docstring)."""
    run_dir = Path(run_dir)
    log = [r for r in _jsonl(run_dir / "train_log.jsonl") if r.get("step", 0) >= 2]  # log steps are 1-based
    steps = _jsonl(run_dir / "replay" / "steps.jsonl")
    active = [s for s in steps if s["step"] >= 1]
    run_ms = float(json.loads((run_dir / "run.json").read_text()).get("rollout_ms_per_token", 0.0)) \
        if (run_dir / "run.json").is_file() else 0.0
    timed = [r for r in log if r.get("step_s") and r.get("gen_s") is not None]
    native = generation_share([r["gen_s"] for r in timed], [r["step_s"] for r in timed],
                              [r["gen_tokens"] for r in timed], -run_ms) if timed else np.array([])
    modelled = generation_share([r["gen_s"] for r in timed], [r["step_s"] for r in timed],
                                [r["gen_tokens"] for r in timed],
                                model_ms_per_token - run_ms) if timed else np.array([])
    zv = [r.get("zero_variance_share") for r in log]
    acc = [s.get("accept_rate") for s in active]
    out = {
        "zero_variance_share": _summary(zv),
        "zero_variance_in_band": _band_share(zv, ZERO_VAR_BAND),
        "generation_share_native": _summary(native.tolist()),
        "generation_share_modelled": _summary(modelled.tolist()),
        "series": {"step": [r["step"] - 1 for r in log], "zero_variance_share": zv},
    }
    if steps:
        out.update({
            "acceptance": _summary(acc),
            "acceptance_in_band": _band_share(acc, ACCEPT_BAND),
            "budget_fill": _summary([s.get("budget_fill") for s in active]),
            "scanned": _summary([s.get("scanned") for s in active]),
            "replay_kl": _summary([s.get("replay_kl") for s in active]),
            "ingress_admitted_share": _summary([s["ingress_admitted"] / s["ingress_candidates"]
                                                for s in active if s.get("ingress_candidates")]),
        })
        out["series"].update({"replay_step": [s["step"] for s in active], "acceptance": acc,
                              "replay_kl": [s.get("replay_kl") for s in active],
                              "scanned": [s.get("scanned") for s in active]})
    return out


def _band_share(x, band) -> float | None:
    a = np.asarray([v for v in x if v is not None], dtype=np.float64)
    if a.size == 0:
        return None
    return float(((a >= band[0]) & (a <= band[1])).mean())


def method_regime(runs: list[dict]) -> dict:
    """Seed means of the runs' regime summaries (``mean`` of each summary)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, dict) and "mean" in v]
    out = {}
    for k in keys:
        vals = [r[k]["mean"] for r in runs if r.get(k) and r[k]["mean"] is not None]
        out[k] = float(np.mean(vals)) if vals else None
    for k in ("zero_variance_in_band", "acceptance_in_band"):
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = float(np.mean(vals)) if vals else None
    return out


#: the per-interval series: (series key, the key of its steps)
INTERVAL_SERIES = (("zero_variance_share", "step"), ("acceptance", "replay_step"), ("scanned", "replay_step"))


def interval_regime(regimes: list[dict], steps: int, width: int) -> list[dict]:
    """Seed means of each run's per-step regime numbers over intervals of ``width`` steps (1..width, width+1..2 width,
    ... up to ``steps``): is the regime held through the run, not only on average?  Each run's interval mean first,
    then the mean over the runs that have the series (None where none has a step in the interval)."""
    if width < 1:
        raise ValueError(f"interval width must be >= 1, got {width!r}")
    out = []
    for lo in range(1, steps + 1, width):
        hi = min(lo + width - 1, steps)
        row = {"steps": [lo, hi]}
        for key, xkey in INTERVAL_SERIES:
            means = []
            for r in regimes:
                xs, ys = r["series"].get(xkey) or [], r["series"].get(key) or []
                vals = [y for x, y in zip(xs, ys) if lo <= x <= hi and y is not None]
                if vals:
                    means.append(float(np.mean(vals)))
            row[key] = float(np.mean(means)) if means else None
        out.append(row)
    return out
