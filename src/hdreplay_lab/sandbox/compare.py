"""``hdreplay compare`` / ``hdreplay demo``: the paper's role-aligned comparison at small scale.

Output directory layout:
    compare.json                 the comparison's settings (a different run refuses to reuse the dir)
    runs/<method>/seed<k>/       one run directory each (see runner.py)
    summary.md, summary.json     tables and numbers (summary.py): held-out Best@n / Mean@n, the regime
                                 (zero-variance share, acceptance, generation share), paired differences
                                 against Headroom-Drift with bootstrap intervals, efficiency curves
    plots/*.png                  figures (plots.py)

The warm start is cached once per settings hash in the shared cache directory
(:func:`hdreplay_lab.sandbox.warmstart.default_cache_dir`), reused by demo, compare and calibrate.

Paired design: every method of a comparison starts from the same warm start and, per seed, sees the same
prompt order (runner.py).  Runs are independent processes of ``workers`` at a time, one torch thread each
(env.py), and resumable per (method, seed): a run counts as done when its metrics.json is complete
(written atomically, last); anything else in its directory is removed and the run redone.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .methods import get_methods
from .runner import RunSpec, is_finished
from .tasks import get_task

FORMAT = "hdreplay.compare"


@dataclass
class CompareConfig:
    task: str = "mix"
    methods: tuple[str, ...] = ()
    seeds: int = 5
    steps: int = 120
    prompts_per_step: int = 16
    generations: int = 8
    lr: float = 1e-4
    tau: float = 1e-2
    capacity: int | None = None  # None = the task's buffer_steps x prompts_per_step (see __post_init__)
    eval_n: int = 8
    ingress: str = "mixed"
    answer_threshold: float | None = None
    model: str | None = None  # a local causal-LM checkpoint; None = the warm-started tiny model
    latency_ms: float | None = None  # per tool call (search task); None = the task's default
    #: modelled rollout cost (a sleep per generated token at TRL's generation seam) used while training
    rollout_ms_per_token: float = 0.0
    #: the per-token cost of the summary's modelled wall-clock column (computed, not slept); None = the
    #: smallest cost that makes generation 2/3 of on-policy b's measured step (regime.cost_for_share)
    modelled_ms_per_token: float | None = None
    #: held-out curve every k steps on the first curve_prompts prompts per benchmark, curve_n samples each
    eval_every: int = 20
    curve_prompts: int = 30
    curve_n: int = 4
    #: accuracy for "cost to reach"; None = the final seed-mean curve value of on-policy b
    target: float | None = None
    #: parallel runs (one process each, one torch thread each); None = 2 on a machine with >= 2 cores
    workers: int | None = None
    #: also run the mechanism-signature runs (seed 0 of Headroom-Drift at tau / 10 and tau x 10, one with the
    #: same-buffer counterfactual, hdr_l1 and hdr_advantage unless in methods) and write signatures.md
    signatures: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        task = get_task(self.task)  # names the valid tasks
        if self.capacity is None:
            # The buffer should hold a few steps of *admitted* groups, as in the paper (512 groups at b = 256
            # and b = 128). Tasks whose fresh groups are mostly mixed use 4 b; the difficulty mixture, whose
            # groups are half zero-variance, 2 b.
            per_b = getattr(task, "capacity_per_b", 4)
            self.capacity = per_b * self.prompts_per_step if isinstance(self.prompts_per_step, int) else 64
        if self.workers is None:
            self.workers = min(2, os.cpu_count() or 1)
        methods = get_methods(self.methods)  # names the valid methods
        for m in methods:
            m.fresh_groups(self.prompts_per_step)
            m.replay_groups(self.prompts_per_step)
        for name in ("seeds", "steps", "prompts_per_step", "eval_n", "capacity", "curve_prompts", "curve_n",
                     "workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"--eval-every must be an integer >= 0 (0 = no curve), got {self.eval_every!r}")
        if not isinstance(self.generations, int) or self.generations < 2:
            raise ValueError(f"--generations must be >= 2 (a group needs several responses), got {self.generations!r}")
        if not (self.tau >= 0):
            raise ValueError(f"--tau must be >= 0, got {self.tau!r}")
        for name in ("rollout_ms_per_token", "modelled_ms_per_token"):
            if getattr(self, name) is not None and not (getattr(self, name) >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 milliseconds, got {getattr(self, name)!r}")
        if self.target is not None and not (0 < self.target <= 1):
            raise ValueError(f"--target must be a Mean@n in (0, 1], got {self.target!r}")
        if self.ingress == "answer" and self.answer_threshold is None:
            self.answer_threshold = task.answer_threshold
            if self.answer_threshold is None:
                raise ValueError(f"--ingress answer needs --answer-threshold (task {task.name} has no default)")
        if self.ingress not in ("mixed", "answer"):
            raise ValueError(f"--ingress must be 'mixed' or 'answer', got {self.ingress!r}")
        if self.latency_ms is None:
            self.latency_ms = float(getattr(task, "default_latency_ms", 0.0))
        if not (self.latency_ms >= 0):
            raise ValueError(f"--latency-ms must be >= 0, got {self.latency_ms!r}")

    def signature_runs(self) -> dict[str, RunSpec]:
        """label -> spec of the extra signature runs (all Headroom-Drift, seed 0; see ``signatures``)."""
        if not self.signatures:
            return {}
        out = {}
        for t in (self.tau / 10, self.tau * 10):
            out[f"tau={t:g}"] = replace(self.spec("headroom_drift", 0), tau=t)
        out["counterfactual"] = replace(self.spec("headroom_drift", 0), counterfactual=True)
        for name in ("hdr_l1", "hdr_advantage"):
            if name not in self.methods:  # already paired over every seed when named in --methods
                out[name] = self.spec(name, 0)
        return out

    def spec(self, method: str, seed: int) -> RunSpec:
        m = get_methods([method])[0]
        return RunSpec(task=self.task, method=method, seed=seed, steps=self.steps,
                       prompts_per_step=self.prompts_per_step, generations=self.generations, lr=self.lr,
                       tau=self.tau * m.tau_scale, capacity=self.capacity, eval_n=self.eval_n, ingress=self.ingress,
                       answer_threshold=self.answer_threshold, rollout_ms_per_token=self.rollout_ms_per_token,
                       eval_every=self.eval_every, curve_prompts=self.curve_prompts, curve_n=self.curve_n,
                       # recency replay re-scores what it picks, so gated and ungated replay KL can be compared
                       diagnose_ungated=m.selector == "recency",
                       extra={**self.extra, "latency_s": self.latency_ms / 1000.0})


#: settings that change no finished run (how many run at once, how many seeds / which methods / signature runs
#: there are, what the summary computes): a comparison continued with other values keeps its finished runs
RUN_NEUTRAL = ("workers", "modelled_ms_per_token", "target", "seeds", "methods", "signatures")


def _stored(cfg: CompareConfig) -> dict:
    return json.loads(json.dumps({"format": FORMAT, "config": asdict(cfg)}))  # as stored (tuples -> lists)


def _identity(stored: dict) -> dict:
    """What must match for finished runs to be reused: everything but :data:`RUN_NEUTRAL`."""
    return {**stored, "config": {k: v for k, v in stored.get("config", {}).items() if k not in RUN_NEUTRAL}}


def prepare_out_dir(out: Path, cfg: CompareConfig, overwrite: bool) -> None:
    """Refuse a directory holding a different run unless ``overwrite``; never delete anything else."""
    marker = out / "compare.json"
    stored = _stored(cfg)
    want = _identity(stored)
    if out.exists() and any(out.iterdir()):
        if not marker.is_file():
            if not overwrite:
                raise FileExistsError(f"{out} exists and is not an hdreplay comparison directory; choose another "
                                      "--out or pass --overwrite")
        else:
            have = _identity(json.loads(marker.read_text()))
            if have != want and not overwrite:
                diff = sorted(k for k in set(have.get("config", {})) | set(want["config"])
                              if have.get("config", {}).get(k) != want["config"].get(k))
                raise FileExistsError(f"{out} holds a different comparison (differs in {diff}); choose another "
                                      "--out or pass --overwrite to replace it")
            if have != want and overwrite:
                for sub in ("runs", "plots"):
                    shutil.rmtree(out / sub, ignore_errors=True)
                for f in ("summary.md", "summary.json"):
                    (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(stored, indent=2))


def run_compare(cfg: CompareConfig, out: Path, *, overwrite: bool = False, log=print, progress: bool = True,
                demo: bool = False) -> dict:
    """Run every method x seed not finished yet (``cfg.workers`` at a time) and write the summary."""
    from .model import load_model  # noqa: F401  (fail early if transformers is missing)
    from .summary import write_summary
    from .warmstart import warm_start

    out = Path(out)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    prepare_out_dir(out, cfg, overwrite)
    task = get_task(cfg.task)
    methods = get_methods(cfg.methods)
    if cfg.model is not None:
        check_model(Path(cfg.model))
        model_dir = Path(cfg.model)
    else:
        log("warm start (cached once per settings in the shared cache directory) ...")
        model_dir = warm_start(task, log=log)
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
    from .pool import run_jobs

    run_jobs(cfg, jobs, model_dir, total_steps=cfg.steps * (len(jobs) + done), done_steps=cfg.steps * done,
             progress=progress)
    env = {"wall_s": time.perf_counter() - t0, "runs_trained": len(jobs), "runs_reused": done,
           "workers": cfg.workers, "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
           "cpus": os.cpu_count(), "model": str(model_dir)}
    summary = write_summary(out, cfg, methods, task, env=env, demo=demo)
    if cfg.signatures:
        from .signatures import write_signatures

        summary["signatures"] = write_signatures(out, cfg, summary)
    return summary


def check_model(path: Path) -> None:
    from .model import load_model

    try:
        load_model(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {path}: not a loadable causal-LM checkpoint ({e})") from e
