"""PNG figures of a report dict (matplotlib, Agg canvas; no pyplot global state, no computation).

Each ``fig_*`` function takes the report's ``runs`` mapping (label -> analysis) and returns a
matplotlib Figure, or None when no run has the data.  :func:`render_figures` writes them.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from .load import AnalysisInputError
from .progress import progress

Runs = dict[str, dict[str, Any]]


def _mpl():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise AnalysisInputError("figures need matplotlib: pip install 'hdreplay[sandbox]' "
                                 "(or pass --no-figures)") from e
    return Figure, FigureCanvasAgg


def new_figure(rows: int, cols: int, size: tuple[float, float]):
    """A constrained-layout Figure on an Agg canvas with a (rows, cols) array of axes."""
    Figure, Canvas = _mpl()
    fig = Figure(figsize=size, layout="constrained")
    Canvas(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _int_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_color(i: int) -> str:
    return f"C{i % 10}"


def _have(runs: Runs, section: str) -> list[tuple[int, str, dict]]:
    return [(i, lab, a[section]) for i, (lab, a) in enumerate(runs.items())
            if a.get(section, {}).get("available", False)]


def _xy(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def fig_acceptance(runs: Runs):
    have = _have(runs, "acceptance")
    if not have:
        return None
    fig, ax = new_figure(3, 1, (8, 7))
    for i, lab, sec in have:
        s = sec["series"]
        for row, key in enumerate(("accept_rate", "budget_fill", "rejections")):
            ax[row, 0].plot(*_xy(s["step"], s[key]), color=run_color(i), label=lab, lw=1.2)
    for row, name in enumerate(("acceptance rate", "replay-budget fill", "gate rejections")):
        ax[row, 0].set_ylabel(name)
    ax[2, 0].set_xlabel("step")
    ax[0, 0].legend(fontsize=8)
    ax[0, 0].set_title("Drift-gate acceptance, budget fill and rejections per step")
    return fig


def fig_replay_kl(runs: Runs):
    have = _have(runs, "replay_kl")
    if not have:
        return None
    fig, ax = new_figure(1, 1, (8, 4))
    a = ax[0, 0]
    positive = True
    for i, lab, sec in have:
        x, y = _xy(sec["series"]["step"], sec["series"]["replay_kl"])
        a.plot(x, y, ".", color=run_color(i), alpha=0.25, ms=3)
        a.plot(sec["running"]["step"], sec["running"]["replay_kl"], color=run_color(i),
               label=f"{lab} (running mean, window {sec['window']})")
        positive = positive and all(v > 0 for v in y)
    if positive:
        a.set_yscale("log")
    a.set(xlabel="step", ylabel="replay KL", title="Replay KL over training")
    a.legend(fontsize=8)
    return fig


def fig_scan(runs: Runs):
    have = _have(runs, "scan")
    if not have:
        return None
    fig, ax = new_figure(1, 2, (11, 4))
    for i, lab, sec in have:
        s = sec["series"]
        for flag, marker, name in ((True, "o", "filled"), (False, "D", "underfilled")):
            pts = [(x, d) for x, d, f in zip(s["step"], s["scanned"], s["filled"]) if f is flag]
            if pts:
                ax[0, 0].scatter(*zip(*pts), marker=marker, s=14, color=run_color(i) if len(have) > 1 else
                                 ("C0" if flag else "C1"), label=f"{lab}: {name}")
        p = sec["prefix"]
        if p.get("available", False):
            ax[0, 1].plot(p["grid"], p["cumulative_share"], color=run_color(i), label=f"{lab} ({sec['order']} order)")
    ax[0, 0].set(xlabel="step", ylabel="scan depth (groups)", title="(A) scan depth per step")
    ax[0, 1].plot([0, 1], [0, 1], ":", color="gray", label="uniform")
    ax[0, 1].set(xlabel="top prefix of the scan-ordered buffer (fraction)", ylabel="cumulative share of replay",
                 title="(B) accepted replay recovered from the top prefix")
    for a in ax[0]:
        a.legend(fontsize=7)
    return fig


def fig_age(runs: Runs):
    have = _have(runs, "age_gate")
    if not have:
        return None
    fig, ax = new_figure(1, 3, (14, 4))
    for i, lab, sec in have:
        ages = sec["ages"]
        for key, style, name in (("accepted", "-", "accepted"), ("rejected", "--", "rejected")):
            ax[0, 0].plot(*_xy(ages, sec[f"hist_{key}"]), style, marker="o", ms=3, color=run_color(i), label=f"{lab}: {name}")
            ax[0, 1].step(*_xy(ages, sec[f"cdf_{key}"]), style, where="post", color=run_color(i), label=f"{lab}: {name}")
        ax[0, 2].plot(*_xy(ages, sec["accept_rate_by_age"]), marker="o", ms=3, color=run_color(i), label=lab)
        if len(have) == 1:
            tw = ax[0, 2].twinx()
            tw.bar(ages, sec["scanned_by_age"], color="gray", alpha=0.3, zorder=0)
            tw.set_ylabel("scanned candidates")
    for a in ax[0]:
        _int_ticks(a)
    ax[0, 0].set(xlabel="replay age (steps)", ylabel="share within population", title="(A) age histogram")
    ax[0, 1].set(xlabel="replay age (steps)", ylabel="empirical CDF", title="(B) age CDF")
    ax[0, 2].set(xlabel="replay age (steps)", ylabel="acceptance rate", title="(C) acceptance rate by age")
    for a in ax[0]:
        a.legend(fontsize=7)
    return fig


def _grouped_bars(a, have, xkey_fn, ykey: str, rows_fn):
    w = 0.8 / max(len(have), 1)
    for j, (i, lab, sec) in enumerate(have):
        rows = rows_fn(sec)
        xs = [xkey_fn(r) + (j - (len(have) - 1) / 2) * w for r in rows]
        a.bar(xs, [r[ykey] or 0 for r in rows], width=w, color=run_color(i), label=lab)


def fig_headroom_deciles(runs: Runs):
    have = _have(runs, "headroom_deciles")
    if not have:
        return None
    fig, ax = new_figure(1, 1, (8, 4))
    a = ax[0, 0]
    _grouped_bars(a, have, lambda b: b["bin"], "mean_replay_count", lambda s: s["bins"])
    tw = a.twinx()
    for i, lab, sec in have:
        tw.plot([b["bin"] for b in sec["bins"]], [b["p_replayed"] for b in sec["bins"]], "-o",
                color="black" if len(have) == 1 else run_color(i),
                ms=4, label=f"{lab}: P(N_rep >= 1)")
    tw.set(ylabel="P(N_rep >= 1)", ylim=(0, 1.05))
    _int_ticks(a)
    a.set(xlabel="initial stored Headroom bin (low -> high)", ylabel="mean lifetime replay count N_rep",
          title="Initial stored Headroom and lifetime replay")
    a.legend(fontsize=7, loc="upper left")
    tw.legend(fontsize=7, loc="upper center")
    return fig


def fig_multiplicity(runs: Runs):
    have = _have(runs, "multiplicity")
    if not have:
        return None
    fig, ax = new_figure(1, 3, (14, 4))
    for col, (key, title) in enumerate((("cohort_share", "(A) cohort share"),
                                        ("replay_event_share", "(B) replay-event share"),
                                        ("exposure_share", "(C) exposure-mass share (W_T)"))):
        _grouped_bars(ax[0, col], have, lambda c: c["n_rep"], key, lambda s: s["cohorts"])
        _int_ticks(ax[0, col])
        ax[0, col].set(xlabel="lifetime replay count N_rep", ylabel="share", title=title)
        ax[0, col].legend(fontsize=7)
    return fig


def fig_counterfactual(runs: Runs):
    have = _have(runs, "counterfactual")
    if not have:
        return None
    fig, ax = new_figure(1, 1, (6, 5))
    a = ax[0, 0]
    for i, lab, sec in have:
        s = sec["series"]
        both = sec["quadrant_share"]["both"]
        if len(have) == 1:
            sc = a.scatter(s["compat_gain"], s["value_gain"], c=s["step"], cmap="viridis", s=14,
                           label=f"{lab} (both better: {100 * both:.0f}%)")
            fig.colorbar(sc, ax=a, label="step")
        else:
            a.scatter(s["compat_gain"], s["value_gain"], color=run_color(i), s=14,
                      label=f"{lab} (both better: {100 * both:.0f}%)")
    a.axhline(0, color="gray", lw=0.8)
    a.axvline(0, color="gray", lw=0.8)
    a.set(xlabel="compatibility gain (recency Drift - selected Drift)",
          ylabel="learning-value gain (selected - recency Headroom)", title="Same-buffer counterfactual vs recency")
    a.legend(fontsize=7)
    return fig


def fig_entropy_timing(runs: Runs):
    have = [(i, lab, a["training"]) for i, (lab, a) in enumerate(runs.items())
            if a["training"].get("available") and (a["training"]["score"]["step"] or a["training"]["entropy"]["step"])]
    if not have:
        return None
    fig, ax = new_figure(2, 1, (9, 6))
    for i, lab, tr in have:
        e = runs[lab]["entropy_timing"]
        ax[0, 0].plot(tr["score"]["step"], tr["score"]["value"], color=run_color(i), label=lab)
        ax[1, 0].plot(tr["entropy"]["step"], tr["entropy"]["value"], color=run_color(i), label=lab)
        if e.get("t_first") is not None:
            v = dict(zip(tr["score"]["step"], tr["score"]["value"]))[e["t_first"]]
            ax[0, 0].plot([e["t_first"]], [v], "D", color=run_color(i), ms=7)
        h = dict(zip(tr["entropy"]["step"], tr["entropy"]["value"]))
        for key, marker in (("t_entry", "o"), ("t_rebound", "s")):
            if e.get(key) is not None:
                ax[1, 0].plot([e[key]], [h[e[key]]], marker, color=run_color(i), ms=7)
        if e.get("t_entry") is not None:
            end = e["t_rebound"] if e.get("t_rebound") is not None else tr["entropy"]["step"][-1]
            ax[1, 0].axvspan(e["t_entry"], end, color=run_color(i), alpha=0.1)
    ax[0, 0].set(ylabel="training score S", title="Score (diamond: t_first) and entropy (circle: entry, square: rebound)")
    ax[1, 0].set(xlabel="step", ylabel="policy entropy H")
    ax[0, 0].legend(fontsize=7)
    return fig


def fig_phases(runs: Runs):
    have = _have(runs, "phases")
    if not have:
        return None
    fig, ax = new_figure(2, 2, (10, 6))
    keys = (("mean_age", "mean source age"), ("share_age1", "share age = 1"),
            ("share_age_ge3", "share age >= 3"), ("mean_distinct_ages", "mean distinct ages / update"))
    for n, (key, name) in enumerate(keys):
        a = ax[n // 2, n % 2]
        for i, lab, sec in have:
            ph = sec["phases"]
            a.plot(*_xy(range(1, len(ph) + 1), [p[key] for p in ph]), "-o", color=run_color(i), ms=4, label=lab)
        a.set(xlabel="phase", ylabel=name)
    ax[0, 0].legend(fontsize=7)
    ax[0, 0].set_title("Phase-wise replay mixture")
    return fig


FIGURES: dict[str, Callable[[Runs], Any]] = {
    "acceptance": fig_acceptance, "replay_kl": fig_replay_kl, "scan": fig_scan, "age": fig_age,
    "headroom_deciles": fig_headroom_deciles, "multiplicity": fig_multiplicity,
    "counterfactual": fig_counterfactual, "entropy_timing": fig_entropy_timing, "phases": fig_phases,
}


def render_figures(report: dict, out_dir: Path, *, show_progress: bool = False) -> dict[str, Path]:
    """Write every available figure as ``out_dir/<name>.png``; returns {name: path}."""
    _mpl()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    with closing(progress(list(FIGURES.items()), desc="rendering figures", enabled=show_progress)) as it:
        for name, fn in it:
            fig = fn(report["runs"])
            if fig is None:
                continue
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=110)
            paths[name] = path
    return paths
