"""One figure per mechanism signature (signatures.py), under ``<out>/plots/sig_*.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plots import _plt, _running, _save


def plot_signatures(out: Path, sig: dict, summary: dict) -> dict[str, str]:
    pdir = Path(out) / "plots"
    pdir.mkdir(exist_ok=True)
    figs = {}
    for key, fn in (("tau_sweep", _tau), ("counterfactual", _cf), ("headroom_vs_replays", _deciles),
                    ("ages", _ages), ("l1_vs_l2", _variant), ("advantage_weighting", _variant),
                    ("ablation", _ablation)):
        s = sig.get(key, {})
        if s.get("available"):
            figs[key] = fn(pdir / f"sig_{key}.png", s, summary, out)
    return figs


def _tau(path: Path, s: dict, summary: dict, out: Path) -> str:
    from hdreplay_lab.analysis import acceptance, load_run, replay_kl

    plt = _plt()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    for label in s["runs"]:
        d = (out / "runs" / "headroom_drift" / "seed0" if label == f"tau={summary['tau']:g}"
             else out / "signatures" / label)
        steps = load_run(d, warn=False).steps
        acc, kl = acceptance(steps), replay_kl(steps)
        a0.plot(list(acc["series"]["step"]), _running(list(acc["series"]["accept_rate"]), 10), label=label)
        if kl.get("available", True) and "running" in kl:
            a1.plot(list(kl["running"]["step"]), list(kl["running"]["replay_kl"]), label=label)
    a0.set_title("Acceptance per step (running mean 10)")
    a1.set_title("Replay KL (running mean)")
    a1.set_yscale("log")
    for ax in (a0, a1):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _cf(path: Path, s: dict, summary: dict, out: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    x = np.asarray(list(s["series"]["compat_gain"]), dtype=float)
    y = np.asarray(list(s["series"]["value_gain"]), dtype=float)
    ax.scatter(x, y, s=8, alpha=0.6)
    ax.axhline(0, color="k", lw=0.8)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("compatibility gain: Drift(recency) - Drift(selected)")
    ax.set_ylabel("value gain: Headroom(selected) - Headroom(recency)")
    ax.set_title(f"Same-buffer counterfactual ('both' {100 * s['quadrant_share']['both']:.0f}% of steps)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _deciles(path: Path, s: dict, summary: dict, out: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    m = s["mean_replay_count"]
    ax.bar(np.arange(1, len(m) + 1), m)
    ax.set_xlabel("initial stored Headroom decile (1 = lowest)")
    ax.set_ylabel("mean lifetime replays N_rep")
    ax.set_title("N_rep against initial Headroom (Headroom-Drift, seed mean)")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _ages(path: Path, s: dict, summary: dict, out: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.4
    for i, (name, label) in enumerate((("headroom_drift", "Headroom-Drift"), ("recency_matched", "recency"))):
        hist = {int(k): v for k, v in (s["age_hist"].get(name) or {}).items()}
        if not hist:
            continue
        ages = np.arange(1, max(hist) + 1)
        counts = np.asarray([hist.get(a, 0) for a in ages], dtype=float)
        ax.bar(ages + (i - 0.5) * width, counts / counts.sum(), width=width, label=label)
    ax.set_xlabel("age of replayed group (steps since generation)")
    ax.set_ylabel("share of replayed groups")
    ax.set_title("Ages replayed")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _variant(path: Path, s: dict, summary: dict, out: Path) -> str:
    plt = _plt()
    nums = s["numbers"]
    names = list(next(iter(nums.values())))
    fig, axes = plt.subplots(1, len(nums), figsize=(4 * len(nums), 3.6))
    for ax, (k, v) in zip(axes, nums.items()):
        vals = [v[n] if v[n] is not None else np.nan for n in names]
        ax.bar(range(len(names)), vals, color=["tab:blue", "tab:orange"])
        labels = {"headroom_drift": "Headroom-Drift", "hdr_l1": "L1 Drift", "hdr_advantage": "|A|-weighted"}
        ax.set_xticks(range(len(names)), [labels.get(n, n) for n in names], fontsize=8)
        ax.set_title(k.replace("_", " "))
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _ablation(path: Path, s: dict, summary: dict, out: Path) -> str:
    plt = _plt()
    ms = summary["methods"]
    names = list(s["macro_mean_at_n"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, n in enumerate(names):
        p = ms[n].get("paired")
        if p is None:
            ax.plot(i, 0.0, "o", color="k")
        else:
            ax.errorbar(i, p["diff"], yerr=[[p["diff"] - p["lo"]], [p["hi"] - p["diff"]]], fmt="o", capsize=4)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), [ms[n]["label"] for n in names], fontsize=8)
    ax.set_ylabel("macro Mean@n - Headroom-Drift (95 % paired)")
    ax.set_title("Component ablation")
    ax.grid(alpha=0.3)
    return _save(fig, path)
