"""``hdreplay compare-async``: every asynchronous method x seed at an equal number of generated groups.

Output directory: ``compare_async.json`` (settings; a directory holding another comparison is refused),
``runs/<method>/seed<k>/`` (:mod:`.run`), ``progress.log``, ``summary.md`` / ``summary.json`` and ``plots/*.png``
(:mod:`.summary`).  Resumable: a run whose metrics.json is complete is kept.  Runs are sequential, one torch
thread (the sandbox is meant to share a small machine).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated

from tyro.conf import arg

from hdreplay.checkpoint.atomic import atomic_write_text

from ...flags import CommaStr
from ..tasks import get_task
from .methods import ASYNC_METHODS, get_async_methods
from .pipeline import PipelineConfig
from .run import LagRunSpec, is_finished, run_lag

FORMAT = "hdreplay.compare_async"
#: the --methods option
AsyncMethods = Annotated[CommaStr, arg(help=f"comma-separated methods from {list(ASYNC_METHODS)}")]


def _int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")


@dataclass
class LagCompareConfig:
    """Asynchronous GRPO on the CPU sandbox with a modelled generation pipeline: age-drop, wait, keep-all with
    truncated IS and Drift-gated staleness, paired over seeds at an equal number of generated groups."""

    task: str = "mix"
    """sandbox task (single-turn text tasks: mix, add, arith, multi_reward)"""
    methods: AsyncMethods = tuple(ASYNC_METHODS)
    seeds: int = 8
    """seeds per method (>= 2; paired: the same prompt stream and pipeline noise per seed)"""
    groups: int = 1280
    """generated groups per run: the equal budget (>= prompts-per-step)"""
    prompts_per_step: int = 8
    """b: groups per step from the arrival queue (even: K_rep = b/2)"""
    generations: int = 8
    """n: responses per group (>= 2)"""
    lr: float = 1e-4
    """learning rate (AdamW)"""
    tau: float = 1e-2
    """Drift threshold of the gated methods (the sandbox's tau)"""
    capacity_per_b: int = 8
    """buffer capacity of the gated methods in units of b (>= 2)"""
    eval_n: int = 4
    """samples per held-out prompt (Mean@n)"""
    model: str | None = None
    """local causal-LM checkpoint instead of the warm-started tiny model"""
    slots: int = 16
    """groups generating at once (2 b: about two steps of groups in flight)"""
    gen_fixed_ms: float = PipelineConfig.gen_fixed_ms
    """modelled generation time per group, fixed part (ms)"""
    gen_ms_per_token: float = PipelineConfig.gen_ms_per_token
    """modelled generation time per token of a group's longest completion (ms)"""
    jitter_sigma: float = PipelineConfig.jitter_sigma
    """lognormal jitter of a group's generation time (sigma)"""
    train_fixed_ms: float = PipelineConfig.train_fixed_ms
    """modelled time of a training step, fixed part (ms)"""
    train_ms_per_group: float = PipelineConfig.train_ms_per_group
    """modelled training time per group (ms)"""
    rescore_ms_per_group: float = PipelineConfig.rescore_ms_per_group
    """modelled re-scoring time per scanned group (ms)"""

    def __post_init__(self) -> None:
        task = get_task(self.task)  # names the valid tasks
        if task.is_multiturn or getattr(task, "is_multimodal", False):
            raise ValueError(f"--task {self.task}: the policy-lag sandbox runs single-turn text tasks")
        self.methods = tuple(self.methods or ())
        get_async_methods(self.methods)
        if not self.methods:
            raise ValueError(f"--methods names no method; valid: {list(ASYNC_METHODS)}")
        _int("seeds", self.seeds, 2)
        _int("prompts_per_step", self.prompts_per_step, 2)
        _int("generations", self.generations, 2)
        _int("eval_n", self.eval_n, 1)
        _int("groups", self.groups, self.prompts_per_step)
        _int("capacity_per_b", self.capacity_per_b, 2)
        if self.prompts_per_step % 2:
            raise ValueError(f"--prompts-per-step must be even (K_rep = b/2), got {self.prompts_per_step}")
        for name in ("lr", "tau"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    name == "lr" and v == 0):
                raise ValueError(f"--{name} must be a finite number {'> 0' if name == 'lr' else '>= 0'}, got {v!r}")
        self.pipeline_config()

    def pipeline_config(self) -> PipelineConfig:
        return PipelineConfig(**{f.name: getattr(self, f.name) for f in fields(PipelineConfig)})

    def spec(self, method: str, seed: int) -> LagRunSpec:
        return LagRunSpec(task=self.task, method=method, seed=seed, groups=self.groups,
                          prompts_per_step=self.prompts_per_step, generations=self.generations, lr=self.lr,
                          tau=self.tau, capacity_per_b=self.capacity_per_b, eval_n=self.eval_n,
                          pipeline=asdict(self.pipeline_config()))


def _identity(cfg: LagCompareConfig) -> dict:
    d = asdict(cfg)
    for k in ("seeds", "methods"):
        d.pop(k)
    return d


def prepare(out: Path, cfg: LagCompareConfig, overwrite: bool) -> None:
    """Refuse (before anything is written) a directory holding another comparison unless ``overwrite``."""
    marker = out / "compare_async.json"
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; --out takes a directory")
    if marker.is_file():
        old = json.loads(marker.read_text())
        if old.get("identity") != _identity(cfg):
            if not overwrite:
                raise ValueError(f"{out} holds a different comparison ({marker}); pass --overwrite or another --out")
            shutil.rmtree(out / "runs", ignore_errors=True)
    elif out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not a compare-async directory; pass --overwrite or another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps({"format": FORMAT, "identity": _identity(cfg), "config": asdict(cfg)},
                                         indent=2))


def model_dir_for(cfg: LagCompareConfig, log=print) -> Path:
    if cfg.model is not None:
        p = Path(cfg.model)
        if not (p / "config.json").is_file():
            raise ValueError(f"--model {p}: no config.json; give a local causal-LM checkpoint directory")
        return p
    from ..warmstart import warm_start

    return warm_start(get_task(cfg.task), log=log)


def run_compare_async(cfg: LagCompareConfig, out: Path, *, overwrite: bool = False, log=print,
                      command: str | None = None) -> dict:
    """Run every (method, seed) not finished yet, then write the summary; returns summary.json's content."""
    from .summary import write_summary

    prepare(out, cfg, overwrite)
    logf = open(out / "progress.log", "a")

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        logf.write(line + "\n")
        logf.flush()
        log(line)

    model_dir = model_dir_for(cfg, log=say)
    todo = [(m, s) for s in range(cfg.seeds) for m in cfg.methods
            if not is_finished(out / "runs" / m / f"seed{s}")]
    say(f"{len(todo)} of {len(cfg.methods) * cfg.seeds} runs to do; model {model_dir}")
    t0 = time.perf_counter()
    for i, (m, s) in enumerate(todo):
        t = time.perf_counter()
        res = run_lag(cfg.spec(m, s), ASYNC_METHODS[m], model_dir, out / "runs" / m / f"seed{s}", log=None)
        el = time.perf_counter() - t0
        say(f"run {i + 1}/{len(todo)} {m} seed {s}: {time.perf_counter() - t:.0f} s, {res['steps']} steps, "
            f"Mean@n {res['macro_mean_at_n']:.3f}; eta {el / (i + 1) * (len(todo) - i - 1) / 60:.0f} min")
    summary = write_summary(out, cfg, command)
    say(f"summary: {out / 'summary.md'}")
    logf.close()
    return summary


@dataclass
class AsyncCompareArgs:
    """The policy-lag sandbox: asynchronous GRPO with a modelled generation pipeline; age-drop (max_staleness 1, 2,
    4), wait (AReaL-style throttle), keep-all with truncated IS, Drift-gated staleness (+ Headroom-Drift replay),
    paired over seeds at an equal number of generated groups."""

    config: Annotated[LagCompareConfig, arg(name="")]
    out: Path = Path("hdreplay_runs/compare_async")
    """output directory (a new one, or one this command wrote)"""
    overwrite: bool = False
    """replace an output directory holding a different comparison"""

    def check(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"--out {self.out} is a file; --out takes a directory")

    def run(self) -> int:
        import sys

        summary = run_compare_async(self.config, self.out, overwrite=self.overwrite,
                                    command=" ".join(["hdreplay", *sys.argv[1:]]))
        print(f"\n{(self.out / 'summary.md').read_text()}\nsummary: {self.out / 'summary.md'}")
        for p in summary["plots"]:
            print(f"plot:    {self.out / p}")
        return 0
