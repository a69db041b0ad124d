"""Figures of a comparison (summary.json's numbers + the runs' logs), written under ``<out>/plots``.

    heldout.png          final held-out macro Mean@n per method (points; seed std bars only with >= 2 seeds)
    curves.png           held-out curve against steps, fresh responses, wall-clock natively and modelled
    regime.png           per step: zero-variance share of fresh groups (every method), acceptance (gated)
    paired.png           differences against Headroom-Drift with their 95 % intervals (>= 2 seeds)
    train_score.png      training reward, running average, against steps
  tasks with tools (summary["env_cost"], envcost.py):
    step_time.png        modelled step time against the per-call latency, per turn and sequential
    quality_wallclock.png  held-out Best@n and Mean@n against the modelled step time at each latency (the paper's
                         Figure 1b view)
    time_to_target.png   modelled wall-clock to reach each held-out accuracy, one panel per latency (per turn)

Axes fit the data (no forced zero): differences of a few hundredths must stay visible.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return str(path)


def plot_all(out: Path, summary: dict) -> list[str]:
    pdir = Path(out) / "plots"
    pdir.mkdir(exist_ok=True)
    paths = [heldout(pdir, summary), train_score(pdir, out, summary), regime(pdir, summary)]
    if any("curve" in e for e in summary["methods"].values()):
        paths.append(curves(pdir, summary))
    if any("paired" in e for e in summary["methods"].values()) and _seeds(summary) > 1:
        paths.append(paired(pdir, summary))
    if summary.get("env_cost"):
        paths += [step_time(pdir, summary), quality_wallclock(pdir, summary)]
        if summary["env_cost"].get("wallclock"):
            paths.append(time_to_target(pdir, summary))
    return paths


def step_time(pdir: Path, summary: dict) -> str:
    plt = _plt()
    ec, ms = summary["env_cost"], summary["methods"]
    lats = ec["latencies_ms"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, conc in zip(axes, ("per_turn", "sequential")):
        st = ec["step_time"][conc]
        for k, e in ms.items():
            y = [st[f"{x:g}"][k]["mean"] for x in lats]
            sd = [st[f"{x:g}"][k]["std"] for x in lats]
            ax.errorbar(lats, y, yerr=sd, marker="o", capsize=3, label=e["label"])
        ax.set_xscale("symlog", linthresh=50)
        ax.set_xlabel("per-call environment latency (ms)")
        ax.set_ylabel("modelled step time (s)")
        ax.set_title(f"{conc.replace('_', ' ')}: CPU s + latency x " + ("turns" if conc == "per_turn" else "calls"))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Step time from the counted environment calls (bars: seed std)")
    return _save(fig, pdir / "step_time.png")


def quality_wallclock(pdir: Path, summary: dict) -> str:
    plt = _plt()
    ec, ms, n = summary["env_cost"], summary["methods"], summary["n"]
    lats = ec["latencies_ms"]
    fig, axes = plt.subplots(2, len(lats), figsize=(4 * len(lats), 7), squeeze=False, sharey="row")
    for j, lat in enumerate(lats):
        st = ec["step_time"]["per_turn"][f"{lat:g}"]
        for i, key in enumerate(("macro_best_at_n", "macro_mean_at_n")):
            ax = axes[i][j]
            for k, e in ms.items():
                ax.errorbar(st[k]["mean"], e[key]["mean"], xerr=st[k]["std"], yerr=e[key]["std"], fmt="o", capsize=3,
                            label=e["label"])
            ax.set_xlabel(f"modelled step time (s) at {lat:g} ms per call")
            ax.grid(alpha=0.3)
        axes[0][j].set_title(f"latency {lat:g} ms (per turn)")
    axes[0][0].set_ylabel(f"held-out macro Best@{n}")
    axes[1][0].set_ylabel(f"held-out macro Mean@{n}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Quality against per-step wall-clock (the paper's Figure 1b view; bars: seed std)")
    return _save(fig, pdir / "quality_wallclock.png")


def time_to_target(pdir: Path, summary: dict) -> str:
    plt = _plt()
    ec, ms = summary["env_cost"], summary["methods"]
    wc = ec["wallclock"]
    lats = ec["latencies_ms"]
    fig, axes = plt.subplots(1, len(lats), figsize=(4.2 * len(lats), 4.2), squeeze=False)
    grid = wc["targets"]
    for ax, lat in zip(axes[0], lats):
        for k, e in ms.items():
            y = [np.nan if v is None else v for v in wc["per_turn"]["curves"][k][f"{lat:g}"]]
            ax.plot(grid, y, marker=".", label=e["label"])
        ax.axvline(wc["target"], color="gray", ls=":", lw=1)
        ax.set_xlabel(f"held-out macro Mean@{summary['config']['curve_n']} target")
        ax.set_ylabel("modelled wall-clock to reach it (s)")
        ax.set_title(f"{lat:g} ms per call (per turn)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Time to target (seed-mean curve; dotted: the summary's target)")
    return _save(fig, pdir / "time_to_target.png")


def _seeds(summary: dict) -> int:
    return max(e["seeds"] for e in summary["methods"].values())


def heldout(pdir: Path, summary: dict) -> str:
    plt = _plt()
    ms = summary["methods"]
    names = list(ms)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    means = [ms[k]["macro_mean_at_n"]["mean"] for k in names]
    if _seeds(summary) > 1:
        ax.errorbar(range(len(names)), means, yerr=[ms[k]["macro_mean_at_n"]["std"] for k in names], fmt="o",
                    capsize=4)
        ax.set_title(f"Held-out macro Mean@{summary['n']} (bars: seed standard deviation, {_seeds(summary)} seeds)")
    else:
        ax.plot(range(len(names)), means, "o")
        ax.set_title(f"Held-out macro Mean@{summary['n']} (one seed: no spread shown)")
    ax.set_xticks(range(len(names)), [ms[k]["label"] for k in names], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(f"macro Mean@{summary['n']}")
    ax.margins(y=0.25)
    ax.grid(alpha=0.3)
    return _save(fig, pdir / "heldout.png")


def curves(pdir: Path, summary: dict) -> str:
    plt = _plt()
    c = summary["config"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), sharey=True)
    keys = (("step", "training step"), ("fresh_responses", "fresh responses"), ("wall_s", "wall-clock s (native)"),
            ("wall_s_modelled", f"wall-clock s ({summary['modelled_ms_per_token']:g} ms/token rollout cost)"))
    for name, e in summary["methods"].items():
        cv = e.get("curve")
        if not cv:
            continue
        y = np.asarray(cv["mean_at_n"])
        for ax, (k, _) in zip(axes, keys):
            line, = ax.plot(cv[k], y, marker=".", label=e["label"])
            if e["seeds"] > 1:
                sd = np.asarray(cv["mean_at_n_seeds"]).std(axis=0, ddof=1)
                ax.fill_between(cv[k], y - sd, y + sd, color=line.get_color(), alpha=0.08)
    if summary.get("target") is not None:
        for ax in axes:
            ax.axhline(summary["target"], color="gray", ls=":", lw=1)
    for ax, (_, label) in zip(axes, keys):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out macro Mean@{c['curve_n']} ({c['curve_prompts']} prompts/benchmark)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Held-out accuracy during training" + (" (seed mean; band: seed std)" if _seeds(summary) > 1
                                                         else " (one seed)") + "; dotted: target")
    return _save(fig, pdir / "curves.png")


def regime(pdir: Path, summary: dict, window: int = 10) -> str:
    plt = _plt()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, e in summary["methods"].items():
        s = e.get("regime_series", {})
        if "zero_variance_share" in s:
            a0.plot(s["zero_variance_share"]["step"], _running(s["zero_variance_share"]["mean"], window),
                     label=e["label"])
        if "acceptance" in s and e["regime"].get("acceptance") is not None and e.get("gated"):
            a1.plot(s["acceptance"]["step"], _running(s["acceptance"]["mean"], window), label=e["label"])
    a0.axhspan(0.4, 0.6, color="green", alpha=0.08)
    a1.axhspan(0.3, 0.5, color="green", alpha=0.08)
    a0.set_title(f"Zero-variance share of fresh groups (running mean {window}; band 40-60 %)")
    a1.set_title(f"Gate acceptance per step (running mean {window}; band 30-50 %)")
    for ax in (a0, a1):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, pdir / "regime.png")


def paired(pdir: Path, summary: dict) -> str:
    plt = _plt()
    rows = [(e["label"], e["paired"]) for e in summary["methods"].values() if "paired" in e]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5))
    for i, (label, p) in enumerate(rows):
        ax.errorbar(p["diff"], i, xerr=[[p["diff"] - p["lo"]], [p["hi"] - p["diff"]]], fmt="o", capsize=4,
                    color="tab:red" if p["excludes_zero"] else "tab:blue")
    ax.axvline(0, color="k", lw=1)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xlabel(f"macro Mean@{summary['n']}: method - Headroom-Drift (95 % paired bootstrap)")
    ax.set_title("Paired differences (red: interval excludes 0)")
    ax.grid(alpha=0.3)
    return _save(fig, pdir / "paired.png")


def train_score(pdir: Path, out: Path, summary: dict, window: int = 15) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, e in summary["methods"].items():
        series = []
        for s in range(e["seeds"]):
            path = Path(out) / "runs" / name / f"seed{s}" / "train_log.jsonl"
            series.append([json.loads(x).get("reward", np.nan) for x in open(path)])
        k = min(map(len, series))
        y = np.nanmean([s[:k] for s in series], axis=0)
        ax.plot(np.arange(1, k + 1), _running(y, window), label=e["label"])
    ax.set_xlabel("training step")
    ax.set_ylabel("training reward (mean over fresh responses)")
    ax.set_title(f"Training reward, running mean (window {window})" + (", seed mean" if _seeds(summary) > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, pdir / "train_score.png")


def _running(y, w: int) -> np.ndarray:
    """Trailing mean over the last ``w`` points, missing (None / NaN) points skipped."""
    import pandas as pd

    return pd.Series([np.nan if v is None else v for v in y], dtype=float).rolling(w, min_periods=1).mean().to_numpy()
