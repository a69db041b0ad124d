"""The environment-cost model against a run that actually sleeps the latency (issue 31).

The search comparison (``hdreplay compare --task search``) measures each step's CPU seconds and counts its tool calls
and turns; its summary models the step time at a per-call latency L as ``cpu_s + L x turns`` (per turn) or
``cpu_s + L x calls`` (sequential) without sleeping (hdreplay_lab.sandbox.envcost).  This script reruns a few seeds
of a few methods of a finished comparison with the same settings but ``--latency-ms L`` slept in the same pattern,
and compares, per run, the mean step time the model predicted from the unslept run with the wall-clock step time of
the slept run (steps 2..T, as the summary).  A sleep adds no CPU and no randomness, so the slept run should follow
the same trajectory: the script checks that the per-step tool calls agree step for step.

    python benchmarks/search_slept_check.py --main hdreplay_runs/search --latency-ms 200 --seeds 3 \\
        --out hdreplay_runs/search_slept      # writes slept_check.md / .json into --out

Wall-clock on a shared machine includes other jobs' contention, CPU time does not: the report gives, per run, the
slept run's own CPU seconds and load average so a gap can be told apart from a model error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in open(run_dir / "train_log.jsonl") if x.strip()]


def check(main: Path, out: Path, *, latency_ms: float, seeds: int, methods: tuple[str, ...], workers: int,
          progress: bool = True) -> dict:
    from hdreplay_lab.env import offline_env
    from hdreplay_lab.sandbox.compare import CompareConfig, run_compare
    from hdreplay_lab.sandbox.envcost import modelled_step_s, run_env_cost
    from hdreplay_lab.sandbox.runner import is_finished

    offline_env()
    stored = json.loads((main / "compare.json").read_text())["config"]
    known = {f.name for f in fields(CompareConfig)}
    base = CompareConfig(**{k: v for k, v in stored.items() if k in known})
    if base.task != "search":
        raise SystemExit(f"--main {main}: a search comparison is needed, got task {base.task!r}")
    if seeds > base.seeds:
        raise SystemExit(f"--seeds {seeds}: the main comparison ran {base.seeds}")
    for m in methods:
        for s in range(seeds):
            if not is_finished(main / "runs" / m / f"seed{s}"):
                raise SystemExit(f"--main {main}: runs/{m}/seed{s} is not finished")
    cfg = replace(base, latency_ms=float(latency_ms), seeds=seeds, methods=methods, signatures=False, workers=workers,
                  replay=dict(base.replay))
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    run_compare(cfg, out, progress=progress, log=lambda *a: print(*a, file=sys.stderr))
    wall = time.perf_counter() - t0
    conc = cfg.tool_concurrency
    rows = []
    for m in methods:
        for s in range(seeds):
            a, b = main / "runs" / m / f"seed{s}", out / "runs" / m / f"seed{s}"
            ca, cb = run_env_cost(a), run_env_cost(b)
            same = [r.get("tool_calls") for r in _log(a)] == [r.get("tool_calls") for r in _log(b)]
            predicted = modelled_step_s(ca, latency_ms, conc)  # from the unslept run alone
            own = modelled_step_s(cb, latency_ms, conc)  # the slept run's own CPU and counts
            slept = cb["step_s"]
            rows.append({"method": m, "seed": s, "same_trajectory": same, "predicted_s": predicted,
                         "own_model_s": own, "slept_s": slept, "error": predicted / slept - 1,
                         "own_error": own / slept - 1, "cpu_s_unslept": ca["cpu_s"], "cpu_s_slept": cb["cpu_s"],
                         "turns": cb["tool_turns"], "calls": cb["tool_calls"],
                         "wait_s": modelled_step_s(cb, latency_ms, conc) - cb["cpu_s"]})
    err = np.asarray([r["error"] for r in rows])
    res = {"format": "hdreplay.search_slept_check/1", "main": str(main), "latency_ms": latency_ms,
           "concurrency": conc, "seeds": seeds, "methods": list(methods), "steps": cfg.steps, "workers": workers,
           "rows": rows, "max_abs_error": float(np.abs(err).max()), "mean_error": float(err.mean()),
           "within_10pct": bool((np.abs(err) <= 0.10).all()), "wall_s": wall,
           "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()), "cpus": os.cpu_count()}
    (out / "slept_check.json").write_text(json.dumps(res, indent=2))
    (out / "slept_check.md").write_text(render(res))
    return res


def render(res: dict) -> str:
    lines = [f"# Modelled vs slept step time ({res['latency_ms']:g} ms per call, "
             f"{res['concurrency'].replace('_', ' ')})",
             "",
             f"{len(res['rows'])} runs ({', '.join(res['methods'])}; seeds 0-{res['seeds'] - 1}; "
             f"{res['steps']} steps), "
             f"rerun from `{res['main']}` with the latency slept. Predicted: the unslept run's CPU s per step + "
             "latency x its " + ("turns" if res["concurrency"] == "per_turn" else "calls")
             + " per step; slept: the slept run's wall-clock per step (steps 2..T). "
             "Own model: the same formula from the "
             "slept run's own CPU seconds and counts.", "",
             "| Method | Seed | Same trajectory | CPU s unslept / slept | Wait s | Predicted s | Slept s | Error | "
             "Own-model error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['seed']} | {'yes' if r['same_trajectory'] else 'no'} | "
                     f"{r['cpu_s_unslept']:.3f} / {r['cpu_s_slept']:.3f} | {r['wait_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | "
                     f"{r['slept_s']:.3f} | {100 * r['error']:+.1f}% | {100 * r['own_error']:+.1f}% |")
    la0, la1 = res["loadavg_start"], res["loadavg_end"]
    lines += ["", f"Largest |error| {100 * res['max_abs_error']:.1f}% (mean {100 * res['mean_error']:+.1f}%): "
                  + ("every run within 10 %." if res["within_10pct"] else "NOT every run within 10 %.")
              + f" {res['workers']} worker(s) on {res['cpus']} CPUs, {res['wall_s'] / 60:.1f} min; load average "
              f"(1/5/15 min) {', '.join(f'{x:.2f}' for x in la0)} at start, "
              f"{', '.join(f'{x:.2f}' for x in la1)} at end."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--main", type=Path, required=True, help="a finished `hdreplay compare --task search` directory")
    ap.add_argument("--out", type=Path, required=True, help="output directory of the slept runs and the report")
    ap.add_argument("--latency-ms", type=float, default=200.0, help="per-call latency slept (ms)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", default="onpolicy_matched,headroom_drift")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if not (np.isfinite(a.latency_ms) and a.latency_ms > 0):
        ap.error(f"--latency-ms must be a finite number > 0, got {a.latency_ms}")
    res = check(a.main, a.out, latency_ms=a.latency_ms, seeds=a.seeds, methods=tuple(a.methods.split(",")),
                workers=a.workers, progress=not a.no_progress)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
