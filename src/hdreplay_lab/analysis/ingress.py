"""Replay ingress under a multi-part reward (the paper's Appendix "Replay ingress in the multi-reward Geo3K setting").

Input: the run's fresh-group rewards per step (``fresh_groups.jsonl``, see
:mod:`hdreplay_lab.sandbox.rewardlog`), its replay step records and settings.  With a_i = 1[r_i >= threshold]
(answer correct) and S = sum_i a_i, a group of n rewards is

    answer_mixed    1 <= S <= n - 1: answer correctness varies
    format_only     S = 0 or S = n but the rewards differ: only the format part varies (e.g. 0.0 / 0.1)
    uniform         all rewards equal: no GRPO signal

and the ingress rules admit

    mixed      rewards not all equal (hdreplay's default): answer_mixed + format_only
    answer     1 <= S <= n - 1 (``ingress="answer"``): answer_mixed only
    positive   the paper's original s_i^+ = 1[r_i > 0]: 1 <= #{r_i > 0} <= n - 1 (shown for reference; a group whose
               wrong answers all carry the format bonus is "all success" under it -- the drying the paper reports)

Every rule is applied to the same fresh stream (what the run would have admitted); the buffer is reconstructed for
the run's own rule (FIFO, its capacity) and checked against the logged ingress counts and buffer sizes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from .stats import interval_means, opt, unavailable

RULES = ("mixed", "answer", "positive")
COMPOSITION = ("no_correct", "mixed", "all_correct")  # S = 0, 1..n-1, n among admitted groups
_GID = re.compile(r"^s(\d+)(?:\.0)?g(\d+)$")  # s<step>g<k> (sandbox) / s<step>.0g<k> (HDRGRPOTrainer, 1st generation)


def classify(rewards: np.ndarray, threshold: float) -> dict[str, np.ndarray]:
    """Per group of ``rewards`` (G, n): S (answer-correct count), the three classes, and each rule's admission."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 1:
        raise ValueError(f"rewards must be a (groups, n) array, got shape {r.shape}")
    n = r.shape[1]
    S = (r >= threshold).sum(axis=1)
    varies = (r != r[:, :1]).any(axis=1)
    pos = (r > 0).sum(axis=1)
    answer_mixed = (S >= 1) & (S <= n - 1)
    return {"S": S, "answer_mixed": answer_mixed, "format_only": varies & ~answer_mixed, "uniform": ~varies,
            "mixed": varies, "answer": answer_mixed, "positive": (pos >= 1) & (pos <= n - 1)}


def fresh_groups(fresh: pd.DataFrame) -> pd.DataFrame:
    """One row per fresh group: step, index within the step, n, rewards (tuple); the last record of a repeated step
    (a resumed run) wins; groups with a missing or non-finite reward are dropped."""
    g = fresh.drop_duplicates("step", keep="last").sort_values("step", kind="stable")[["step", "rewards"]]
    g = g.assign(index=g["rewards"].map(lambda r: list(range(len(r))))).explode(["rewards", "index"])
    g["rewards"] = g["rewards"].map(lambda r: tuple(np.nan if v is None else float(v) for v in r))
    g = g[g["rewards"].map(lambda r: len(r) > 0 and bool(np.isfinite(r).all()))]
    return pd.DataFrame({"step": g["step"].astype(int), "index": g["index"].astype(int), "n": g["rewards"].map(len),
                         "rewards": g["rewards"]}).reset_index(drop=True)


def _composition(S: np.ndarray, n: np.ndarray) -> dict[str, float | None]:
    if not len(S):
        return {**{k: None for k in COMPOSITION}, "mean_accuracy": None}
    return {"no_correct": float((S == 0).mean()), "mixed": float(((S > 0) & (S < n)).mean()),
            "all_correct": float((S == n).mean()), "mean_accuracy": float((S / n).mean())}


def fifo_buffer(admitted_steps: np.ndarray, flags: np.ndarray, steps: list[int], capacity: int) -> list[float | None]:
    """Share of ``flags`` among the last ``capacity`` admitted groups after each step's commit (None when empty);
    ``admitted_steps`` / ``flags`` are per admitted group in ingress order."""
    out = []
    for s in steps:
        k = int(np.searchsorted(admitted_steps, s, side="right"))
        window = flags[max(0, k - capacity):k]
        out.append(float(window.mean()) if len(window) else None)
    return out


def ingress(fresh: pd.DataFrame, steps: pd.DataFrame, groups: pd.DataFrame, replay: dict, *,
            threshold: float | None) -> dict[str, Any]:
    """The ingress section of one run (module docstring).  ``replay``: the run's replay settings (ingress rule,
    answer_threshold, capacity); ``threshold`` overrides the answer threshold (else the run's, else 0.9)."""
    if fresh is None or not len(fresh):
        return unavailable("no fresh_groups.jsonl (the sandbox runner writes it; other runs do not log per-group "
                           "rewards)")
    thr = threshold if threshold is not None else replay.get("answer_threshold")
    thr = 0.9 if thr is None else float(thr)
    g = fresh_groups(fresh)
    if not len(g):
        return unavailable("fresh_groups.jsonl holds no group with finite rewards")
    g = pd.concat([part.assign(**classify(np.stack(part["rewards"].to_list()), thr))
                   for _, part in g.groupby("n")]).sort_index()  # one (G, n) array per group size
    per = g.groupby("step", sort=True)
    step_list = list(per.groups)
    series: dict[str, list] = {"step": step_list, "groups": per.size().tolist()}
    for rule in RULES:
        series[f"admit_{rule}"] = per[rule].mean().tolist()
        series[f"format_only_in_{rule}"] = [opt(x[x[rule]]["format_only"].mean()) if x[rule].any() else None
                                            for _, x in per]
    for c in ("answer_mixed", "format_only", "uniform"):
        series[f"fresh_{c}"] = per[c].mean().tolist()
    rules = {}
    for rule in RULES:
        adm = g[g[rule]]
        rules[rule] = {"admit_share": float(g[rule].mean()), "by_interval": interval_means(series[f"admit_{rule}"]),
                       "admitted_per_step": float(per[rule].sum().mean()),
                       "format_only_share": opt(adm["format_only"].mean()) if len(adm) else None,
                       **_composition(adm["S"].to_numpy(), adm["n"].to_numpy())}
    run_rule = replay.get("ingress") if replay.get("ingress") in ("mixed", "answer") else None
    out = {"available": True, "threshold": thr, "rule": run_rule, "n_steps": len(step_list), "n_groups": len(g),
           "rules": rules, "series": series,
           "fresh": {c: float(g[c].mean()) for c in ("answer_mixed", "format_only", "uniform")}
           | {"format_only_no_correct": float((g["format_only"] & (g["S"] == 0)).mean())}}
    out["buffer"] = _buffer(g, steps, run_rule, replay.get("capacity"), step_list)
    out["series"]["buffer_format_only"] = out["buffer"].pop("series", [None] * len(step_list))
    out["replay"] = _replay(g, steps, groups)
    return out


def _buffer(g: pd.DataFrame, steps: pd.DataFrame, rule: str | None, capacity, step_list: list[int]) -> dict:
    if rule is None or not isinstance(capacity, int) or capacity < 1:
        return unavailable("the run has no replay buffer (no ingress rule / capacity in run.json)")
    adm = g[g[rule]]
    shares = fifo_buffer(adm["step"].to_numpy(), adm["format_only"].to_numpy(), step_list, capacity)
    logged = steps.set_index("step")["ingress_admitted"] if len(steps) else pd.Series(dtype=float)
    mine = adm.groupby("step").size().reindex(step_list, fill_value=0)
    mism = [s for s in step_list if s in logged.index and int(mine[s]) != int(logged[s])]
    vals = [v for v in shares if v is not None]
    return {"available": True, "capacity": capacity, "series": shares, "format_only_mean": opt(np.mean(vals)) if vals
            else None, "format_only_final": shares[-1], "by_interval": interval_means(shares),
            "admitted_mismatch_steps": mism, "checked_against_log": bool(len(steps))}


def _replay(g: pd.DataFrame, steps: pd.DataFrame, groups: pd.DataFrame) -> dict:
    if not len(steps):
        return unavailable("no replay step records")
    out = {"accept_rate": opt(pd.to_numeric(steps["accept_rate"], errors="coerce").mean()),
           "budget_fill": opt(pd.to_numeric(steps["budget_fill"], errors="coerce").mean()),
           "accepted_per_step": opt(pd.to_numeric(steps["accepted"], errors="coerce").mean())}
    out["by_interval"] = {k: v for k, v in zip(("accept_rate", "budget_fill"), (
        interval_means(steps["accept_rate"]), interval_means(steps["budget_fill"])))}
    ids = groups.get("group_id", pd.Series(dtype=object)).astype(str).str.extract(_GID).astype(float)
    life = pd.DataFrame({"step": ids[0], "index": ids[1], "count": groups.get("replay_count")}).dropna()
    life = life.merge(g[["step", "index", "format_only"]], on=["step", "index"])
    events, fo = int(life["count"].sum()), int((life["count"] * life["format_only"]).sum())
    out["replay_events"] = events
    out["format_only_replay_share"] = fo / events if events else None
    return {"available": True, **out}

