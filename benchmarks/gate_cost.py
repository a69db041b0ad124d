"""What the Drift gate costs per step in the sandbox, before and after exact early rejection (issue 27).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/gate_cost.py                 # mix task, 100 steps (~25 min loaded)
    python benchmarks/gate_cost.py --steps 20 --out /tmp/g.json                   # a smoke run

One sandbox run (task mix, b = 16 prompts x n = 8, K_rep = 8, tau = 0.01, the cached warm start of
``hdreplay compare``) trains with the paper's full scan (``scan_passes=1``: every scanned group forwarded whole,
cached Headroom refreshed from the whole group).  At every step, on the same weights:

* **paired variants on the run's own buffer**: the sliced scan with 2, 4 and 8 passes re-scores the same buffer
  (its result is discarded).  Their gate decisions must equal the full scan's (``decision_mismatches`` counts the
  steps where they do not); their rows, tokens, scorer calls and seconds are the same step's paired cost.
* **shadow controllers**: copies of the controller fed the same fresh groups at every step (so they hold the same
  groups: buffer membership does not depend on selection) but selecting with their own settings and keeping their
  own cached Headroom, reject streaks and skips: ``slice`` / ``keep`` / ``finish`` (scan_passes 4 and that
  ``scan_refresh``) and ``skip`` / ``skip2`` / ``skip_life`` (slice + skip_rejected = --skip, 2, and 10,000: a
  rejected group is never scanned again).  Their selections are compared with the full scan's at
  every step (Jaccard of the replayed group ids; ``finish`` must agree at every step), holding the policy
  trajectory fixed: what the refresh policy and the skip do to later selections, separated from what they do to
  training (the paired accuracy runs are docs/results/gate_cost).

The scans run in a random order at each step (seeded) so that none is systematically first after the forward
passes of training.  Seconds are wall-clock of the scan (forward passes + bookkeeping) on a machine that may be
shared: compare the paired ratios, not absolute values.

Writes benchmarks/results/gate_cost.json: per variant totals (rows, tokens, groups touched and scanned,
accepted, scorer calls, seconds), per admitted row / token / group, median seconds per step and the median of the
per-step ratio to the full scan, and per step the full scan's and the sliced scan's seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hdreplay import ReplayController, select_replay  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAIRED = {"passes2": dict(scan_passes=2), "passes4": dict(scan_passes=4), "passes8": dict(scan_passes=8)}


def shadows(skip: int) -> dict[str, dict]:
    return {"slice": dict(scan_passes=4, scan_refresh="slice"), "keep": dict(scan_passes=4, scan_refresh="keep"),
            "finish": dict(scan_passes=4, scan_refresh="finish"),
            "skip": dict(scan_passes=4, scan_refresh="slice", skip_rejected=skip),
            "skip2": dict(scan_passes=4, scan_refresh="slice", skip_rejected=2),
            "skip_life": dict(scan_passes=4, scan_refresh="slice", skip_rejected=10_000)}


class Tally:
    """Per-variant sums and per-step seconds."""

    def __init__(self):
        self.sum = {k: 0 for k in ("rows", "tokens", "touched", "scanned", "accepted", "accepted_rows",
                                   "accepted_tokens", "calls", "early", "skipped")}
        self.seconds: list[float] = []
        self.steps: list[int] = []
        self.rows: list[int] = []

    def add(self, sel, seconds: float, step: int) -> None:
        s = self.sum
        s["rows"] += sel.rescored_rows
        s["tokens"] += sel.rescored_tokens
        s["touched"] += len(sel.scanned) + sel.scored_unused
        s["scanned"] += len(sel.scanned)
        s["accepted"] += len(sel.accepted)
        s["accepted_rows"] += sum(g.num_responses for g in sel.groups)
        s["accepted_tokens"] += sum(g.num_tokens for g in sel.groups)
        s["calls"] += sel.scorer_calls
        s["early"] += int((~sel.scanned_exact).sum()) if sel.scanned_exact is not None else 0
        s["skipped"] += sel.skipped
        self.seconds.append(seconds)
        self.steps.append(step)
        self.rows.append(sel.rescored_rows)

    def summary(self, base: "Tally | None") -> dict:
        s = self.sum
        out = {**s,
               "rows_per_admitted_row": s["rows"] / max(s["accepted_rows"], 1),
               "tokens_per_admitted_token": s["tokens"] / max(s["accepted_tokens"], 1),
               "groups_touched_per_admitted": s["touched"] / max(s["accepted"], 1),
               "groups_scanned_per_admitted": s["scanned"] / max(s["accepted"], 1),
               "calls_per_step": s["calls"] / max(len(self.seconds), 1),
               "seconds_total": sum(self.seconds),
               "seconds_median_per_step": statistics.median(self.seconds) if self.seconds else None}
        if base is not None:
            pairs = [(a, b) for a, b in zip(self.seconds, base.seconds) if b > 0]
            out["seconds_ratio_median"] = statistics.median(a / b for a, b in pairs) if pairs else None
            out["seconds_ratio_total"] = sum(self.seconds) / max(sum(base.seconds), 1e-12)
        return out


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=4, help="skip_rejected of the skip shadow")
    ap.add_argument("--out", default=str(RESULTS / "gate_cost.json"))
    args = ap.parse_args()
    from hdreplay_lab.env import configure_threads
    from hdreplay_lab.sandbox.compare import CompareConfig
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import build_trainer
    from hdreplay_lab.sandbox.tasks import get_task
    from hdreplay_lab.sandbox.warmstart import warm_start

    threads = configure_threads()
    t_start = time.perf_counter()
    cc = CompareConfig(task="mix", seeds=1, steps=args.steps, methods=("headroom_drift",), eval_every=0,
                       signatures=False, replay={"scan_passes": 1})
    spec = cc.spec("headroom_drift", args.seed)
    task = get_task("mix")
    model_dir = warm_start(task, log=lambda *a: None)
    run_dir = Path(tempfile.mkdtemp(prefix="gate-cost-"))
    torch.manual_seed(args.seed)
    tr = build_trainer(spec, METHODS["headroom_drift"], task, model_dir, run_dir)
    ctrl: ReplayController = tr.replay
    base_cfg = ctrl.config
    shadow = {k: ReplayController(dataclasses.replace(base_cfg, **v)) for k, v in shadows(args.skip).items()}
    tally = {k: Tally() for k in ("full", *PAIRED, *shadow)}
    agree = {k: [] for k in shadow}
    mismatches = {k: 0 for k in PAIRED}
    rng = random.Random(args.seed)
    real_select, real_stage, real_commit = ctrl.select, ctrl.stage, ctrl.commit

    def select(*, step, scorer=None):
        jobs = [("full", None), *((k, None) for k in PAIRED), *((k, None) for k in shadow)]
        rng.shuffle(jobs)
        done = {}
        for name, _ in jobs:
            t0 = time.perf_counter()
            if name == "full":
                sel = real_select(step=step, scorer=scorer)
            elif name in PAIRED:
                sel = select_replay(ctrl.buffer, dataclasses.replace(base_cfg, **PAIRED[name]), scorer, step=step,
                                    acceptance_rate=ctrl.acceptance_rate, tau=ctrl.tau)
            else:
                sel = shadow[name].select(step=step, scorer=scorer)
            tally[name].add(sel, time.perf_counter() - t0, step)
            done[name] = sel
        full = done["full"]
        for k in PAIRED:
            s = done[k]
            same = (s.scanned.tolist() == full.scanned.tolist()
                    and s.scanned_pass.tolist() == full.scanned_pass.tolist()
                    and s.accepted.tolist() == full.accepted.tolist())
            mismatches[k] += not same
        for k in shadow:
            agree[k].append(jaccard([g.group_id for g in done[k].groups], [g.group_id for g in full.groups]))
        return full

    def stage(groups, *, step):
        for c in shadow.values():
            c.stage(groups, step=step)
        return real_stage(groups, step=step)

    def commit(**kw):
        for c in shadow.values():
            c.commit(num_fresh_groups=kw.get("num_fresh_groups"))
        return real_commit(**kw)

    ctrl.select, ctrl.stage, ctrl.commit = select, stage, commit
    tr.train()
    full = tally["full"]
    fresh_rows = spec.prompts_per_step * spec.generations
    result = {
        "variants": {k: t.summary(None if k == "full" else full) for k, t in tally.items()},
        "decision_mismatches": mismatches,
        "agreement": {k: {"mean_jaccard": float(np.mean(v)), "identical_steps": float(np.mean([x == 1.0 for x in v])),
                          "steps": len(v)} for k, v in agree.items()},
        "per_step_seconds": {"step": full.steps, "full": full.seconds, "passes4": tally["passes4"].seconds,
                             "slice": tally["slice"].seconds},
        "late_steps": {"from_step": 30, "fresh_rows_per_step": fresh_rows},
        "workload": {"task": "mix", "b": spec.prompts_per_step, "n": spec.generations, "k_rep": base_cfg.k_rep,
                     "tau": base_cfg.tau, "capacity": base_cfg.capacity, "steps": args.steps, "seed": args.seed,
                     "skip_rejected": args.skip, "training_scan": "scan_passes=1 (the paper's full scan)",
                     "model": str(model_dir)},
        "torch": torch.__version__, "threads": threads, "machine": platform.machine(),
        "loadavg_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start,
    }
    for k, t in tally.items():  # re-scored rows per step in steps >= 30, against the fresh rows of a step
        rows = [r for r, s in zip(t.rows, t.steps) if s >= 30]
        result["late_steps"][k] = float(np.mean(rows)) / fresh_rows if rows else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {m: v[m] for m in ("rows_per_admitted_row", "tokens_per_admitted_token",
                                            "groups_touched_per_admitted", "seconds_median_per_step")}
                      for k, v in result["variants"].items()}, indent=1))
    print(json.dumps({"mismatches": mismatches, "agreement": result["agreement"]}, indent=1))
    print(f"wrote {out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
