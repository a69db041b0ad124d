"""PNG figures of a report dict (matplotlib on an Agg canvas; no pyplot global state, no computation).  Each
``fig_*`` takes the report's ``runs`` (label -> analysis) and draws the runs that have its section."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..progress import progress
from .load import AnalysisInputError

Runs = dict[str, dict[str, Any]]


def new_figure(rows: int, cols: int, size: tuple[float, float]):
    """A constrained-layout Figure on an Agg canvas with a (rows, cols) array of axes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise AnalysisInputError("figures need matplotlib: pip install 'hdreplay[lab]' (or pass --no-figures)") from e
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def run_color(i: int) -> str:
    return f"C{i % 10}"


def _have(runs: Runs, section: str) -> list[tuple[int, str, dict]]:
    return [(i, lab, a[section]) for i, (lab, a) in enumerate(runs.items()) if a.get(section, {}).get("available")]


def _xy(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _finish(axes, labels, title: str | None = None, int_x: bool = False, legend: int = 7, one_legend=False) -> None:
    """Axis labels (xlabel, ylabel[, title]) per axis, integer x ticks, legends (on the first axis only with
    ``one_legend``: the axes share their runs), a title on the first axis."""
    from matplotlib.ticker import MaxNLocator

    for j, (a, lab) in enumerate(zip(axes, labels)):
        a.set(**dict(zip(("xlabel", "ylabel", "title"), lab)))
        if j == 0 or not one_legend:
            a.legend(fontsize=legend)
        if int_x:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        axes[0].set_title(title)


def fig_acceptance(runs: Runs):
    fig, ax = new_figure(3, 1, (8, 7))
    for i, lab, sec in _have(runs, "acceptance"):
        for a, key in zip(ax[:, 0], ("accept_rate", "budget_fill", "rejections")):
            a.plot(*_xy(sec["series"]["step"], sec["series"][key]), color=run_color(i), label=lab, lw=1.2)
    _finish(ax[:, 0], [("", "acceptance rate"), ("", "replay-budget fill"), ("step", "gate rejections")],
            "Drift-gate acceptance, budget fill and rejections per step", legend=8, one_legend=True)
    return fig


def fig_replay_kl(runs: Runs):
    fig, ax = new_figure(1, 1, (8, 4))
    positive = True
    for i, lab, sec in _have(runs, "replay_kl"):
        x, y = _xy(sec["series"]["step"], sec["series"]["replay_kl"])
        ax[0, 0].plot(x, y, ".", color=run_color(i), alpha=0.25, ms=3)
        ax[0, 0].plot(sec["running"]["step"], sec["running"]["replay_kl"], color=run_color(i),
                      label=f"{lab} (running mean, window {sec['window']})")
        positive = positive and all(v > 0 for v in y)
    ax[0, 0].set_yscale("log" if positive else "linear")
    _finish(ax[0], [("step", "replay KL", "Replay KL over training")], legend=8)
    return fig


def fig_scan(runs: Runs):
    have = _have(runs, "scan")
    fig, ax = new_figure(1, 2, (11, 4))
    for i, lab, sec in have:
        s = sec["series"]
        for flag, marker, name in ((True, "o", "filled"), (False, "D", "underfilled")):
            pts = [(x, d) for x, d, f in zip(s["step"], s["scanned"], s["filled"]) if f is flag]
            if pts:
                ax[0, 0].scatter(*zip(*pts), marker=marker, s=14, label=f"{lab}: {name}",
                                 color=run_color(i) if len(have) > 1 else ("C0" if flag else "C1"))
        if sec["prefix"].get("available"):
            ax[0, 1].plot(sec["prefix"]["grid"], sec["prefix"]["cumulative_share"], color=run_color(i),
                          label=f"{lab} ({sec['order']} order)")
    ax[0, 1].plot([0, 1], [0, 1], ":", color="gray", label="uniform")
    _finish(ax[0], [("step", "scan depth (groups)", "(A) scan depth per step"),
                    ("top prefix of the scan-ordered buffer (fraction)", "cumulative share of replay",
                     "(B) accepted replay recovered from the top prefix")])
    return fig


def fig_age(runs: Runs):
    have = _have(runs, "age_gate")
    fig, ax = new_figure(1, 3, (14, 4))
    for i, lab, sec in have:
        ages, c = sec["ages"], run_color(i)
        for key, style in (("accepted", "-"), ("rejected", "--")):
            ax[0, 0].plot(*_xy(ages, sec[f"hist_{key}"]), style, marker="o", ms=3, color=c, label=f"{lab}: {key}")
            ax[0, 1].step(*_xy(ages, sec[f"cdf_{key}"]), style, where="post", color=c, label=f"{lab}: {key}")
        ax[0, 2].plot(*_xy(ages, sec["accept_rate_by_age"]), marker="o", ms=3, color=c, label=lab)
        if len(have) == 1:
            tw = ax[0, 2].twinx()
            tw.bar(ages, sec["scanned_by_age"], color="gray", alpha=0.3, zorder=0)
            tw.set_ylabel("scanned candidates")
    x = "replay age (steps)"
    _finish(ax[0], [(x, "share within population", "(A) age histogram"), (x, "empirical CDF", "(B) age CDF"),
                    (x, "acceptance rate", "(C) acceptance rate by age")], int_x=True)
    return fig


def _bars(a, have, x_of, ykey: str, rows_of) -> None:
    w = 0.8 / max(len(have), 1)
    for j, (i, lab, sec) in enumerate(have):
        rows = rows_of(sec)
        a.bar([x_of(r) + (j - (len(have) - 1) / 2) * w for r in rows], [r[ykey] or 0 for r in rows], width=w,
              color=run_color(i), label=lab)


def fig_headroom_deciles(runs: Runs):
    have = _have(runs, "headroom_deciles")
    fig, ax = new_figure(1, 1, (8, 4))
    _bars(ax[0, 0], have, lambda b: b["bin"], "mean_replay_count", lambda s: s["bins"])
    tw = ax[0, 0].twinx()
    for i, lab, sec in have:
        tw.plot([b["bin"] for b in sec["bins"]], [b["p_replayed"] for b in sec["bins"]], "-o", ms=4,
                color="black" if len(have) == 1 else run_color(i), label=f"{lab}: P(N_rep >= 1)")
    tw.set(ylabel="P(N_rep >= 1)", ylim=(0, 1.05))
    tw.legend(fontsize=7, loc="upper center")
    _finish(ax[0], [("initial stored Headroom bin (low -> high)", "mean lifetime replay count N_rep",
                     "Initial stored Headroom and lifetime replay")], int_x=True)
    return fig


def fig_multiplicity(runs: Runs):
    fig, ax = new_figure(1, 3, (14, 4))
    keys = ("cohort_share", "replay_event_share", "exposure_share")
    for a, key in zip(ax[0], keys):
        _bars(a, _have(runs, "multiplicity"), lambda c: c["n_rep"], key, lambda s: s["cohorts"])
    _finish(ax[0], [("lifetime replay count N_rep", "share", t) for t in
                    ("(A) cohort share", "(B) replay-event share", "(C) exposure-mass share (W_T)")], int_x=True)
    return fig


def fig_counterfactual(runs: Runs):
    have = _have(runs, "counterfactual")
    fig, ax = new_figure(1, 1, (6, 5))
    for i, lab, sec in have:
        s, label = sec["series"], f"{lab} (both better: {100 * sec['quadrant_share']['both']:.0f}%)"
        color = {"c": s["step"], "cmap": "viridis"} if len(have) == 1 else {"color": run_color(i)}
        sc = ax[0, 0].scatter(s["compat_gain"], s["value_gain"], s=14, label=label, **color)
        if len(have) == 1:
            fig.colorbar(sc, ax=ax[0, 0], label="step")
    ax[0, 0].axhline(0, color="gray", lw=0.8)
    ax[0, 0].axvline(0, color="gray", lw=0.8)
    _finish(ax[0], [("compatibility gain (recency Drift - selected Drift)",
                     "learning-value gain (selected - recency Headroom)", "Same-buffer counterfactual vs recency")])
    return fig


def fig_entropy_timing(runs: Runs):
    have = [(i, lab, a["training"]) for i, (lab, a) in enumerate(runs.items()) if a["training"].get("available")
            and (a["training"]["score"]["step"] or a["training"]["entropy"]["step"])]
    if not have:
        return None
    fig, ax = new_figure(2, 1, (9, 6))
    for i, lab, tr in have:
        e, c = runs[lab]["entropy_timing"], run_color(i)
        curves = [dict(zip(tr[k]["step"], tr[k]["value"])) for k in ("score", "entropy")]
        for a, curve in zip(ax[:, 0], curves):
            a.plot(list(curve), list(curve.values()), color=c, label=lab)
        for a, curve, key, marker in ((ax[0, 0], curves[0], "t_first", "D"), (ax[1, 0], curves[1], "t_entry", "o"),
                                      (ax[1, 0], curves[1], "t_rebound", "s")):
            if e.get(key) is not None:
                a.plot([e[key]], [curve[e[key]]], marker, color=c, ms=7)
        if e.get("t_entry") is not None:
            end = e["t_rebound"] if e.get("t_rebound") is not None else tr["entropy"]["step"][-1]
            ax[1, 0].axvspan(e["t_entry"], end, color=c, alpha=0.1)
    _finish(ax[:, 0], [("", "training score S"), ("step", "policy entropy H")],
            "Score (diamond: t_first) and entropy (circle: entry, square: rebound)", one_legend=True)
    return fig


def fig_phases(runs: Runs):
    fig, ax = new_figure(2, 2, (10, 6))
    keys = (("mean_age", "mean source age"), ("share_age1", "share age = 1"), ("share_age_ge3", "share age >= 3"),
            ("mean_distinct_ages", "mean distinct ages / update"))
    for a, (key, _) in zip(ax.flat, keys):
        for i, lab, sec in _have(runs, "phases"):
            ph = sec["phases"]
            a.plot(*_xy(range(1, len(ph) + 1), [p[key] for p in ph]), "-o", color=run_color(i), ms=4, label=lab)
    _finish(list(ax.flat), [("phase", name) for _, name in keys], "Phase-wise replay mixture", one_legend=True)
    return fig


def fig_ingress(runs: Runs):
    have = _have(runs, "ingress")
    fig, ax = new_figure(1, 3, (15, 4))
    styles = {"mixed": "-", "answer": "--", "positive": ":"}
    for i, lab, sec in have:
        s, c = sec["series"], run_color(i)
        for rule, style in styles.items():
            y = pd.Series(s[f"admit_{rule}"], dtype="float64").rolling(5, min_periods=1).mean()
            ax[0, 0].plot(s["step"], y, style, color=c, label=f"{lab}: {rule}")
        ax[0, 1].plot(*_xy(s["step"], s["buffer_format_only"]), color=c, label=f"{lab} ({sec['rule']} ingress)")
    _bars(ax[0, 2], [(i, f"{lab}: {rule}", {"rows": [{"x": j, "y": sec["rules"][rule][k]}
                                                      for j, k in enumerate(("no_correct", "mixed", "all_correct"))]})
                     for i, lab, sec in have for rule in ("mixed", "answer")],
          lambda r: r["x"], "y", lambda s: s["rows"])
    ax[0, 2].set_xticks(range(3), ["S = 0", "1 <= S <= n-1", "S = n"])
    _finish(ax[0], [("step", "share of fresh groups admitted", "(A) ingress per step (5-step mean)"),
                    ("step", "format-only share of the buffer", "(B) buffer composition (run's rule)"),
                    ("answer-correct responses S of admitted groups", "share of admitted groups",
                     "(C) what each rule admits")])
    return fig


#: name -> (the section some run must have, figure function); entropy_timing decides for itself
FIGURES: dict[str, tuple[str | None, Callable[[Runs], Any]]] = {
    "acceptance": ("acceptance", fig_acceptance), "replay_kl": ("replay_kl", fig_replay_kl), "scan": ("scan", fig_scan),
    "age": ("age_gate", fig_age), "headroom_deciles": ("headroom_deciles", fig_headroom_deciles),
    "multiplicity": ("multiplicity", fig_multiplicity), "counterfactual": ("counterfactual", fig_counterfactual),
    "entropy_timing": (None, fig_entropy_timing), "phases": ("phases", fig_phases), "ingress": ("ingress", fig_ingress),
}


def render_figures(report: dict, out_dir: Path, *, show_progress: bool = False) -> dict[str, Path]:
    """Write every figure some run has data for as ``out_dir/<name>.png``; returns {name: path}."""
    new_figure(1, 1, (1, 1))  # matplotlib missing: say so before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    with progress(FIGURES.items(), desc="rendering figures", enabled=show_progress, lines=0, leave=False) as bar:
        for name, (section, fn) in bar:
            fig = fn(report["runs"]) if section is None or _have(report["runs"], section) else None
            if fig is not None:
                fig.savefig(out_dir / f"{name}.png", dpi=110)
                paths[name] = out_dir / f"{name}.png"
    return paths
