"""Markdown rendering of a report dict (see :mod:`hdreplay_lab.analysis.report`); no computation here."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pandas as pd

from .ledger import ROWS as ASYNC_ROWS
from .stats import INTERVALS
from .waste import WASTE_ROWS


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
    """A GitHub markdown table (tabulate's pipe format) of already formatted cells."""
    return pd.DataFrame(list(rows), columns=list(headers)).to_markdown(index=False, disable_numparse=True) + "\n"


def _get(d: Any, path: str) -> Any:
    for k in path.split("/"):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _ok(sec: dict) -> bool:
    return sec.get("available", True)


def run_table(report: dict, section: str, rows: Sequence[tuple[str, str, str]]) -> str:
    """Metric rows x run columns of ``section``; rows are (name, slash path, kind).  A run whose section is
    unavailable shows n/a, with its reason listed under the table."""
    runs = report["runs"]
    body = [[name, *(fmt(_get(a.get(section, {}), path), kind) if _ok(a.get(section, {})) else "n/a"
                     for a in runs.values())] for name, path, kind in rows]
    notes = [f"- {lab}: {a[section]['reason']}" for lab, a in runs.items() if not _ok(a.get(section, {}))]
    return (table(["metric", *(fmt(lab, "text") for lab in runs)], body)
            + ("\n" + "\n".join(notes) + "\n" if notes else ""))


def _figure(report: dict, name: str) -> str:
    f = report.get("figures", {}).get(name)
    return f"\n![{name.replace('_', ' ')}]({f})\n" if f else ""


def _intervals(prefix: str, path: str, kind: str = "num") -> list[tuple[str, str, str]]:
    return [(f"{prefix} ({i})", f"{path}/{i}", kind) for i in INTERVALS]


def _per_run(report: dict, section: str, body: Callable[[dict], str]) -> str:
    return "\n".join(f"**{lab}**\n\n" + (body(a[section]) if _ok(a[section]) else f"n/a: {a[section]['reason']}\n")
                     for lab, a in report["runs"].items())


def _span(v: list | None) -> str:
    return "..".join(map(str, v)) if v else "n/a"


def _header(report: dict) -> str:
    rows = [[lab, *(fmt(i[k], "text") for k in ("method", "seed", "task", "selector", "k_rep")), fmt(i["tau"]),
             "yes" if i["adaptive"] else "no", _span(i["replay_steps"]), _span(i["log_steps"]), f"`{i['path']}`"]
            for lab, i in ((lab, a["info"]) for lab, a in report["runs"].items())]
    s = "# Replay analytics report\n\n" + table(["run", "method", "seed", "task", "selector", "k_rep", "tau",
                                                 "adaptive", "replay steps", "log steps", "path"], rows)
    if report["comparison"]["mismatches"]:
        s += "\n## Comparability\n\n" + "\n".join(f"- {m}" for m in report["comparison"]["mismatches"]) + "\n"
    probs = [f"- {lab}: `{p}`" for lab, a in report["runs"].items() for p in a["problems"]]
    if probs:
        s += "\n## Data problems\n\n" + "\n".join(probs) + "\n"
    aside = [f"- {lab}: `{p}`" for lab, a in report["runs"].items() for p in a["info"].get("rewound") or ()]
    if aside:
        s += ("\n## Records set aside by a resume\n\nA run resumed from a checkpoint: the records of the steps after "
              "it were moved beside the logs (and written again by the resumed run); this report reads the logs "
              "themselves.\n\n" + "\n".join(aside) + "\n")
    return s + ("\nIntervals (early / middle / final) are equal-count thirds of the *updates* (steps whose pre-step "
                "buffer was non-empty). Shares are percentages.\n")


def _staleness(report: dict) -> str:
    rows, notes = [], []
    for lab, a in report["runs"].items():
        st = a["staleness"]
        if not _ok(st):
            rows.append([lab, "n/a", *["n/a"] * 6])
            notes.append(f"- {lab}: {st['reason']}")
            continue
        for pop, name in (("pool", "replay pool"), ("used", "used replay subset")):
            d = st[pop]
            rows.append([lab, name, *([fmt(d[k]) for k in ("mean", "median", "p90", "max")]
                                      + [fmt(d[k], "pct") for k in ("share_age_ge2", "share_age_ge3")]
                                      if _ok(d) else ["n/a"] * 6)])
            notes += [] if _ok(d) else [f"- {lab} ({pop}): {d['reason']}"]
        if st.get("pool_size_mismatch_steps"):
            notes.append(f"- {lab}: the reconstructed pool differs from the logged buffer size at "
                         f"{len(st['pool_size_mismatch_steps'])} step(s) (lifetime records missing?)")
    s = table(["run", "population", "mean", "median", "P90", "max", "% age >= 2", "% age >= 3"], rows)
    return s + ("\n" + "\n".join(notes) + "\n" if notes else "")


def _with_age_rates(report: dict, max_age: int = 8) -> tuple[dict, list[tuple[str, str, str]]]:
    """A copy whose age_gate sections carry accept_rate_by_age_<k> keys, and the rows that show them."""
    runs = {lab: {**a, "age_gate": {**a["age_gate"], **{f"rate_{k}": v for k, v in enumerate(
        a["age_gate"].get("accept_rate_by_age", []), start=1)}}} for lab, a in report["runs"].items()}
    top = min(max((len(a["age_gate"].get("ages", [])) for a in report["runs"].values()), default=0), max_age)
    return {**report, "runs": runs}, [(f"acceptance rate at age {k}", f"rate_{k}", "pct") for k in range(1, top + 1)]


def _deciles(sec: dict) -> str:
    rows = [[str(b["bin"]), f"{b['headroom_min']:.3f}-{b['headroom_max']:.3f}", str(b["n"]),
             fmt(b["mean_replay_count"]), fmt(b["p_replayed"], "pct")] for b in sec["bins"]]
    return table(["bin", "initial Headroom", "groups", "mean N_rep", "P(N_rep >= 1)"], rows) + (
        f"\n{sec['n_groups']} groups, {sec['n_still_buffered']} still buffered at the end (lifetime censored).\n")


def _cohorts(sec: dict) -> str:
    rows = [[str(c["n_rep"]), str(c["n_groups"]), *(fmt(c[k], "pct") for k in
                                                     ("cohort_share", "replay_event_share", "exposure_share"))]
            for c in sec["cohorts"]]
    return table(["N_rep", "groups", "cohort share", "replay-event share", "exposure-mass share (W_T)"], rows)


def _entropy(report: dict) -> str:
    st, th = report["settings"], report["settings"]["entropy"]
    rows = [[lab, *((fmt(e[k], "int") for k in ("t_first", "t_entry", "t_rebound", "delta_entry", "delta_rebound"))
                    if _ok(e) else ["n/a"] * 5), ("; ".join(e["notes"]) or "-") if _ok(e) else e["reason"]]
            for lab, e in ((lab, a["entropy_timing"]) for lab, a in report["runs"].items())]
    return (f"Score anchor s0 = {th['score_anchor']:g} (key `{st['score_key']}`), H_L = {th['entropy_low']:g}, "
            f"H_U = {th['entropy_high']:g} (key `{st['entropy_key']}`); entry held for {th['entry_hold']} log points, "
            f"rebound for {th['rebound_hold']}. Times in trainer steps.\n\n"
            + table(["run", "t_first(S>=s0)", "t_entry(H<=H_L)", "t_rebound(H>=H_U)", "Delta_entry", "Delta_rebound",
                     "notes"], rows))


def _phases(sec: dict) -> str:
    rows = [("steps", lambda p: f"{p['first_step']}..{p['last_step']}" if p["n_steps"] else "-"),
            ("updates with replay", lambda p: str(p["n_replay_updates"])),
            ("mean source age", lambda p: fmt(p["mean_age"])),
            ("% age = 1", lambda p: fmt(p["share_age1"], "pct")),
            ("% age >= 3", lambda p: fmt(p["share_age_ge3"], "pct")),
            ("mean distinct ages / update", lambda p: fmt(p["mean_distinct_ages"])),
            ("% updates with >= 3 ages", lambda p: fmt(p["share_updates_ge3_ages"], "pct")),
            ("% updates with age 1 and age >= 3", lambda p: fmt(p["share_updates_age1_and_ge3"], "pct"))]
    return f"Phases: {sec['how']}.\n\n" + table(["metric", *(p["name"] for p in sec["phases"])],
                                               [[name, *(f(p) for p in sec["phases"])] for name, f in rows])


def _ingress(report: dict) -> str:
    runs = report["runs"]
    thr = {a["ingress"]["threshold"] for a in runs.values() if _ok(a["ingress"])}
    rows = [("run's ingress rule", "rule", "text"), ("fresh groups", "n_groups", "int"),
            ("fresh: answer-mixed", "fresh/answer_mixed", "pct"), ("fresh: format-only", "fresh/format_only", "pct"),
            ("fresh: format-only, no correct answer", "fresh/format_only_no_correct", "pct"),
            ("fresh: all rewards equal", "fresh/uniform", "pct")]
    for rule in ("mixed", "answer", "positive"):
        rows += [(f"{rule}: admitted share", f"rules/{rule}/admit_share", "pct"),
                 *[(f"{rule}: admitted share ({i})", f"rules/{rule}/by_interval/{i}", "pct") for i in INTERVALS],
                 (f"{rule}: admitted per step", f"rules/{rule}/admitted_per_step", "num"),
                 (f"{rule}: admitted with no correct answer", f"rules/{rule}/no_correct", "pct"),
                 (f"{rule}: admitted answer-mixed", f"rules/{rule}/mixed", "pct"),
                 (f"{rule}: admitted all correct", f"rules/{rule}/all_correct", "pct"),
                 (f"{rule}: admitted format-only", f"rules/{rule}/format_only_share", "pct")]
    rows += [("buffer: format-only share (mean)", "buffer/format_only_mean", "pct"),
             *_intervals("buffer: format-only share", "buffer/by_interval", "pct"),
             ("buffer: format-only share (last step)", "buffer/format_only_final", "pct"),
             ("replay acceptance rate", "replay/accept_rate", "pct"),
             ("replay budget fill", "replay/budget_fill", "pct"),
             ("replay events on format-only groups", "replay/format_only_replay_share", "pct")]
    mism = [f"- {lab}: reconstructed ingress differs from the logged count at steps "
            f"{a['ingress']['buffer']['admitted_mismatch_steps'][:10]}" for lab, a in runs.items()
            if _ok(a["ingress"]) and _ok(a["ingress"]["buffer"]) and a["ingress"]["buffer"]["admitted_mismatch_steps"]]
    return (f"a_i = 1[r_i >= {', '.join(f'{t:g}' for t in sorted(thr)) or 'threshold'}] (answer correct), "
            "S = sum_i a_i.  Rules applied to the same fresh groups: *mixed* = rewards not all equal, *answer* = "
            "1 <= S <= n-1, *positive* = the paper's original 1 <= #{r_i > 0} <= n-1.  Format-only = S in {0, n} "
            "with unequal rewards.  The buffer is reconstructed for the run's own rule (FIFO, its capacity).\n\n"
            + run_table(report, "ingress", rows) + ("\n" + "\n".join(mism) + "\n" if mism else ""))


def render_report(report: dict) -> str:
    """The whole markdown report."""
    r = report
    ra, age_rows = _with_age_rates(r)
    fm = {lab: a["final_metrics"] for lab, a in r["runs"].items() if a["final_metrics"]}
    return "".join([
        _header(r),
        "\n## 1. Acceptance, replay-budget fill and gate rejections\n\n" + run_table(r, "acceptance", [
            ("updates", "n_updates", "int"), ("mean acceptance rate (per step)", "mean_accept_rate", "pct"),
            ("pooled acceptance rate", "pooled_accept_rate", "pct"), ("mean budget fill", "mean_budget_fill", "pct"),
            ("gate rejections per update", "mean_rejections", "num"),
            *_intervals("acceptance", "by_interval/accept_rate", "pct"),
            *_intervals("budget fill", "by_interval/budget_fill", "pct"),
            *_intervals("rejections / update", "by_interval/rejections")]) + _figure(r, "acceptance"),
        "\n## 2. Replay KL\n\n" + run_table(r, "replay_kl", [
            ("mean replay KL", "mean", "num"), *_intervals("replay KL", "by_interval"),
            ("final / early", "final_over_early", "num"), ("running-average window", "window", "int")])
        + _figure(r, "replay_kl"),
        "\n## 3. Scan depth and prefix concentration\n\n" + run_table(r, "scan", [
            ("scan order", "order", "text"), ("mean scan depth", "mean_scan_depth", "num"),
            *_intervals("scan depth", "scan_depth_by_interval"), ("filled updates", "n_filled", "int"),
            ("underfilled updates", "n_underfilled", "int"),
            ("updates stopped by the scan budget (max_scan)", "n_scan_capped", "int"),
            *[(f"accepted share from top {int(float(q) * 100)}% of buffer", f"prefix/share_at/{q}", "pct")
              for q in ("0.05", "0.1", "0.25", "0.5")],
            ("accepted share within the first k_rep ranks", "prefix/share_within_k_rep", "pct"),
            ("replayed groups with a scan position", "prefix/n_accepted", "int")]) + _figure(r, "scan")
        + "\n### Where the re-scoring goes\n\n" + run_table(r, "waste", WASTE_ROWS),
        "\n## 4. Replay age\n\n### Drift-gate outcome by age (scanned groups)\n\n" + run_table(ra, "age_gate", [
            ("mean age, accepted", "accepted/mean", "num"), ("mean age, rejected", "rejected/mean", "num"),
            ("median age, accepted", "accepted/median", "num"), ("median age, rejected", "rejected/median", "num"),
            ("youngest scanned age", "reject_share_youngest/age", "int"),
            ("rejected share at the youngest age", "reject_share_youngest/share", "pct"), *age_rows])
        + _figure(r, "age") + "\n### Source staleness\n\n" + _staleness(r)
        + "\n### Mixing structure of the used replay subset\n\n" + run_table(r, "mixing", [
            ("updates with replay", "n_replay_updates", "int"),
            ("mean distinct source ages per update", "mean_distinct_ages", "num"),
            ("% updates with >= 3 ages", "share_updates_ge3_ages", "pct"),
            ("% updates with age 1 and age >= 3", "share_updates_age1_and_ge3", "pct")]),
        "\n## 5. Initial stored Headroom and lifetime replay\n\n" + _per_run(r, "headroom_deciles", _deciles)
        + _figure(r, "headroom_deciles"),
        "\n## 6. Replay multiplicity and exposure concentration\n\n" + run_table(r, "multiplicity", [
            ("groups", "n_groups", "int"), ("never replayed", "share_never_replayed", "pct"),
            ("replay events", "total_replay_events", "int")]) + "\n" + _per_run(r, "multiplicity", _cohorts)
        + _figure(r, "multiplicity"),
        "\n## 7. Same-buffer counterfactual (selected vs recency subset)\n\nx = compatibility gain (recency Drift - "
        "selected Drift), y = learning-value gain (selected Headroom - recency Headroom), per step.\n\n"
        + run_table(r, "counterfactual", [
            ("steps", "n_steps", "int"), ("both better", "quadrant_share/both", "pct"),
            ("compatibility only", "quadrant_share/compatibility_only", "pct"),
            ("learning value only", "quadrant_share/value_only", "pct"), ("neither", "quadrant_share/neither", "pct"),
            ("tie (same subset)", "quadrant_share/tie", "pct"), ("mean compatibility gain", "mean_compat_gain", "num"),
            ("mean learning-value gain", "mean_value_gain", "num"),
            *_intervals("compatibility gain", "by_interval/compat_gain"),
            *_intervals("learning-value gain", "by_interval/value_gain")]) + _figure(r, "counterfactual"),
        "\n## 8. Entropy-collapse timing at a matched score\n\n" + _entropy(r) + _figure(r, "entropy_timing"),
        "\n## 9. Phase-wise replay mixture\n\n" + _per_run(r, "phases", _phases) + _figure(r, "phases"),
        "\n## 10. Replay ingress under a multi-part reward\n\n" + _ingress(r) + _figure(r, "ingress"),
        "\n## 11. Asynchronous pipeline: where generated groups went\n\n" + run_table(r, "async_ledger", ASYNC_ROWS),
        "\n## Training curves and final metrics\n\n" + run_table(r, "training", [
            ("score points", "score/n", "int"), *_intervals("score", "score/by_interval"),
            ("final score", "score/last", "num"), ("entropy points", "entropy/n", "int"),
            *_intervals("entropy", "entropy/by_interval"), ("final entropy", "entropy/last", "num")]),
        ("\n### metrics.json\n\n" + table(["metric", *r["runs"]], [
            [k, *(fmt(a["final_metrics"].get(k)) for a in r["runs"].values())]
            for k in sorted({k for m in fm.values() for k in m})])) if fm else "",
    ])
