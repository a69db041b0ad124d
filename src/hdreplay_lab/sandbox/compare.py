"""``hdreplay compare`` / ``hdreplay demo``: the paper's role-aligned comparison at small scale.

Output directory layout:
    compare.json                 the comparison's settings (a different run refuses to reuse the dir)
    runs/<method>/seed<k>/       one run directory each (see runner.py)
    signatures/<label>/          the extra mechanism-signature runs (``--signatures``), signatures/tau_sweep/
    summary.md, summary.json     tables and numbers (summary.py): held-out Best@n / Mean@n, the regime
                                 (zero-variance share, acceptance, generation share), paired differences
                                 against Headroom-Drift with bootstrap intervals, efficiency curves
    signatures.md, .json         the paper's mechanism signatures, one verdict each (signatures.py)
    plots/*.png                  figures (plots.py, signature_plots.py)

The warm start is cached once per settings hash in the shared cache directory
(:func:`hdreplay_lab.sandbox.warmstart.default_cache_dir`), reused by demo, compare and calibrate.

Paired design: every method of a comparison starts from the same warm start and, per seed, sees the same
prompt order (runner.py).  Runs are independent processes of ``workers`` at a time, one torch thread each
(env.py), and resumable per (method, seed): a run counts as done when its metrics.json is complete
(written atomically, last); anything else in its directory is removed and the run redone.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Literal

from tyro.conf import Suppress, arg

from hdreplay.config import ReplayConfig
from hdreplay.diagnostics import DiagnosticsConfig, observers
from hdreplay.errors import ReplayConfigError

from ..flags import CommaFloat, CommaStr, ReplayOptions
from .methods import (
    COMPARE_METHODS,
    GEO_METHODS,
    METHODS,
    SEARCH_METHODS,
    STRATEGY_METHODS,
    Method,
    get_methods,
)
from .runner import RunSpec, is_finished
from .tasks import TASKS, get_task

FORMAT = "hdreplay.compare"
#: the sandbox's replay defaults where they differ from ReplayConfig's (tau: 1e-2 suits this tiny model's
#: step-to-step drift; capacity: a few steps of admitted groups, the task's ``capacity_per_b`` x b, as the
#: paper's 512 groups at b = 128..256)
SANDBOX_TAU = 1e-2
#: per-call environment latencies (ms) of the search task's modelled step-time table (issue 31)
DEFAULT_LATENCIES_MS = (0.0, 50.0, 200.0, 1000.0)

#: the --methods option (a type, so that the demo's and calibration's configs can give it other defaults)
Methods = Annotated[CommaStr, arg(help=(
    f"comma-separated methods from {list(METHODS)} (unset: {','.join(COMPARE_METHODS)}; with --task search: "
    f"{','.join(SEARCH_METHODS)}; with --task geo: {','.join(GEO_METHODS)}; the strategy comparison: "
    f"{','.join(STRATEGY_METHODS)})"))]


@dataclass
class CompareConfig:
    """The paper's role-aligned comparison at small scale: every method x seed trained on one sandbox task from the
    same warm start and prompt order, then evaluated on its held-out benchmarks."""

    task: Literal[tuple(TASKS)] = "mix"  # type: ignore[valid-type]
    """sandbox task"""
    methods: Methods = None
    seeds: int = 19
    """seeds per method (>= 1; 19 gave 95 % half-widths 0.007-0.008 on the mix task, docs/results/fidelity)"""
    steps: int = 120
    """optimizer steps per run (>= 1)"""
    prompts_per_step: int = 16
    """b: fresh groups per step (even, so that b/2 and 1.5b are whole groups)"""
    generations: int = 8
    """n: responses per group (>= 2)"""
    lr: float = 1e-4
    """learning rate (finite, > 0)"""
    eval_n: int = 8
    """samples per held-out prompt (Mean@n / Best@n)"""
    model: str | None = None
    """local causal-LM checkpoint instead of the warm-started tiny model"""
    latency_ms: float | None = None
    ("search task: environment latency per tool call slept while training, ms (unset: the task's 5; a task without "
     "tools takes none); --tool-concurrency says how the calls of a step overlap")
    latencies_ms: CommaFloat = None
    ("search task: per-call latencies (ms) at which the summary models the step time and the wall-clock to target from "
     "the counted tool calls / turns and the measured CPU time, computed not slept (unset: 0,50,200,1000)")
    tool_concurrency: Literal["per_turn", "sequential"] = "per_turn"
    ("search task: how the tool calls of a step overlap, slept and modelled: per_turn = the calls of one turn of the "
     "tool loop in flight together across the batch, turns one after another (Search-R1 batches each turn's queries "
     "into one retriever request); sequential = every call waits for the previous one (TRL 1.16 runs sync tools so)")
    train_pool: int | None = None
    ("distinct training problems, cycled over epochs by every method (unset: twice the prompts a run visits, so no "
     "prompt repeats; RePO needs repeats)")
    rollout_ms_per_token: float = 0.0
    ("modelled rollout cost slept per generated token while training, ms (a sleep at TRL's generation seam; 0 = "
     "native CPU sampling)")
    modelled_ms_per_token: float | None = None
    ("per-token rollout cost (ms) of the summary's modelled wall-clock column, computed not slept (unset: the "
     "smallest cost that makes generation 2/3 of on-policy b's measured step)")
    eval_every: int = 20
    """held-out curve every k steps (0 = no curve)"""
    curve_prompts: int = 30
    """held-out prompts per benchmark for the curve"""
    curve_n: int = 4
    """samples per prompt for the curve"""
    target: float | None = None
    """Mean@n the cost-to-reach columns use (unset: on-policy b's final curve value)"""
    workers: int | None = None
    """runs in parallel, one process and one torch thread each (unset: 2 on >= 2 cores)"""
    signatures: bool = True
    ("also run the mechanism-signature runs (seed 0 of Headroom-Drift at tau / 10 and tau x 10, with the same-buffer "
     "counterfactual, hdr_l1 and hdr_advantage unless in --methods); signatures.md is written either way (outside "
     "the demo), the verdicts that need these runs saying so")
    replay: ReplayOptions = field(default_factory=dict)
    ("replay settings shared by the methods, one option per ReplayConfig knob (--replay.<name>, underscores or "
     "hyphens); each method sets its own selector, and k_rep = r sets the replay budget of the b + r methods (b + 2r "
     "ones get 2r); unset: r = b/2, tau = 1e-2, capacity = the task's capacity_per_b x b, the rest ReplayConfig's "
     "defaults")
    extra: Suppress[dict] = field(default_factory=dict)

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
        for name in ("seeds", "steps", "prompts_per_step", "eval_n", "curve_prompts", "curve_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if isinstance(self.generations, bool) or not isinstance(self.generations, int) or self.generations < 2:
            raise ValueError(f"--generations must be >= 2 (a group needs several responses), got {self.generations!r}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"--eval-every must be an integer >= 0 (0 = no curve), got {self.eval_every!r}")
        if self.workers is None:
            self.workers = min(2, os.cpu_count() or 1)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"--workers must be an integer >= 1, got {self.workers!r}")
        _finite("lr", self.lr, above=0.0)
        if self.train_pool is not None and (isinstance(self.train_pool, bool) or not isinstance(self.train_pool, int)
                                            or self.train_pool < 1):
            raise ValueError(f"--train-pool must be unset or an integer >= 1, got {self.train_pool!r}")
        _finite("rollout-ms-per-token", self.rollout_ms_per_token, at_least=0.0)
        if self.modelled_ms_per_token is not None:
            _finite("modelled-ms-per-token", self.modelled_ms_per_token, at_least=0.0)
        if self.target is not None and not (isinstance(self.target, (int, float)) and 0 < self.target <= 1):
            raise ValueError(f"--target must be a Mean@n in (0, 1], got {self.target!r}")
        tools = bool(getattr(task, "is_multiturn", False))
        if self.latency_ms is None:
            self.latency_ms = float(getattr(task, "default_latency_ms", 0.0))
        _finite("latency-ms", self.latency_ms, at_least=0.0)
        if self.latencies_ms is None:
            self.latencies_ms = DEFAULT_LATENCIES_MS if tools else ()
        self.latencies_ms = tuple(self.latencies_ms)
        for v in self.latencies_ms:
            _finite("latencies-ms", v, at_least=0.0)
        if not tools:  # 0 = no environment; the default of every task without tools
            given = [f"--{n} {v}" for n, v in (("latency-ms", self.latency_ms if self.latency_ms else None),
                                               ("latencies-ms", ",".join(map(str, self.latencies_ms)) or None),
                                               ("tool-concurrency", None if self.tool_concurrency == "per_turn"
                                                else self.tool_concurrency)) if v is not None]
            if given:
                raise ValueError(f"{given[0].split()[0]}: task {task.name} calls no tools (only a multi-turn task "
                                 f"such as search has an environment latency); drop {given[0]}")
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
        """Every replay setting of ``method``'s runs (validated; refusals name the --replay.<knob> option).

        The method's own choices: selector and k_rep; Drift norm and Headroom weighting unless --replay.<knob> sets
        them; tau x its ``tau_scale``.  Recency replay also re-scores what it picks (``diagnose_ungated``, unless
        set), so gated and ungated replay KL compare."""
        b = self.prompts_per_step
        method.fresh_groups(b)
        k_rep = method.replay_groups(b)  # both refuse a b that makes b/2 or 1.5b fractional
        r = self.replay.get("k_rep")
        if method.replay_mult and r is not None:
            k_rep = round(2 * method.replay_mult * r) if isinstance(r, int) and not isinstance(r, bool) else r
        per_b = getattr(get_task(self.task), "capacity_per_b", 4)
        values = {"tau": SANDBOX_TAU, "capacity": per_b * b, "diagnose_ungated": method.selector == "recency",
                  **dict(method.replay), **self.replay, "selector": method.selector, "k_rep": k_rep,
                  "group_size": self.generations}
        if isinstance(values["tau"], (int, float)) and not isinstance(values["tau"], bool):
            values["tau"] = values["tau"] * method.tau_scale
        diag = {k: values.pop(k) for k in DiagnosticsConfig.field_names() if k in values}
        try:
            cfg = ReplayConfig.from_flat(values, label=lambda n: f"--replay.{n}")
            try:
                dcfg = DiagnosticsConfig(**diag)
                observers(dcfg, cfg)  # adaptive tau's bounds must hold tau
            except ReplayConfigError as e:
                raise ReplayConfigError(f"--replay.{e.field}: {e.message}", field=f"--replay.{e.field}") from None
        except ReplayConfigError as e:
            raise ValueError(f"{e} (method {method.name})" if method.replay_mult else str(e)) from None
        out = {k: v for k, v in cfg.to_dict().items() if k != "group_size"}
        return {**out, **asdict(dcfg)}  # (adaptive_tau: its fields as a dict, or None)

    @property
    def tau(self) -> float:
        return float(self.replay.get("tau", SANDBOX_TAU))

    def spec(self, method: str, seed: int) -> RunSpec:
        return RunSpec(task=self.task, method=method, seed=seed, steps=self.steps,
                       prompts_per_step=self.prompts_per_step, generations=self.generations, lr=self.lr,
                       eval_n=self.eval_n, replay=self.replay_config(METHODS[method]),
                       rollout_ms_per_token=self.rollout_ms_per_token, eval_every=self.eval_every,
                       curve_prompts=self.curve_prompts, curve_n=self.curve_n,
                       extra={**self.extra, "latency_s": self.latency_ms / 1000.0,
                              **({"tool_concurrency": self.tool_concurrency}
                                 if getattr(get_task(self.task), "is_multiturn", False) else {}),
                              **({"train_pool": self.train_pool} if self.train_pool is not None else {})})

    def signature_runs(self) -> dict[str, RunSpec]:
        """label -> spec of the extra signature runs (seed 0; see ``signatures``)."""
        if not self.signatures:
            return {}
        hdr = self.spec("headroom_drift", 0)
        out = {f"tau={t:g}": replace(hdr, replay={**hdr.replay, "tau": t}) for t in (self.tau / 10, self.tau * 10)}
        out["counterfactual"] = replace(hdr, replay={**hdr.replay, "counterfactual": True})
        for name in ("hdr_l1", "hdr_advantage"):
            if name not in self.methods:  # already paired over every seed when named in --methods
                out[name] = self.spec(name, 0)
        return out


def _finite(name: str, v, *, above: float | None = None, at_least: float | None = None) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (above is None or v > above) and (at_least is None or v >= at_least)
    if not ok:
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise ValueError(f"--{name} must be a finite number {bound}, got {v!r}")


#: settings that change no finished run (how many run at once, how many seeds / which methods / signature runs
#: there are, what the summary computes): a comparison continued with other values keeps its finished runs
RUN_NEUTRAL = ("workers", "modelled_ms_per_token", "target", "seeds", "methods", "signatures", "latencies_ms")


def _marker(cfg: CompareConfig) -> dict:
    return json.loads(json.dumps({"format": FORMAT, "config": asdict(cfg)}))  # as stored (tuples -> lists)


def _identity(marker: dict) -> dict:
    """What must match for finished runs to be reused: everything but :data:`RUN_NEUTRAL`.  A setting added to
    CompareConfig after the marker was written counts at its default (what those runs did)."""
    defaults = {f.name: f.default for f in fields(CompareConfig) if f.default is not MISSING}
    config = {**defaults, **marker.get("config", {})}
    return {**marker, "config": {k: v for k, v in config.items() if k not in RUN_NEUTRAL}}


def check_out_dir(out: Path, cfg: CompareConfig, overwrite: bool) -> bool:
    """Refuse (FileExistsError) a path that is a file, or a directory holding something else than this comparison
    unless ``overwrite``.  Returns whether a different comparison's outputs must be cleared.  Writes nothing."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; --out takes a directory (new, or one this command wrote)")
    if not out.exists() or not any(out.iterdir()):
        return False
    try:
        have = _identity(json.loads((out / "compare.json").read_text()))
    except (OSError, json.JSONDecodeError):
        have = None
    if have is None and not overwrite:
        raise FileExistsError(f"{out} exists and is not an hdreplay comparison directory; choose another --out or "
                              "pass --overwrite")
    want = _identity(_marker(cfg))
    if have is not None and have != want and not overwrite:
        diff = sorted(k for k in set(have.get("config", {})) | set(want["config"])
                      if have.get("config", {}).get(k) != want["config"].get(k))
        raise FileExistsError(f"{out} holds a different comparison (differs in {diff}); choose another --out or pass "
                              "--overwrite to replace it")
    return have is not None and have != want


def check_compare(cfg: CompareConfig, out: Path, overwrite: bool) -> Path | None:
    """Everything about ``out`` and ``cfg.model`` that can be refused before anything is written; returns the
    model directory (None: the warm-started tiny model)."""
    model_dir = None if cfg.model is None else check_model(Path(cfg.model))
    check_out_dir(out, cfg, overwrite)
    return model_dir


def prepare_out_dir(out: Path, cfg: CompareConfig, overwrite: bool) -> None:
    """:func:`check_out_dir`, then clear a different comparison's outputs (never anything else) and mark ``out``."""
    if check_out_dir(out, cfg, overwrite):
        for sub in ("runs", "signatures", "plots"):
            shutil.rmtree(out / sub, ignore_errors=True)
        for f in ("summary.md", "summary.json", "signatures.md", "signatures.json"):
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(_marker(cfg), indent=2))


def run_compare(cfg: CompareConfig, out: Path, *, overwrite: bool = False, log=print, progress: bool = True,
                model_dir: Path | None = None, demo: bool = False) -> dict:
    """Run every method x seed (and signature run) not finished yet, ``cfg.workers`` at a time, and write the
    summary.  ``model_dir``: what :func:`check_compare` returned, when the caller ran it; else it runs here."""
    from .model import load_model  # noqa: F401  (fail early if transformers is missing)
    from .pool import run_jobs
    from .summary import write_summary
    from .warmstart import check_regime, warm_start

    out = Path(out)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    if model_dir is None:
        model_dir = check_compare(cfg, out, overwrite)  # before anything is written
    prepare_out_dir(out, cfg, overwrite)
    task = get_task(cfg.task)
    methods = get_methods(cfg.methods)
    for m in methods:
        if cfg.train_pool is not None and cfg.train_pool % m.fresh_groups(cfg.prompts_per_step):
            log(f"warning: --train-pool {cfg.train_pool} is not a multiple of {m.name}'s "
                f"{m.fresh_groups(cfg.prompts_per_step)} prompts per step: TRL's sampler drops each epoch's "
                "incomplete last batch, so after the first epoch it reads the prompts in another order than the "
                "others (the summary's prompt-order check names it); a multiple of every method's prompts per step "
                "keeps the pairing")
    if model_dir is None:
        log("warm start (cached once per settings in the shared cache directory) ...")
        model_dir = warm_start(task, log=log)
    check_regime(task, model_dir, log=log)  # a setting that misses its asked regime stops here, before any run
    jobs, done = [], 0
    planned = [(cfg.spec(m.name, seed), out / "runs" / m.name / f"seed{seed}")
               for seed in range(cfg.seeds) for m in methods]  # seed-major: whole seeds of every method first
    planned += [(spec, out / "signatures" / label) for label, spec in cfg.signature_runs().items()]
    for spec, run_dir in planned:
        if is_finished(run_dir):
            done += 1
            continue
        shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run of this comparison
        jobs.append((spec, run_dir))
    if done:
        log(f"resuming: {done} finished run(s) kept, {len(jobs)} to run")
    run_jobs(cfg, jobs, model_dir, total_steps=cfg.steps * (len(jobs) + done), done_steps=cfg.steps * done,
             progress=progress)
    env = {"wall_s": time.perf_counter() - t0, "runs_trained": len(jobs), "runs_reused": done,
           "workers": cfg.workers, "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
           "cpus": os.cpu_count(), "model": str(model_dir)}
    summary = write_summary(out, cfg, methods, task, env=env, demo=demo)
    if cfg.signatures or not demo:  # without the signature runs, the verdicts that need them say "not run"
        from .signatures import write_signatures

        summary["signatures"] = write_signatures(out, cfg, summary)
    return summary


def check_model(path: Path) -> Path:
    """``path`` if it loads as a causal LM; ValueError naming --model otherwise."""
    from .model import load_model

    try:
        load_model(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {path}: not a loadable causal-LM checkpoint ({e})") from e
    return path
