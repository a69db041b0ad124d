"""Run metadata and the comparability check between runs reported side by side."""

from __future__ import annotations

import re
from typing import Any, Sequence

from .load import RunData
from .stats import num

_TAU_IN_LABEL = re.compile(r"tau\s*=\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)")


def tau_from_label(label: str) -> float | None:
    """The tau written in a label such as ``"tau=1e-3"``, or None."""
    m = _TAU_IN_LABEL.search(label)
    return num(float(m.group(1))) if m else None


def run_info(run: RunData) -> dict[str, Any]:
    """What a run is: method/seed/task (run.json), replay settings (first step record, else run.json),
    step ranges.  Keys: label, path, method, seed, task, has_replay, selector, k_rep, tau, capacity,
    adaptive, counterfactual, replay_steps [first, last] or None, log_steps [first, last] or None."""
    rc = run.replay_config
    first = run.steps[0] if run.steps else {}
    selector = first.get("selector") or rc.get("selector") or ("none" if not run.has_replay else None)
    tau = num(first.get("tau"))
    if tau is None:
        tau = num(rc.get("tau"))
    if tau is None:
        tau = tau_from_label(run.label)
    adaptive = rc.get("adaptive_tau") is not None or any("tau_action" in r for r in run.steps)
    log_steps = [e["step"] for e in run.train_log if isinstance(e.get("step"), int) and not isinstance(e["step"], bool)]
    return {
        "label": run.label,
        "path": str(run.path),
        "method": run.meta.get("method"),
        "seed": run.meta.get("seed"),
        "task": run.meta.get("task"),
        "has_replay": run.has_replay,
        "selector": selector,
        "k_rep": first.get("k_rep", rc.get("k_rep")),
        "tau": tau,
        "capacity": rc.get("capacity"),
        "adaptive": bool(adaptive),
        "counterfactual": any("cf_size" in r for r in run.steps) or bool(rc.get("counterfactual")),
        "replay_steps": [run.steps[0]["step"], run.steps[-1]["step"]] if run.steps else None,
        "log_steps": [min(log_steps), max(log_steps)] if log_steps else None,
    }


def _differ(infos: Sequence[dict], key: str) -> dict[str, Any] | None:
    vals = {i["label"]: i.get(key) for i in infos}
    known = {k: v for k, v in vals.items() if v is not None}
    return known if len({repr(v) for v in known.values()}) > 1 else None


def mismatches(infos: Sequence[dict], *, ignore: Sequence[str] = ()) -> list[str]:
    """Human-readable differences that limit a side-by-side comparison (empty for one run); keys in
    ``ignore`` (e.g. "tau" in a tau sweep) are expected to differ and are not reported."""
    if len(infos) < 2:
        return []
    out = []
    rep = [i for i in infos if i["has_replay"]]
    if rep and len(rep) < len(infos):
        none = ", ".join(i["label"] for i in infos if not i["has_replay"])
        out.append(f"runs without replay diagnostics ({none}): replay sections compare only "
                   f"{', '.join(i['label'] for i in rep)}; training curves and entropy timing compare all runs")
    for key, what in (("task", "task"), ("selector", "selector"), ("k_rep", "replay budget k_rep"),
                      ("capacity", "buffer capacity"), ("tau", "initial tau")):
        if key in ignore:
            continue
        d = _differ(rep if key in ("k_rep", "capacity", "tau") else infos, key)
        if d:
            vals = ", ".join(f"{k}={v}" for k, v in d.items())
            out.append(f"{what} differs ({vals})" + (": the runs train on different tasks, compare with care"
                                                     if key == "task" else ""))
    for key, what in (("replay_steps", "replay step range"), ("log_steps", "trainer-log step range")):
        d = _differ(infos, key)
        if d:
            vals = ", ".join(f"{k}={v[0]}..{v[1]}" for k, v in d.items())
            out.append(f"{what} differs ({vals}): early/middle/final intervals and phases cover different "
                       "spans; compare per-step curves on their common steps")
    if rep and any(i["counterfactual"] for i in rep) and not all(i["counterfactual"] for i in rep):
        out.append("only some runs logged the same-buffer counterfactual (counterfactual=True)")
    return out
