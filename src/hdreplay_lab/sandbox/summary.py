"""The comparison summary: numbers (summary.json) from the run directories; tables.py renders them.

Sections of summary.json (per method under ``methods``):
    benchmarks, macro/weighted Mean@n and Best@n     seed mean and standard deviation (as before)
    regime      seed means of the per-step regime numbers (regime.py): zero-variance share, acceptance,
                budget fill, scan depth, replay KL, generation share native and under the modelled cost
    paired      against the reference (Headroom-Drift): macro Mean@n difference (method - reference), its
                95 % paired bootstrap interval over seeds and held-out prompts (stats.py), whether it
                excludes 0, the seed and prompt parts of the half-width, the seeds a half-width of 0.01
                would need, and (``corrected``) the Bonferroni interval over the comparison's methods
    curve       the seed-mean held-out curve (curves.py), area under it (per seed, and paired against the
                reference), and the cost to reach the target accuracy (steps, fresh responses, wall-clock
                native and modelled)
and ``gate``: the plain-language "what did the gate do?" numbers (acceptance, scan depth, replay KL gated
vs ungated, ages replayed by Headroom-Drift vs recency); for a task with tools ``env_cost`` (envcost.py): counted
tool calls / turns / tokens and CPU seconds per step, the modelled step time at each ``--latencies-ms`` under both
concurrency models with the paper's figures, the wall-clock to the target and the crossover latencies.

Before anything is computed, every run's settings (run.json) must be the comparison's (compare.json) and every run
must start from the same model: a directory whose seeds disagree (hand-merged runs, a run redone with other settings)
is refused (:func:`check_runs_agree`), naming the run and the setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from hdreplay.checkpoint.atomic import atomic_write_text

from .. import jsonout
from ..analysis.load import AnalysisInputError
from .curves import cost_to_target, method_curve, read_curve
from .methods import METHODS
from .regime import cost_for_share, interval_regime, method_regime, run_regime
from .stats import components, paired_bootstrap, paired_differences, seed_bootstrap, seeds_needed

REFERENCE = "headroom_drift"
#: selectors with a Drift gate: their acceptance is a gate pass rate (recency / Headroom-only replay all they scan)
GATED = ("headroom_drift", "drift_only")
#: the half-width the comparison is designed for (issue 16)
TARGET_HALF_WIDTH = 0.01


def _stats(xs) -> dict:
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0, "n": int(a.size)}


def _run_dir(out: Path, method: str, seed: int) -> Path:
    return out / "runs" / method / f"seed{seed}"


def _prompt_scores(runs: list[dict], best: bool = False) -> dict[str, np.ndarray]:
    """(seeds, prompts) per benchmark: each prompt's Mean@n, or with ``best`` its Best@n, which for 0/1 rewards is
    whether any of its n samples scored (Mean@n > 0)."""
    out = {b: np.asarray([r["benchmarks"][b]["prompt_mean"] for r in runs]) for b in runs[0]["benchmarks"]}
    return {b: (v > 0).astype(np.float64) for b, v in out.items()} if best else out


def _conflicts(have, want, path: str = "") -> list[tuple[str, object, object]]:
    """(key, have, want) where both sides set a key to different values (nested dicts compared key by key: a setting
    one side lacks was added or dropped between versions and is not a disagreement)."""
    if isinstance(have, dict) and isinstance(want, dict):
        return [c for k in sorted(set(have) & set(want)) for c in _conflicts(have[k], want[k], f"{path}{k}.")]
    return [] if have == want else [(path.rstrip("."), have, want)]


def check_runs_agree(out: Path, cfg, methods) -> None:
    """Refuse (AnalysisInputError: the command line reports it in one line) to summarize when a run's run.json
    disagrees with the comparison's settings for that method and seed (``cfg.spec``), or the runs did not all start
    from the same model: paired intervals over seeds that ran different settings would compare settings, not methods."""
    models: dict = {}
    for m in methods:
        for s in range(cfg.seeds):
            d = _run_dir(out, m.name, s)
            have = json.loads((d / "run.json").read_text())
            spec = cfg.spec(m.name, s)
            want = json.loads(json.dumps({**asdict(spec), "dataset_prompts": spec.num_dataset_prompts()}))
            bad = _conflicts({k: v for k, v in have.items() if k in want}, want)
            if bad:
                k, h, w = bad[0]
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise AnalysisInputError(
                    f"refusing to summarize {out}: {d.relative_to(out)} ran with {k}={h!r} where the comparison "
                    f"(compare.json) has {k}={w!r}{more}: its seeds disagree on settings; rerun that run (delete its "
                    "directory and run the same command) or use another --out")
            models.setdefault(have.get("model"), []).append(str(d.relative_to(out)))
    if len(models) > 1:
        (a, ra), (b, rb) = list(models.items())[:2]
        raise AnalysisInputError(f"refusing to summarize {out}: its runs started from different models ({ra[0]}: {a}; "
                                 f"{rb[0]}: {b}); every run of a comparison starts from the same warm start")


def summarize(out: Path, cfg, methods, task, *, reps: int = 4000) -> dict:
    check_runs_agree(out, cfg, methods)
    res = {"format": "hdreplay.compare.summary/2", "config": asdict(cfg), "task": task.name, "n": cfg.eval_n,
           "tau": cfg.tau,
           "multiturn": bool(getattr(task, "is_multiturn", False)),
           "benchmarks": {b.name: b.size for b in task.benchmarks}, "methods": {},
           "reference": REFERENCE if any(m.name == REFERENCE for m in methods) else None}
    modelled = cfg.modelled_ms_per_token
    if modelled is None:
        base = "onpolicy_matched" if any(m.name == "onpolicy_matched" for m in methods) else methods[0].name
        modelled = _round_up(cost_for_share([_run_dir(out, base, s) for s in range(cfg.seeds)]))
        res["modelled_from"] = base
    res["modelled_ms_per_token"] = modelled
    metrics, curves = {}, {}
    for m in methods:
        runs = [json.loads((_run_dir(out, m.name, s) / "metrics.json").read_text()) for s in range(cfg.seeds)]
        metrics[m.name] = runs
        entry = {"label": m.label, "seeds": len(runs), "benchmarks": {},
                 "gated": m.selector in GATED}  # a Drift gate decides what is replayed
        for b in task.benchmarks:
            entry["benchmarks"][b.name] = {
                "mean_at_n": _stats(r["benchmarks"][b.name]["mean_at_n"] for r in runs),
                "best_at_n": _stats(r["benchmarks"][b.name]["best_at_n"] for r in runs),
            }
        for k in ("macro_mean_at_n", "macro_best_at_n", "weighted_mean_at_n", "weighted_best_at_n",
                  "mean_step_s", "train_wall_s", "final_train_reward", "env_calls_per_step", "tool_turns_per_step",
                  "cpu_s_per_step", "policy_tokens_per_step"):
            entry[k] = _stats(r.get(k) for r in runs)
        for k in ("fresh_responses", "rescored_rows", "replayed_rows", "replayed_groups"):
            entry[k] = _stats(r.get(k) for r in runs)  # runs written before these costs existed: n/a
        entry["env_latency_ms"] = runs[0].get("env_latency_ms", 0.0)
        regimes = [run_regime(_run_dir(out, m.name, s), model_ms_per_token=modelled)
                   for s in range(cfg.seeds)]
        entry["regime"] = method_regime(regimes)
        entry["regime_series"] = _mean_series(regimes)
        width = cfg.eval_every or max(1, cfg.steps // 4)  # the curve's intervals
        entry["regime_intervals"] = interval_regime(regimes, cfg.steps - 1, width)  # steps 1..T-1 (0-based)
        seed_curves = [read_curve(_run_dir(out, m.name, s)) for s in range(cfg.seeds)]
        if all(len(c) >= 2 for c in seed_curves):
            curves[m.name] = entry["curve"] = method_curve(
                seed_curves, run_ms_per_token=cfg.rollout_ms_per_token, model_ms_per_token=modelled)
        res["methods"][m.name] = entry
    ref = res["reference"]
    if ref is not None:
        family = sum(name != ref for name in metrics)  # the comparisons the verdict makes at once
        for name, runs in metrics.items():
            if name != ref:
                res["methods"][name]["paired"] = _paired(metrics[ref], runs, reps=reps, family=family)
                if res["multiturn"]:  # the search tasks' rewards are 0/1, so Best@n per prompt is known from Mean@n
                    res["methods"][name]["paired_best"] = _paired(metrics[ref], runs, reps=reps, family=family,
                                                                  best=True)
    _curve_costs(res, curves, cfg.target, ref, reps=reps)
    if res["multiturn"]:
        res["env_cost"] = env_cost(out, cfg, [m.name for m in methods], res.get("target"), reps=reps)
    res["gate"] = gate_numbers(out, cfg, [m.name for m in methods])
    res["prompt_order"] = prompt_order(out, cfg, [m.name for m in methods])
    return res


def env_cost(out: Path, cfg, names: list[str], target: float | None, *, reps: int = 4000) -> dict:
    """The environment-cost section (envcost.py): counts, modelled step times, wall-clock to ``target``."""
    from .envcost import PAPER_MEAN32, PAPER_STEP_S, counts_table, run_env_cost, step_time_table, wallclock_summary

    costs = {n: [run_env_cost(_run_dir(out, n, s)) for s in range(cfg.seeds)] for n in names}
    base = "onpolicy_matched" if "onpolicy_matched" in names else None
    ref = REFERENCE if REFERENCE in names else None
    res = {"latencies_ms": list(cfg.latencies_ms), "concurrency": cfg.tool_concurrency,
           "slept_latency_ms": cfg.latency_ms, "base": base, "reference": ref, "counts": counts_table(costs),
           "step_time": step_time_table(costs, cfg.latencies_ms, base=base, reference=ref, reps=reps),
           "paper": {"step_s": PAPER_STEP_S, "mean_at_32": PAPER_MEAN32}}
    curves = {n: [read_curve(_run_dir(out, n, s)) for s in range(cfg.seeds)] for n in names}
    if target is not None and ref and all(len(c) >= 2 for cs in curves.values() for c in cs):
        res["wallclock"] = wallclock_summary(curves, cfg.latencies_ms, target, reference=ref,
                                             others=[n for n in names if n != ref], reps=min(reps, 2000))
    return res


def prompt_order(out: Path, cfg, names: list[str]) -> dict:
    """Whether, per seed, every method read the same prompt sequence as the first method (Headroom-Drift when it
    runs), each at its own rate (runner.py): the two streams agree over the shorter one's length.  A method is
    named when it does not (e.g. 1.5 b prompts per step with a ``--train-pool`` that is not a multiple of 1.5 b:
    TRL's sampler drops an epoch's incomplete last batch, so that method's epochs start elsewhere)."""
    bad = []
    for s in range(cfg.seeds):
        streams = {}
        for n in names:
            d = _run_dir(out, n, s)
            path = d / "prompts.jsonl" if (d / "prompts.jsonl").is_file() else d / "train_log.jsonl"  # older runs
            b = METHODS[n].fresh_groups(cfg.prompts_per_step)  # a step's first b: the dataloader's batch (runs
            with open(path) as f:                                 # that logged every generation round included)
                streams[n] = [p for line in f for p in json.loads(line).get("prompts", [])[:b]]
        ref = streams["headroom_drift" if "headroom_drift" in streams else names[0]]
        bad += [f"{n} seed {s}" for n, st in streams.items()
                if not st or st[:len(ref)] != ref[:len(st)]]
    return {"same_order": not bad, "seeds": cfg.seeds, "methods": len(names), "mismatches": bad}


def _round_up(ms: float) -> float:
    """Up to two significant digits (0.1234 -> 0.13), so the stated cost is a round setting."""
    if ms <= 0:
        return 0.0
    scale = 10.0 ** (np.floor(np.log10(ms)) - 1)
    return float(np.ceil(ms / scale - 1e-9) * scale)


def _paired(ref_runs: list[dict], runs: list[dict], *, reps: int, family: int = 1, best: bool = False) -> dict:
    """The 95 % paired interval, its seed / prompt parts, the seeds the target needs, and under ``corrected`` the
    Bonferroni interval for ``family`` simultaneous comparisons (level 1 - 0.05 / family, same replicates); of the
    macro Best@n with ``best`` (0/1 rewards only)."""
    d = paired_differences(_prompt_scores(ref_runs, best), _prompt_scores(runs, best))
    out = paired_bootstrap(d, reps=reps, also=(1 - 0.05 / max(family, 1),))
    out["corrected"] = {"method": "bonferroni", "comparisons": family, **out.pop("also")[0]}
    out.update(components(d, reps=reps))
    out["seeds_for_target"] = seeds_needed(out["seed_half_width"], out["prompt_half_width"], out["seeds"],
                                           TARGET_HALF_WIDTH)
    return out


def _curve_costs(res: dict, curves: dict, target: float | None, ref: str | None, *, reps: int) -> None:
    if not curves:
        return
    if target is None:
        base = "onpolicy_matched" if "onpolicy_matched" in curves else next(iter(curves))
        target = curves[base]["mean_at_n"][-1]
        res["target_from"] = base
    res["target"] = target
    for name, c in curves.items():
        c["to_target"] = cost_to_target(c, target)
        c["auc"] = _stats(c["auc_seeds"])
        if ref in curves and name != ref and len(c["auc_seeds"]) > 1:
            c["auc_paired"] = seed_bootstrap(curves[ref]["auc_seeds"], c["auc_seeds"], reps=reps)


def _mean_series(regimes: list[dict]) -> dict:
    """Seed-mean per-step series (zero-variance share, acceptance, replay KL) for the figures."""
    out = {}
    for key, xkey in (("zero_variance_share", "step"), ("acceptance", "replay_step"), ("replay_kl", "replay_step")):
        series = [r["series"].get(key) for r in regimes]
        if not all(series):
            continue
        k = min(map(len, series))
        a = np.asarray([[np.nan if v is None else v for v in s[:k]] for s in series], dtype=np.float64)
        ok = np.isfinite(a)
        mean = np.where(ok, a, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1)
        out[key] = {"step": regimes[0]["series"][xkey][:k],
                    "mean": [float(m) if c else None for m, c in zip(mean, ok.any(axis=0))]}
    return out


def gate_numbers(out: Path, cfg, names: list[str]) -> dict:
    """What the gate did, from the replay diagnostics of Headroom-Drift and recency replay (seed means)."""
    res = {}
    for name in (REFERENCE, "recency_matched"):
        if name not in names:
            continue
        acc, scan, fill, kl, ages = [], [], [], [], []
        for s in range(cfg.seeds):
            path = _run_dir(out, name, s) / "replay" / "steps.jsonl"
            steps = [json.loads(x) for x in open(path)] if path.is_file() else []
            steps = [x for x in steps if x["step"] >= 1]
            acc += [x["accept_rate"] for x in steps if x.get("accept_rate") is not None]
            scan += [x["scanned"] for x in steps]
            fill += [x["budget_fill"] for x in steps if x.get("budget_fill") is not None]
            kl += [x["replay_kl"] for x in steps if x.get("replay_kl") is not None]
            ages += [a for x in steps for a in x.get("accepted_ages", [])]
        a = np.asarray(ages, dtype=np.float64)
        res[name] = {
            "acceptance": float(np.mean(acc)) if acc else None,
            "scanned_per_step": float(np.mean(scan)) if scan else None,
            "budget_fill": float(np.mean(fill)) if fill else None,
            "replay_kl": float(np.mean(kl)) if kl else None,
            "mean_age": float(a.mean()) if a.size else None,
            "share_age_1": float((a == 1).mean()) if a.size else None,
            "max_age": int(a.max()) if a.size else None,
            "age_hist": ({int(k): int(v) for k, v in zip(*np.unique(a.astype(int), return_counts=True))}
                         if a.size else {}),
        }
    return res


def write_summary(out: Path, cfg, methods, task, *, env: dict, demo: bool = False) -> dict:
    from .plots import plot_all
    from .tables import render_markdown

    summary = summarize(out, cfg, methods, task)
    summary["environment"] = env
    summary["demo"] = demo
    # relative to the comparison directory, so the summary stays valid when the directory is moved or shared
    summary["plots"] = [str(Path(p).relative_to(out)) for p in plot_all(out, summary)]
    atomic_write_text(out / "summary.json", jsonout.dumps(summary, indent=2))
    atomic_write_text(out / "summary.md", render_markdown(summary))
    return summary
