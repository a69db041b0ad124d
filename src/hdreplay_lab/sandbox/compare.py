"""``hdreplay compare`` / ``hdreplay demo``: the paper's role-aligned comparison at small scale.

Output directory layout:
    compare.json                 the comparison's settings (a different run refuses to reuse the dir)
    warmstart/                   cached warm-started models (reused by later runs)
    runs/<method>/seed<k>/       one run directory each (see runner.py)
    summary.md, summary.json     the table (methods x benchmarks, Best@n / Mean@n, seed mean and spread,
                                 fresh responses, step time) and its numbers
    plots/train_score_steps.png, plots/train_score_wallclock.png, plots/heldout_mean.png
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hdreplay.config import ReplayConfig
from hdreplay.errors import ReplayConfigError

from ..options import arg
from .methods import (
    COMPARE_METHODS, GEO_METHODS, METHODS, SEARCH_METHODS, STRATEGY_METHODS, Method, get_methods,
)
from .runner import RunSpec
from .tasks import TASKS, Task, get_task

FORMAT = "hdreplay.compare"
#: the sandbox's replay defaults where they differ from ReplayConfig's (tau: 1e-2 suits this tiny model's
#: step-to-step drift; capacity: 4 steps of fresh groups, as the paper's 512 groups at b = 128)
SANDBOX_TAU = 1e-2


@dataclass
class CompareConfig:
    """The paper's role-aligned comparison at small scale: every method x seed trained on one sandbox task, then
    evaluated on its held-out benchmarks."""

    task: str = arg("add", f"sandbox task: one of {sorted(TASKS)}")
    methods: tuple[str, ...] | None = arg(
        None, f"comma-separated methods from {list(METHODS)} (unset: the paper's {','.join(COMPARE_METHODS)}; with "
              f"--task search: {','.join(SEARCH_METHODS)}; with --task geo: {','.join(GEO_METHODS)}; the strategy "
              f"comparison: {','.join(STRATEGY_METHODS)})")
    seeds: int = arg(3, "seeds per method (>= 1)")
    steps: int = arg(300, "optimizer steps per run (>= 1)")
    prompts_per_step: int = arg(16, "b: fresh groups per step (even, so that b/2 and 1.5b are whole groups)")
    generations: int = arg(8, "n: responses per group (>= 2)")
    lr: float = arg(1e-4, "learning rate (finite, > 0)")
    eval_n: int = arg(8, "samples per held-out prompt (Mean@n / Best@n)")
    model: str | None = arg(None, "local causal-LM checkpoint instead of the warm-started tiny model")
    latency_ms: float | None = arg(None, "search task: environment latency per tool call in ms (unset: the task's 5)")
    train_pool: int | None = arg(None, "distinct training problems, cycled over epochs by every method (unset: twice "
                                       "the prompts a run visits, so no prompt repeats; RePO needs repeats)")
    #: replay settings shared by the methods (ReplayConfig knob -> value); each method sets its own selector, and
    #: k_rep = r sets the replay budget of the b + r methods (b + 2r ones get 2r); unset: r = b/2, tau = 1e-2,
    #: capacity = 4b, the rest ReplayConfig's defaults
    replay: dict = arg(default_factory=dict, knobs=True)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        task = get_task(self.task)  # names the valid tasks
        if self.methods is None:
            self.methods = (SEARCH_METHODS if task.is_multiturn else
                            GEO_METHODS if getattr(task, "is_multimodal", False) else COMPARE_METHODS)
        if "ingress" not in self.replay and getattr(task, "default_ingress", None):
            self.replay["ingress"] = task.default_ingress  # geo: answer-based, as the paper trains Geo3K
        self.methods = tuple(self.methods)
        if not self.methods:
            raise ValueError(f"--methods names no method; give one or more of {list(METHODS)}, comma-separated")
        for name in ("seeds", "steps", "prompts_per_step", "eval_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if isinstance(self.generations, bool) or not isinstance(self.generations, int) or self.generations < 2:
            raise ValueError(f"--generations must be >= 2 (a group needs several responses), got {self.generations!r}")
        _finite("lr", self.lr, above=0.0)
        if self.train_pool is not None and (isinstance(self.train_pool, bool) or not isinstance(self.train_pool, int)
                                            or self.train_pool < 1):
            raise ValueError(f"--train-pool must be unset or an integer >= 1, got {self.train_pool!r}")
        if self.latency_ms is None:
            self.latency_ms = float(getattr(task, "default_latency_ms", 0.0))
        _finite("latency-ms", self.latency_ms, at_least=0.0)
        if "selector" in self.replay:
            raise ValueError("--replay.selector: each method sets its own selector; choose methods with --methods "
                             f"(e.g. --methods headroom_drift,drift_only; valid: {list(METHODS)})")
        if "tau" in self.replay:
            _finite("replay.tau", self.replay["tau"], at_least=0.0)
        if self.replay.get("ingress") == "answer" and self.replay.get("answer_threshold") is None:
            if task.answer_threshold is None:
                raise ValueError(f"--ingress answer needs --answer-threshold (task {task.name} has no default)")
            self.replay["answer_threshold"] = task.answer_threshold
        for m in get_methods(self.methods):  # names the valid methods; checks b against each method's budget
            self.replay_config(m)

    def replay_config(self, method: Method) -> dict:
        """Every replay setting of ``method``'s runs (validated; refusals name the --replay.<knob> option)."""
        b = self.prompts_per_step
        method.fresh_groups(b)
        k_rep = method.replay_groups(b)  # both refuse a b that makes b/2 or 1.5b fractional
        r = self.replay.get("k_rep")
        if method.replay_mult and r is not None:
            k_rep = round(2 * method.replay_mult * r) if isinstance(r, int) and not isinstance(r, bool) else r
        values = {"tau": SANDBOX_TAU, "capacity": 4 * b, **dict(method.replay), **self.replay,
                  "selector": method.selector, "k_rep": k_rep, "group_size": self.generations}
        try:
            cfg = ReplayConfig.from_flat(values, label=lambda n: f"--replay.{n}")
        except ReplayConfigError as e:
            raise ValueError(f"{e} (method {method.name})" if method.replay_mult else str(e)) from None
        return {k: v for k, v in cfg.to_dict().items() if k != "group_size"}

    def spec(self, method: str, seed: int) -> RunSpec:
        return RunSpec(task=self.task, method=method, seed=seed, steps=self.steps,
                       prompts_per_step=self.prompts_per_step, generations=self.generations, lr=self.lr,
                       eval_n=self.eval_n, replay=self.replay_config(METHODS[method]),
                       extra={**self.extra, "latency_s": self.latency_ms / 1000.0,
                              **({"train_pool": self.train_pool} if self.train_pool is not None else {})})


def _finite(name: str, v, *, above: float | None = None, at_least: float | None = None) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (above is None or v > above) and (at_least is None or v >= at_least)
    if not ok:
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise ValueError(f"--{name} must be a finite number {bound}, got {v!r}")


def check_out_dir(out: Path, cfg: CompareConfig, overwrite: bool) -> bool:
    """Refuse (FileExistsError) a path that is a file, or a directory holding something else than this comparison
    unless ``overwrite``.  Returns whether a different comparison's outputs must be cleared.  Writes nothing."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; --out takes a directory (new, or one this command wrote)")
    if not out.exists() or not any(out.iterdir()):
        return False
    try:
        have = json.loads((out / "compare.json").read_text())
    except (OSError, json.JSONDecodeError):
        have = None
    if have is None and not overwrite:
        raise FileExistsError(f"{out} exists and is not an hdreplay comparison directory; choose another --out or "
                              "pass --overwrite")
    want = _marker(cfg)
    if have is not None and have != want and not overwrite:
        diff = sorted(k for k in set(have.get("config", {})) | set(want["config"])
                      if have.get("config", {}).get(k) != want["config"].get(k))
        raise FileExistsError(f"{out} holds a different comparison (differs in {diff}); choose another --out or pass "
                              "--overwrite to replace it")
    return have is not None and have != want


def _marker(cfg: CompareConfig) -> dict:
    return json.loads(json.dumps({"format": FORMAT, "config": asdict(cfg)}))  # as stored (tuples -> lists)


def check_compare(cfg: CompareConfig, out: Path, overwrite: bool) -> Path | None:
    """Everything about ``out`` and ``cfg.model`` that can be refused before anything is written; returns the
    model directory (None: the warm-started tiny model)."""
    model_dir = None if cfg.model is None else check_model(Path(cfg.model))
    check_out_dir(out, cfg, overwrite)
    return model_dir


def prepare_out_dir(out: Path, cfg: CompareConfig, overwrite: bool) -> None:
    """:func:`check_out_dir`, then clear a different comparison's outputs (never anything else) and mark ``out``."""
    if check_out_dir(out, cfg, overwrite):
        for sub in ("runs", "plots"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("summary.md", "summary.json"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(_marker(cfg), indent=2))


def run_compare(cfg: CompareConfig, out: Path, *, overwrite: bool = False, log=print, progress: bool = True,
                model_dir: Path | None = None) -> dict:
    """Run every method x seed (reusing finished runs of the same comparison) and write the summary.  ``model_dir``:
    what :func:`check_compare` returned, when the caller ran it; else it runs here."""
    from .model import load_model  # noqa: F401  (fail early if transformers is missing)
    from .runner import run_one
    from .warmstart import warm_start

    out = Path(out)
    if model_dir is None:
        model_dir = check_compare(cfg, out, overwrite)  # before anything is written
    prepare_out_dir(out, cfg, overwrite)
    task = get_task(cfg.task)
    methods = get_methods(cfg.methods)
    if model_dir is None:
        log("warm start (cached after the first run) ...")
        model_dir = warm_start(task, out / "warmstart", log=log)
    total = sum(cfg.steps for _ in methods for _ in range(cfg.seeds))
    bar = _bar(total, progress)
    t0 = time.perf_counter()
    try:
        for m in methods:
            for seed in range(cfg.seeds):
                run_dir = out / "runs" / m.name / f"seed{seed}"
                if (run_dir / "metrics.json").is_file():
                    bar.update(cfg.steps)
                    continue
                bar.set_description(f"{m.name} seed {seed}")
                shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run of this comparison
                run_one(cfg.spec(m.name, seed), m, task, model_dir, run_dir, on_step=bar.update)
    finally:
        bar.close()
    summary = summarize(out, cfg, methods, task)
    summary["wall_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(render_markdown(summary))
    # relative to the comparison directory, so the summary stays valid when the directory is moved or shared
    summary["plots"] = [str(Path(p).relative_to(out)) for p in plot(out, summary, methods)]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def check_model(path: Path) -> Path:
    """``path`` if it loads as a causal LM; ValueError naming --model otherwise."""
    from .model import load_model

    try:
        load_model(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {path}: not a loadable causal-LM checkpoint ({e})") from e
    return path


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=not enabled, dynamic_ncols=True)


def _stats(xs) -> dict:
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0, "n": int(a.size)}


def summarize(out: Path, cfg: CompareConfig, methods: list[Method], task: Task) -> dict:
    res = {"format": FORMAT, "config": asdict(cfg), "task": task.name, "n": cfg.eval_n,
           "multiturn": bool(getattr(task, "is_multiturn", False)),
           "benchmarks": {b.name: b.size for b in task.benchmarks}, "methods": {}}
    for m in methods:
        runs = [json.loads((out / "runs" / m.name / f"seed{s}" / "metrics.json").read_text())
                for s in range(cfg.seeds)]
        entry = {"label": m.label, "seeds": len(runs), "benchmarks": {}}
        for b in task.benchmarks:
            entry["benchmarks"][b.name] = {
                "mean_at_n": _stats(r["benchmarks"][b.name]["mean_at_n"] for r in runs),
                "best_at_n": _stats(r["benchmarks"][b.name]["best_at_n"] for r in runs),
            }
        for k in ("macro_mean_at_n", "macro_best_at_n", "weighted_mean_at_n", "weighted_best_at_n",
                  "mean_step_s", "train_wall_s", "final_train_reward", "env_calls_per_step"):
            entry[k] = _stats(r[k] for r in runs)
        for k in ("fresh_responses", "rescored_rows", "replayed_rows", "replayed_groups"):
            entry[k] = _stats(r.get(k) for r in runs)  # runs written before these costs existed: n/a
        entry["env_latency_ms"] = runs[0].get("env_latency_ms", 0.0)
        res["methods"][m.name] = entry
    return res


def _cell(best: dict, mean: dict) -> str:
    f = lambda s: "n/a" if s["mean"] is None else (f"{s['mean']:.3f}" + (f"±{s['std']:.3f}" if s["n"] > 1 else ""))  # noqa: E731
    return f"{f(best)} / {f(mean)}"


def _count(s: dict) -> str:
    """A per-run count, seed mean (and its spread when seeds differ, e.g. dynamic sampling's generations)."""
    if s["mean"] is None:
        return "n/a"
    return f"{s['mean']:,.0f}" + (f" ± {s['std']:,.0f}" if s["n"] > 1 and s["std"] else "")


def render_markdown(summary: dict) -> str:
    """summary.md: the paper-style table (methods as columns), and for multi-turn tasks the step-time table."""
    from ..analysis.markdown import table

    ms = summary["methods"]
    names, n = list(ms), summary["n"]
    seeds = max(e["seeds"] for e in ms.values())
    f = lambda s: "n/a" if s["mean"] is None else f"{s['mean']:.3f}"  # noqa: E731
    cells = lambda fn: [fn(ms[k]) for k in names]  # noqa: E731
    rows = [[f"{b} (n={size})", *cells(lambda e: _cell(e["benchmarks"][b]["best_at_n"], e["benchmarks"][b]["mean_at_n"]))]
            for b, size in summary["benchmarks"].items()]
    rows += [["Macro Avg", *cells(lambda e: _cell(e["macro_best_at_n"], e["macro_mean_at_n"]))],
             ["Weighted Avg", *cells(lambda e: _cell(e["weighted_best_at_n"], e["weighted_mean_at_n"]))],
             ["Fresh responses generated", *cells(lambda e: _count(e["fresh_responses"]))],
             ["Rows re-scored to select", *cells(lambda e: _count(e["rescored_rows"]))],
             ["Groups replayed", *cells(lambda e: _count(e["replayed_groups"]))],
             ["Train wall-clock (s)", *cells(lambda e: f(e["train_wall_s"]))],
             ["Step time (s)", *cells(lambda e: f(e["mean_step_s"]))]]
    lines = [f"# hdreplay compare: task `{summary['task']}`", "", f"Each cell: Best@{n} / Mean@{n} on the held-out "
             "benchmark" + (f", mean ± standard deviation over {seeds} seeds." if seeds > 1 else f", {seeds} seed.") +
             " Costs are per run (seed mean): fresh responses generated (dynamic sampling's discarded ones "
             "included), stored responses forwarded under the current policy to select replay, groups replayed "
             "(single-rollout replay: rows / n), training wall-clock.",
             "", table(["Metric", *(ms[k]["label"] for k in names)], rows)]
    if summary.get("multiturn"):
        fastest = sorted(names, key=lambda k: ms[k]["mean_step_s"]["mean"] or 0)
        lines += [f"Mean per-step wall-clock time (environment latency {ms[names[0]]['env_latency_ms']:g} ms per tool "
                  "call), fastest first, like the paper's step-time table:", "", table(
                      ["Method", "Step time (s)", "Tool calls / step", "Fresh responses", "Macro Mean@n", "Macro Best@n"],
                      [[e["label"], f(e["mean_step_s"]), f"{e['env_calls_per_step']['mean']:.1f}",
                        _count(e["fresh_responses"]), f(e["macro_mean_at_n"]), f(e["macro_best_at_n"])]
                       for e in (ms[k] for k in fastest)])]
    return "\n".join([*lines, _ordering_note(summary, seeds)]) + "\n"


def _ordering_note(summary: dict, seeds: int) -> str:
    ms = summary["methods"]
    order = sorted(ms, key=lambda k: -(ms[k]["macro_mean_at_n"]["mean"] or -1))
    spread = max((ms[k]["macro_mean_at_n"]["std"] or 0.0) for k in ms)
    txt = "Ordering by macro Mean@n in this run: " + " > ".join(ms[k]["label"] for k in order) + "."
    if seeds == 1:
        return txt + (" With one seed this shows the methods running end to end; it does not show which "
                      "method wins (rerun `hdreplay compare` with several seeds for a spread).")
    return txt + f" Largest seed standard deviation of macro Mean@n: {spread:.3f}; differences smaller than that are noise."


def plot(out: Path, summary: dict, methods: list[Method], window: int = 15) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    curves = {}
    for m in methods:
        steps, walls, scores = [], [], []
        for s in range(summary["methods"][m.name]["seeds"]):
            recs = [json.loads(x) for x in open(out / "runs" / m.name / f"seed{s}" / "train_log.jsonl")]
            steps.append([r["step"] for r in recs])
            walls.append([r["wall_s"] for r in recs])
            scores.append([r.get("reward", np.nan) for r in recs])
        k = min(map(len, scores))
        curves[m.name] = (np.asarray(steps[0][:k]), np.mean([w[:k] for w in walls], axis=0),
                          np.mean([sc[:k] for sc in scores], axis=0))
    paths = []
    for xkey, fname, xlabel in ((0, "train_score_steps.png", "training step"),
                                (1, "train_score_wallclock.png", "wall-clock seconds")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for m in methods:
            x, y = curves[m.name][xkey], curves[m.name][2]
            ax.plot(x, y, alpha=0.2, lw=0.8)
            ax.plot(x, _running(y, window), lw=1.8, label=m.label, color=ax.lines[-1].get_color())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training score (mean reward)")
        ax.set_title(f"Training score, running average (window {window}), seed mean")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(pdir / fname, dpi=120)
        plt.close(fig)
        paths.append(str(pdir / fname))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [m.name for m in methods]
    means = [summary["methods"][k]["macro_mean_at_n"]["mean"] for k in names]
    stds = [summary["methods"][k]["macro_mean_at_n"]["std"] or 0.0 for k in names]
    ax.bar(range(len(names)), means, yerr=stds, capsize=4, color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(names)), [summary["methods"][k]["label"] for k in names], rotation=25, ha="right",
                  fontsize=8)
    ax.set_ylabel(f"held-out macro Mean@{summary['n']}")
    ax.set_title("Held-out Mean@n per method (error bar: seed standard deviation)")
    fig.tight_layout()
    fig.savefig(pdir / "heldout_mean.png", dpi=120)
    plt.close(fig)
    paths.append(str(pdir / "heldout_mean.png"))
    return paths


def _running(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over the last ``w`` points, missing (NaN) points skipped."""
    import pandas as pd

    return pd.Series(y, dtype=float).rolling(w, min_periods=1).mean().to_numpy()
