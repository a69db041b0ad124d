"""Markdown rendering of a report dict (see :mod:`hdreplay_lab.analysis.report`); no computation here."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .stats import INTERVALS


def fmt(v: Any, kind: str = "num") -> str:
    """A table cell: None -> n/a, kind "pct" -> percent, "int", "num" (4 significant digits), "text"."""
    if v is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "int":
        return str(int(v))
    if kind == "num" and isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _get(d: Any, path: str) -> Any:
    for k in path.split("/"):
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def run_table(report: dict, section: str, rows: Sequence[tuple[str, str, str]]) -> str:
    """Metric rows x run columns for ``section``; rows are (name, dotted path, kind).  Runs whose
    section is unavailable get n/a and their reason listed under the table."""
    runs = report["runs"]
    labels = list(runs)
    body = []
    for name, path, kind in rows:
        cells = []
        for lab in labels:
            sec = runs[lab].get(section, {})
            cells.append(fmt(_get(sec, path), kind) if sec.get("available", True) else "n/a")
        body.append([name, *cells])
    out = table(["metric", *(fmt(lab, "text") for lab in labels)], body)
    return out + _reasons(report, section)


def _reasons(report: dict, section: str) -> str:
    notes = [f"- {lab}: {a[section]['reason']}" for lab, a in report["runs"].items()
             if not a.get(section, {}).get("available", True)]
    return ("\n" + "\n".join(notes) + "\n") if notes else ""


def _figure(report: dict, name: str, caption: str) -> str:
    f = report.get("figures", {}).get(name)
    return f"\n![{caption}]({f})\n" if f else ""


def _intervals(prefix: str, path: str, kind: str = "num") -> list[tuple[str, str, str]]:
    return [(f"{prefix} ({i})", f"{path}/{i}", kind) for i in INTERVALS]


def _per_run(report: dict, section: str, body: Callable[[dict], str]) -> str:
    parts = []
    for lab, a in report["runs"].items():
        sec = a.get(section, {})
        parts.append(f"**{lab}**\n\n" + (body(sec) if sec.get("available", True) else f"n/a: {sec['reason']}\n"))
    return "\n".join(parts)


def _header(report: dict) -> str:
    rows = []
    for lab, a in report["runs"].items():
        i = a["info"]
        rows.append([lab, fmt(i["method"], "text"), fmt(i["seed"], "text"), fmt(i["task"], "text"),
                     fmt(i["selector"], "text"), fmt(i["k_rep"], "text"), fmt(i["tau"]),
                     "yes" if i["adaptive"] else "no",
                     "..".join(map(str, i["replay_steps"])) if i["replay_steps"] else "n/a",
                     "..".join(map(str, i["log_steps"])) if i["log_steps"] else "n/a", f"`{i['path']}`"])
    s = "# Replay analytics report\n\n" + table(
        ["run", "method", "seed", "task", "selector", "k_rep", "tau", "adaptive", "replay steps", "log steps", "path"],
        rows)
    mm = report["comparison"]["mismatches"]
    if mm:
        s += "\n## Comparability\n\n" + "\n".join(f"- {m}" for m in mm) + "\n"
    probs = [(lab, p) for lab, a in report["runs"].items() for p in a["problems"]]
    if probs:
        s += "\n## Data problems\n\n" + "\n".join(f"- {lab}: `{p}`" for lab, p in probs) + "\n"
    s += ("\nIntervals (early / middle / final) are equal-count thirds of the *updates* (steps whose pre-step "
          "buffer was non-empty). Shares are percentages.\n")
    return s


def _staleness_table(report: dict) -> str:
    rows = []
    for lab, a in report["runs"].items():
        st = a["staleness"]
        if not st.get("available", True):
            rows.append([lab, "n/a", *["n/a"] * 6])
            continue
        for pop, name in (("pool", "replay pool"), ("used", "used replay subset")):
            d = st[pop]
            if not d.get("available", True):
                rows.append([lab, name, *["n/a"] * 6])
                continue
            rows.append([lab, name, fmt(d["mean"]), fmt(d["median"]), fmt(d["p90"]), fmt(d["max"]),
                         fmt(d["share_age_ge2"], "pct"), fmt(d["share_age_ge3"], "pct")])
    s = table(["run", "population", "mean", "median", "P90", "max", "% age >= 2", "% age >= 3"], rows)
    for lab, a in report["runs"].items():
        st = a["staleness"]
        if st.get("available", True):
            if st.get("pool_size_mismatch_steps"):
                s += (f"\n- {lab}: the reconstructed pool differs from the logged buffer size at "
                      f"{len(st['pool_size_mismatch_steps'])} step(s) (lifetime records missing?)\n")
            for pop in ("pool", "used"):
                if not st[pop].get("available", True):
                    s += f"\n- {lab} ({pop}): {st[pop]['reason']}\n"
        else:
            s += f"\n- {lab}: {st['reason']}\n"
    return s


def _age_rates(report: dict, max_age: int = 8) -> list[tuple[str, str, str]]:
    top = max((len(a["age_gate"].get("ages", [])) for a in report["runs"].values()), default=0)
    return [(f"acceptance rate at age {k}", f"accept_rate_by_age_{k}", "pct") for k in range(1, min(top, max_age) + 1)]


def _with_age_rates(report: dict) -> dict:
    """A shallow copy whose age_gate sections also carry accept_rate_by_age_<k> keys for run_table."""
    out = {**report, "runs": {}}
    for lab, a in report["runs"].items():
        ag = dict(a["age_gate"])
        for k, v in enumerate(ag.get("accept_rate_by_age", []), start=1):
            ag[f"accept_rate_by_age_{k}"] = v
        out["runs"][lab] = {**a, "age_gate": ag}
    return out


def _deciles(sec: dict) -> str:
    rows = [[str(b["bin"]), f"{b['headroom_min']:.3f}-{b['headroom_max']:.3f}", str(b["n"]),
             fmt(b["mean_replay_count"]), fmt(b["p_replayed"], "pct")] for b in sec["bins"]]
    return table(["bin", "initial Headroom", "groups", "mean N_rep", "P(N_rep >= 1)"], rows) + (
        f"\n{sec['n_groups']} groups, {sec['n_still_buffered']} still buffered at the end (lifetime censored).\n")


def _cohorts(sec: dict) -> str:
    rows = [[str(c["n_rep"]), str(c["n_groups"]), fmt(c["cohort_share"], "pct"), fmt(c["replay_event_share"], "pct"),
             fmt(c["exposure_share"], "pct")] for c in sec["cohorts"]]
    return table(["N_rep", "groups", "cohort share", "replay-event share", "exposure-mass share (W_T)"], rows)


def _entropy(report: dict) -> str:
    th = report["settings"]["entropy"]
    s = (f"Score anchor s0 = {th['score_anchor']:g} (key `{report['settings']['score_key']}`), H_L = "
         f"{th['entropy_low']:g}, H_U = {th['entropy_high']:g} (key `{report['settings']['entropy_key']}`); entry "
         f"held for {th['entry_hold']} log points, rebound for {th['rebound_hold']}. Times in trainer steps.\n\n")
    rows = []
    for lab, a in report["runs"].items():
        e = a["entropy_timing"]
        if not e.get("available", True):
            rows.append([lab, *["n/a"] * 5, e["reason"]])
            continue
        rows.append([lab, *(fmt(e[k], "int") for k in ("t_first", "t_entry", "t_rebound", "delta_entry",
                                                        "delta_rebound")), "; ".join(e["notes"]) or "-"])
    return s + table(["run", "t_first(S>=s0)", "t_entry(H<=H_L)", "t_rebound(H>=H_U)", "Delta_entry",
                      "Delta_rebound", "notes"], rows)


def _phases(sec: dict) -> str:
    ph = sec["phases"]
    rows = [
        ("steps", lambda p: f"{p['first_step']}..{p['last_step']}" if p["n_steps"] else "-"),
        ("updates with replay", lambda p: str(p["n_replay_updates"])),
        ("mean source age", lambda p: fmt(p["mean_age"])),
        ("% age = 1", lambda p: fmt(p["share_age1"], "pct")),
        ("% age >= 3", lambda p: fmt(p["share_age_ge3"], "pct")),
        ("mean distinct ages / update", lambda p: fmt(p["mean_distinct_ages"])),
        ("% updates with >= 3 ages", lambda p: fmt(p["share_updates_ge3_ages"], "pct")),
        ("% updates with age 1 and age >= 3", lambda p: fmt(p["share_updates_age1_and_ge3"], "pct")),
    ]
    return f"Phases: {sec['how']}.\n\n" + table(["metric", *(p["name"] for p in ph)],
                                               [[name, *(f(p) for p in ph)] for name, f in rows])


def render_report(report: dict) -> str:
    """The whole markdown report."""
    r = report
    s = [_header(r)]
    s.append("\n## 1. Acceptance, replay-budget fill and gate rejections\n\n" + run_table(r, "acceptance", [
        ("updates", "n_updates", "int"), ("mean acceptance rate (per step)", "mean_accept_rate", "pct"),
        ("pooled acceptance rate", "pooled_accept_rate", "pct"), ("mean budget fill", "mean_budget_fill", "pct"),
        ("gate rejections per update", "mean_rejections", "num"),
        *_intervals("acceptance", "by_interval/accept_rate", "pct"),
        *_intervals("budget fill", "by_interval/budget_fill", "pct"),
        *_intervals("rejections / update", "by_interval/rejections")]) + _figure(r, "acceptance", "acceptance"))
    s.append("\n## 2. Replay KL\n\n" + run_table(r, "replay_kl", [
        ("mean replay KL", "mean", "num"), *_intervals("replay KL", "by_interval"),
        ("final / early", "final_over_early", "num"), ("running-average window", "window", "int")])
        + _figure(r, "replay_kl", "replay KL"))
    s.append("\n## 3. Scan depth and prefix concentration\n\n" + run_table(r, "scan", [
        ("scan order", "order", "text"), ("mean scan depth", "mean_scan_depth", "num"),
        *_intervals("scan depth", "scan_depth_by_interval"), ("filled updates", "n_filled", "int"),
        ("underfilled updates", "n_underfilled", "int"),
        *[(f"accepted share from top {int(float(q) * 100)}% of buffer", f"prefix/share_at/{q}", "pct")
          for q in ("0.05", "0.1", "0.25", "0.5")],
        ("accepted share within the first k_rep ranks", "prefix/share_within_k_rep", "pct"),
        ("replayed groups with a scan position", "prefix/n_accepted", "int")]) + _figure(r, "scan", "scan"))
    ra = _with_age_rates(r)
    s.append("\n## 4. Replay age\n\n### Drift-gate outcome by age (scanned groups)\n\n" + run_table(ra, "age_gate", [
        ("mean age, accepted", "accepted/mean", "num"), ("mean age, rejected", "rejected/mean", "num"),
        ("median age, accepted", "accepted/median", "num"), ("median age, rejected", "rejected/median", "num"),
        ("youngest scanned age", "reject_share_youngest/age", "int"),
        ("rejected share at the youngest age", "reject_share_youngest/share", "pct"), *_age_rates(r)])
        + _figure(r, "age", "age") + "\n### Source staleness\n\n" + _staleness_table(r)
        + "\n### Mixing structure of the used replay subset\n\n" + run_table(r, "mixing", [
            ("updates with replay", "n_replay_updates", "int"),
            ("mean distinct source ages per update", "mean_distinct_ages", "num"),
            ("% updates with >= 3 ages", "share_updates_ge3_ages", "pct"),
            ("% updates with age 1 and age >= 3", "share_updates_age1_and_ge3", "pct")]))
    s.append("\n## 5. Initial stored Headroom and lifetime replay\n\n" + _per_run(r, "headroom_deciles", _deciles)
             + _figure(r, "headroom_deciles", "headroom deciles"))
    s.append("\n## 6. Replay multiplicity and exposure concentration\n\n" + run_table(r, "multiplicity", [
        ("groups", "n_groups", "int"), ("never replayed", "share_never_replayed", "pct"),
        ("replay events", "total_replay_events", "int")]) + "\n" + _per_run(r, "multiplicity", _cohorts)
        + _figure(r, "multiplicity", "multiplicity"))
    s.append("\n## 7. Same-buffer counterfactual (selected vs recency subset)\n\n"
             "x = compatibility gain (recency Drift - selected Drift), y = learning-value gain "
             "(selected Headroom - recency Headroom), per step.\n\n" + run_table(r, "counterfactual", [
                 ("steps", "n_steps", "int"), ("both better", "quadrant_share/both", "pct"),
                 ("compatibility only", "quadrant_share/compatibility_only", "pct"),
                 ("learning value only", "quadrant_share/value_only", "pct"),
                 ("neither", "quadrant_share/neither", "pct"), ("tie (same subset)", "quadrant_share/tie", "pct"),
                 ("mean compatibility gain", "mean_compat_gain", "num"),
                 ("mean learning-value gain", "mean_value_gain", "num"),
                 *_intervals("compatibility gain", "by_interval/compat_gain"),
                 *_intervals("learning-value gain", "by_interval/value_gain")])
             + _figure(r, "counterfactual", "counterfactual"))
    s.append("\n## 8. Entropy-collapse timing at a matched score\n\n" + _entropy(r)
             + _figure(r, "entropy_timing", "entropy timing"))
    s.append("\n## 9. Phase-wise replay mixture\n\n" + _per_run(r, "phases", _phases) + _figure(r, "phases", "phases"))
    s.append("\n## Training curves and final metrics\n\n" + run_table(r, "training", [
        ("score points", "score/n", "int"), *_intervals("score", "score/by_interval"), ("final score", "score/last", "num"),
        ("entropy points", "entropy/n", "int"), *_intervals("entropy", "entropy/by_interval"),
        ("final entropy", "entropy/last", "num")]))
    fm = {lab: a["final_metrics"] for lab, a in r["runs"].items() if a["final_metrics"]}
    if fm:
        keys = sorted({k for m in fm.values() for k in m})
        s.append("\n### metrics.json\n\n" + table(["metric", *r["runs"]], [
            [k, *(fmt(r["runs"][lab]["final_metrics"].get(k)) for lab in r["runs"])] for k in keys]))
    return "".join(s)
