"""One run of the policy-lag sandbox: one method, one seed, a fixed number of generated groups.

The run is a discrete-event simulation over the modelled clock (:mod:`.pipeline`) with real sampling and
training of the tiny model: a group is sampled with the weights of the version it is dispatched at, arrives
after its modelled duration, and is routed by the method when a step takes it (oldest arrival first).  Within a
step, arrivals before the step ends dispatch new groups with the pre-update weights.  The run ends when every
generated group has arrived and been routed (the last step may be short).

Run directory: ``run.json`` (settings), ``pipeline.jsonl`` (per step: version, modelled time, groups trained),
``async.jsonl`` (the staleness ledger, :mod:`hdreplay.staleness.ledger`, for every method), ``replay/`` (the gated
methods' replay diagnostics), ``metrics.json`` (held-out Mean@n per prompt, the ledger's totals, lags, lengths, modelled
wall-clock; written last and atomically).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hdreplay import ReplayConfig, ReplayController
from hdreplay.checkpoint.atomic import atomic_write_text
from hdreplay.staleness import LEDGER_FILE, AsyncReplay, StalenessConfig, StalenessLedger

from ...env import configure_threads, offline_env
from ..tasks import get_task
from .learner import Sampler, policy_loss, scorer
from .methods import AsyncMethod
from .pipeline import Pipeline, PipelineConfig

METRICS_FORMAT = "hdreplay.lag.metrics/1"


@dataclass
class LagRunSpec:
    task: str
    method: str
    seed: int
    groups: int = 1280  # generated groups (the equal budget)
    prompts_per_step: int = 8  # b
    generations: int = 8  # n
    lr: float = 1e-4
    tau: float = 1e-2
    capacity_per_b: int = 8
    pool: int = 8  # prompts sampled at once by the sampler
    eval_n: int = 4
    pipeline: dict = field(default_factory=dict)


def _ledger_step(ledger: StalenessLedger, path: Path, step: int) -> None:
    rec = ledger.close_step(step)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def run_lag(spec: LagRunSpec, method: AsyncMethod, model_dir: Path, run_dir: Path, log=None) -> dict:
    """Train and evaluate one run; returns (and writes) metrics.json's content."""
    offline_env()
    threads = configure_threads()
    from ..evaluate import evaluate
    from ..model import load_model

    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("pipeline.jsonl", LEDGER_FILE):
        (run_dir / name).unlink(missing_ok=True)
    atomic_write_text(run_dir / "run.json", json.dumps({**asdict(spec), "label": method.label,
                                                        "model": str(model_dir), "torch_threads": threads}, indent=2))
    torch.manual_seed(spec.seed)
    task = get_task(spec.task)
    model, tok = load_model(model_dir)
    model.train()
    pcfg = PipelineConfig(**spec.pipeline)
    b, n = spec.prompts_per_step, spec.generations
    problems = task.train_problems(spec.groups + spec.pool * 64, seed=spec.seed)
    width = max(len(p.answer) for p in problems) + 2
    sampler = Sampler(model, tok, task, problems, n=n, width=width, pool=spec.pool, seed=spec.seed)
    pipe = Pipeline(pcfg, budget=spec.groups, rng=np.random.default_rng(spec.seed),
                    throttle=method.throttle, groups_per_step=b)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    score = scorer(model, tok.pad_token_id)
    gated = method.kind == "gated"
    areplay = ledger = None
    if gated:
        k = method.k_rep(b)
        ctrl = ReplayController(ReplayConfig(k_rep=k, tau=spec.tau, capacity=spec.capacity_per_b * b,
                                             max_scan=2 * k, group_size=n), diagnostics_dir=run_dir / "replay")
        areplay = AsyncReplay(ctrl, StalenessConfig(fresh_bound=method.bound, ingest_fresh=method.ingest_fresh),
                              diagnostics_dir=run_dir)
    else:
        ledger = StalenessLedger()
    t, version, arrived = 0.0, 0, deque()
    lags: list[int] = []

    def fill(now: float) -> None:
        while pipe.can_dispatch(version):
            g, longest = sampler.next_group(version)
            pipe.dispatch(now, g, longest)

    def arrive() -> float:
        ta, g = pipe.pop()
        arrived.append(g)
        fill(ta)
        return ta

    def usable(g) -> bool:
        k = version - g.birth_step
        return method.kind in ("wait", "keep") or k <= method.bound

    fill(0.0)
    wall0 = time.perf_counter()
    while True:
        while sum(map(usable, arrived)) < b and pipe.inflight:
            t = max(t, arrive())
        if not arrived and pipe.exhausted:
            break
        fresh = []
        while arrived and len(fresh) < b:
            g = arrived.popleft()
            k = version - g.birth_step
            lags.append(k)
            if gated:
                if areplay.offer(g, step=version) == "fresh":
                    fresh.append(g)
            else:
                keep = usable(g)
                ledger.on_route("fresh" if keep else "drop", g, age=k, mixed=bool(g.rewards.unique().numel() > 1))
                if keep:
                    fresh.append(g)
        replay, rescored = [], 0
        if gated:
            sel = areplay.select(step=version, scorer=score)
            replay, rescored = list(sel.groups), len(sel.scanned) + sel.scored_unused
        batch = replay + fresh
        t_end = t + pcfg.step_ms(len(batch), rescored)
        while pipe.inflight and pipe.next_time() <= t_end:  # these dispatch with the pre-update weights
            arrive()
        if batch:
            loss, drifts, tokens = policy_loss(model, batch, kind=method.loss, pad_token_id=tok.pad_token_id,
                                               is_cap=method.is_cap)
            optim.zero_grad()
            loss.backward()
            optim.step()
            at0 = [i for i, g in enumerate(batch) if g in fresh and g.birth_step == version]
            if gated:
                areplay.observe_floor([drifts[i] for i in at0], [tokens[i] for i in at0])
        if gated:
            areplay.commit(num_fresh_groups=len(fresh))
        else:
            _ledger_step(ledger, run_dir / LEDGER_FILE, version)
        with open(run_dir / "pipeline.jsonl", "a") as f:
            f.write(json.dumps({"step": version, "t_ms": t_end, "fresh": len(fresh), "replay": len(replay),
                                "rescored": rescored, "arrived_waiting": len(arrived)}) + "\n")
        version += 1
        t = t_end
        fill(t)
        if log is not None and version % 20 == 0:
            log(f"  {method.name} seed {spec.seed}: step {version}, {pipe.dispatched}/{spec.groups} generated")
    train_s = time.perf_counter() - wall0
    ev = evaluate(model, tok, task, n=spec.eval_n, seed=10_000 + spec.seed, per_prompt=True)
    led = areplay.ledger if gated else ledger
    records = [json.loads(line) for line in open(run_dir / LEDGER_FILE)]
    metrics = {**ev, "format": METRICS_FORMAT, "method": method.name, "seed": spec.seed, "steps": version,
               "wall_clock_ms": t, "train_cpu_s": train_s, "totals": dict(led.totals),
               "lags": np.bincount(np.asarray(lags, dtype=np.int64)).tolist() if lags else [],
               "lengths": _length_hists(records), "floor": None if not gated else areplay.floor.value,
               "floor_ready": None if not gated else areplay.floor.ready,
               "buffered_diverted_at_end": 0 if not gated else len(areplay.tracked)}
    atomic_write_text(run_dir / "metrics.json", json.dumps(metrics, indent=2))
    return metrics


def _length_hists(records: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {"trained": {}, "discarded": {}}
    for rec in records:
        for kind, hist in rec["lengths"].items():
            for length, c in hist.items():
                out[kind][length] = out[kind].get(length, 0) + c
    return out


def is_finished(run_dir: Path) -> bool:
    try:
        return json.loads((Path(run_dir) / "metrics.json").read_text()).get("format") == METRICS_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
