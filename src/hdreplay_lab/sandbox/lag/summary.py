"""Summary of a policy-lag comparison: per-method tables, paired intervals against Drift-gated staleness, plots.

Per run (metrics.json): held-out macro Mean@n, the ledger's totals (shares of generated groups / tokens), the
modelled wall-clock, the lag histogram and the length histograms of trained vs discarded groups.  Paired
intervals: held-out Mean@n differences over seeds and held-out prompts (:func:`..stats.paired_bootstrap`), the
per-seed quantities over seeds (:func:`..stats.seed_bootstrap`); 95 %, 4000 replicates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hdreplay.checkpoint.atomic import atomic_write_text

from ... import jsonout
from ..stats import paired_bootstrap, paired_differences, seed_bootstrap
from .methods import ASYNC_METHODS, REFERENCE


#: per-seed quantities (name -> (label, function of metrics.json))
def _share(m: dict, *keys: str, unit: str = "groups") -> float:
    t = m["totals"]
    return sum(t[f"{k}_{unit}"] for k in keys) / max(t[f"generated_{unit}"], 1)


QUANTITIES = {
    "mean_at_n": ("held-out Mean@n", lambda m: m["macro_mean_at_n"]),
    "useful_groups": ("generated groups giving gradient", lambda m: _share(m, "fresh_mixed", "admitted")),
    "useful_tokens": ("generated tokens giving gradient", lambda m: _share(m, "fresh_mixed", "admitted",
                                                                          unit="tokens")),
    "trained_groups": ("generated groups trained", lambda m: _share(m, "fresh", "admitted")),
    "discarded_groups": ("generated groups discarded", lambda m: _share(m, "dropped", "evicted_unused")),
    "diverted_groups": ("generated groups diverted", lambda m: _share(m, "diverted")),
    "buffered_end": ("diverted, still buffered at the end", lambda m: m["buffered_diverted_at_end"] / max(
        m["totals"]["generated_groups"], 1)),
    "wall_clock_s": ("modelled wall-clock (s)", lambda m: m["wall_clock_ms"] / 1000.0),
    "steps": ("optimizer steps", lambda m: float(m["steps"])),
}


def _load(out: Path, methods, seeds: int) -> dict[str, list[dict]]:
    runs = {}
    for m in methods:
        runs[m] = [json.loads((out / "runs" / m / f"seed{s}" / "metrics.json").read_text()) for s in range(seeds)]
    return runs


def _prompt_scores(metrics: list[dict]) -> dict[str, np.ndarray]:
    benches = metrics[0]["benchmarks"]
    return {k: np.asarray([m["benchmarks"][k]["prompt_mean"] for m in metrics]) for k in benches}


def _hist_mean(hist: dict) -> float | None:
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else None


def summarize(out: Path, methods, seeds: int) -> dict:
    runs = _load(out, methods, seeds)
    table = {}
    for m, ms in runs.items():
        row = {}
        for q, (_, fn) in QUANTITIES.items():
            v = np.asarray([fn(x) for x in ms], dtype=np.float64)
            row[q] = {"mean": float(v.mean()), "sd": float(v.std(ddof=1)), "values": v.tolist()}
        lens = {k: {} for k in ("trained", "discarded")}
        for x in ms:
            for k in lens:
                for length, c in x["lengths"][k].items():
                    lens[k][length] = lens[k].get(length, 0) + c
        lags = np.zeros(max(len(x["lags"]) for x in ms))
        for x in ms:
            lags[:len(x["lags"])] += x["lags"]
        row["lengths"] = lens
        row["length_trained_mean"], row["length_discarded_mean"] = _hist_mean(lens["trained"]), _hist_mean(
            lens["discarded"])
        row["lags"] = lags.tolist()
        row["floor"] = [x["floor"] for x in ms] if ms[0]["floor"] is not None else None
        row["label"] = ASYNC_METHODS[m].label
        table[m] = row
    paired = {}
    if REFERENCE in runs:
        ref = runs[REFERENCE]
        for m in methods:
            if m == REFERENCE:
                continue
            d = paired_differences(_prompt_scores(runs[m]), _prompt_scores(ref))
            entry = {"mean_at_n": paired_bootstrap(d, reps=4000, seed=0)}
            for q in ("useful_groups", "useful_tokens", "wall_clock_s"):
                fn = QUANTITIES[q][1]
                entry[q] = seed_bootstrap([fn(x) for x in runs[m]], [fn(x) for x in ref], reps=4000, seed=0)
            paired[m] = entry
    return {"methods": list(methods), "seeds": seeds, "reference": REFERENCE, "table": table, "paired": paired}


def _f(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _ci(e: dict, spec=".3f") -> str:
    mark = " *" if e["excludes_zero"] else ""
    return f"{e['diff']:+{spec}} [{e['lo']:+{spec}}, {e['hi']:+{spec}}]{mark}"


def render(summary: dict, cfg: dict, command: str) -> str:
    t, S = summary["table"], summary["seeds"]
    lines = ["# Policy-lag sandbox: what happens to stale groups", "",
             f"Command: `{command}`", "",
             f"Task `{cfg['task']}`, {S} paired seeds, {cfg['groups']} generated groups per run (b = "
             f"{cfg['prompts_per_step']} groups per step, n = {cfg['generations']}), lr {cfg['lr']:g}, tau "
             f"{cfg['tau']:g}.  Mean over seeds (sd).  Shares are of generated groups / tokens.", "",
             "| method | held-out Mean@n | groups giving gradient | tokens giving gradient | trained | discarded "
             "| diverted | buffered at end | modelled wall-clock (s) | steps | mean length trained / discarded |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in summary["methods"]:
        r = t[m]
        c = lambda q, spec=".3f": f"{r[q]['mean']:{spec}} ({r[q]['sd']:{spec}})"  # noqa: E731
        lines.append(f"| {r['label']} | {c('mean_at_n')} | {c('useful_groups')} | {c('useful_tokens')} | "
                     f"{c('trained_groups')} | {c('discarded_groups')} | {c('diverted_groups')} | "
                     f"{c('buffered_end')} | "
                     f"{c('wall_clock_s', '.0f')} | {c('steps', '.0f')} | {_f(r['length_trained_mean'], '.2f')} / "
                     f"{_f(r['length_discarded_mean'], '.2f')} |")
    if summary["paired"]:
        ref = t[summary["reference"]]["label"]
        lines += ["", f"Paired differences, {ref} minus each method (95 % bootstrap interval; * = excludes 0):", "",
                  "| against | held-out Mean@n | groups giving gradient | tokens giving gradient | modelled "
                  "wall-clock (s) |", "|---|---|---|---|---|"]
        for m, e in summary["paired"].items():
            lines.append(f"| {t[m]['label']} | {_ci(e['mean_at_n'])} | {_ci(e['useful_groups'])} | "
                         f"{_ci(e['useful_tokens'])} | {_ci(e['wall_clock_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def plot(out: Path, summary: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    t, methods = summary["table"], summary["methods"]
    labels = [m for m in methods]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, q in zip(axes, ("mean_at_n", "useful_groups", "wall_clock_s")):
        vals = [t[m][q]["values"] for m in methods]
        ax.bar(labels, [np.mean(v) for v in vals], color="#8fb3d9")
        for i, v in enumerate(vals):
            ax.scatter([i] * len(v), v, s=8, color="k", zorder=3)
        ax.set_title(QUANTITIES[q][0])
        ax.tick_params(axis="x", rotation=45)
        lo, hi = min(min(v) for v in vals), max(max(v) for v in vals)
        ax.set_ylim(max(0.0, lo - 0.15 * (hi - lo + 1e-9)), hi + 0.15 * (hi - lo + 1e-9))  # the differences, not 0
    fig.tight_layout()
    paths.append(_save(fig, pdir / "methods.png"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for m in methods:
        lags = np.asarray(t[m]["lags"])
        lags = lags[:int(np.flatnonzero(lags).max()) + 1] if lags.any() else lags
        axes[0].plot(np.arange(len(lags)), lags / max(lags.sum(), 1), marker="o", label=m)
    axes[0].set(title="staleness at arrival (versions behind)", xlabel="k", ylabel="share of generated groups")
    axes[0].legend(fontsize=7)
    for m, style in ((methods[0], "--"), (REFERENCE, "-")):
        if m not in t:
            continue
        for kind in ("trained", "discarded"):
            h = t[m]["lengths"][kind]
            if h:
                ks = sorted(int(k) for k in h)
                tot = sum(h.values())
                axes[1].plot(ks, [h[str(k)] / tot for k in ks], style, marker="o", label=f"{m} {kind}")
    axes[1].set(title="mean completion length of trained vs discarded groups", xlabel="tokens", ylabel="share")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, pdir / "lags_lengths.png"))
    return [str(Path(p).relative_to(out)) for p in paths]


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_summary(out: Path, cfg, command: str | None = None) -> dict:
    from dataclasses import asdict

    c = asdict(cfg)
    command = command or "hdreplay compare-async --out " + str(out)
    summary = summarize(out, cfg.methods, cfg.seeds)
    summary["plots"] = plot(out, summary)
    summary["config"] = c
    atomic_write_text(out / "summary.json", jsonout.dumps(summary, indent=1))
    atomic_write_text(out / "summary.md", render(summary, c, command))
    return summary
