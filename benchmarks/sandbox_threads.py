"""Torch intra-op threads for the sandbox: step times with 1 and 2 threads, with and without a busy core.

    python benchmarks/sandbox_threads.py [--steps 25] [--out benchmarks/results/sandbox_threads.json]

Measures, each in a fresh subprocess (torch's thread pool is per process):
    grpo    median seconds of a sandbox GRPO step (TRL, on-policy b=16, n=8, the sandbox model size)
    warm    median seconds of a warm-start step (teacher-forced, batch 128)
    pair    two GRPO workers with 1 thread each at the same time: median step seconds of each
for threads in (1, 2), once as the machine is and once while this script keeps one core busy with
``python -c 'while True: pass'`` (started and stopped here, by pid).  Every measurement records the
1-minute load average before it: on a shared machine "quiet" means "no load added by this script".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _grpo_worker(steps: int, threads: int, model_dir: str) -> list[float]:
    from hdreplay_lab.env import configure_threads
    from hdreplay_lab.sandbox.instrument import Recorder, StepStats
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import RunSpec, build_trainer
    from hdreplay_lab.sandbox.tasks import get_task

    configure_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        spec = RunSpec(task="mix", method="onpolicy_matched", seed=0, steps=steps, prompts_per_step=16, generations=8)
        stats = StepStats()
        rec = Recorder(Path(d), stats)
        tr = build_trainer(spec, METHODS["onpolicy_matched"], get_task("mix"), Path(model_dir), Path(d),
                           callbacks=[rec], stats=stats)
        tr.train()
        rec.close()
        return rec.step_times[2:]


def _warm_worker(steps: int, threads: int, model_dir: str) -> list[float]:
    import random

    import torch

    from hdreplay_lab.env import configure_threads
    from hdreplay_lab.sandbox.model import load_model
    from hdreplay_lab.sandbox.tasks import get_task
    from hdreplay_lab.sandbox.warmstart import _batch

    configure_threads(threads)
    task = get_task("mix")
    model, tok = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    train = task.train_problems(2000, seed=0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        ids, att, lab = _batch(tok, task, rng.sample(train, 128), rng)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times[2:]


def _spawn(kind: str, steps: int, threads: int, model_dir: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HDREPLAY_THREADS=str(threads))
    return subprocess.Popen([sys.executable, __file__, "--worker", kind, "--steps", str(steps), "--threads",
                             str(threads), "--model", model_dir], stdout=subprocess.PIPE, text=True, env=env)


def _collect(p: subprocess.Popen) -> float:
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(f"worker failed ({p.returncode})")
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results/sandbox_threads.json")
    ap.add_argument("--worker", choices=["grpo", "warm"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.worker:
        fn = _grpo_worker if a.worker == "grpo" else _warm_worker
        print(json.dumps(fn(a.steps, a.threads, a.model)))
        return
    from hdreplay_lab.sandbox.tasks import get_task
    from hdreplay_lab.sandbox.warmstart import warm_start

    model_dir = a.model or str(warm_start(get_task("mix")))
    rows = []
    for load in ("as_is", "one_core_busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "one_core_busy" else None
        try:
            time.sleep(2 if busy else 0)
            for threads in (1, 2):
                for kind in ("grpo", "warm"):
                    la = os.getloadavg()[0]
                    s = _collect(_spawn(kind, a.steps, threads, model_dir))
                    rows.append({"load": load, "kind": kind, "threads": threads, "median_step_s": s, "loadavg1": la})
                    print(json.dumps(rows[-1]), flush=True)
            la = os.getloadavg()[0]
            pair = [_spawn("grpo", a.steps, 1, model_dir) for _ in range(2)]
            s = [_collect(p) for p in pair]
            rows.append({"load": load, "kind": "pair", "threads": 1, "median_step_s": s, "loadavg1": la})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            if busy:
                busy.kill()
                busy.wait()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"steps": a.steps, "cpus": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
