"""Replay rows in the optimizer updates after the one whose gate admitted them (issue 27, part 6).

    python benchmarks/trl_regate.py          # ~3 min on 2 loaded CPU cores

When one TRL generation outlives an optimizer update (steps_per_generation = 2 x GA, or num_iterations = 2),
``replay_train_scope="generation"`` (the behaviour before) trains a replay row in the later update(s) too,
without gating it again.  This measures, through HDRGRPOTrainer's real loss path (the tests' RecordingTrainer),
each replayed group's Drift on the loss forward of every update that trains it: in the gated update and in the
later ones, how many exceed tau there (what a re-gate would drop), and what ``replay_train_scope="update"`` (the
default: rows train only in the gated update) leaves.

Writes benchmarks/results/trl_regate.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "support")]

from trl_fixtures import RecordingTrainer, make_args, prompts, reward_digit, tiny_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TAU = 0.05
CONFIGS = {"spg_2ga": dict(steps_per_generation=4, gradient_accumulation_steps=2),
           "two_iterations": dict(num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=2)}


def drift_by_update(tr) -> dict:
    """(optimizer update, selecting step, group index) -> Drift of the group's rows on that update's loss forward."""
    sels = sorted(s["step"] for s in tr.selections)
    acc = {}
    for r in tr.records:
        if not r["is_replay"].any():
            continue
        sel = max(k for k in sels if k <= r["global_step"])
        m = r["mask"][r["is_replay"]]
        d = ((r["now"] - r["old"]) ** 2)[r["is_replay"]] * m
        for row, g in enumerate((-1 - r["hdr_row"][r["is_replay"]]).tolist()):
            a = acc.setdefault((r["global_step"], sel, g), [0.0, 0])
            a[0] += float(d[row].sum())
            a[1] += int(m[row].sum())
    return {k: v[0] / v[1] for k, v in acc.items() if v[1]}


def measure(scope: str, over: dict, steps: int, out: Path) -> dict:
    model, tok = tiny_model(out / "model")
    args = make_args(out / scope, max_steps=steps, per_device_train_batch_size=4, replay_k_rep=2, replay_tau=TAU,
                     learning_rate=1e-3, replay_train_scope=scope, **over)
    tr = RecordingTrainer(model=model, reward_funcs=reward_digit, args=args, train_dataset=prompts(256),
                          processing_class=tok)
    tr.train()
    d = drift_by_update(tr)
    gated = [v for (u, s, g), v in d.items() if u == s]
    later = [v for (u, s, g), v in d.items() if u > s]
    return {"groups_trained_in_gated_update": len(gated), "groups_trained_in_a_later_update": len(later),
            "median_drift_over_tau_gated": statistics.median(gated) / TAU if gated else None,
            "median_drift_over_tau_later": statistics.median(later) / TAU if later else None,
            "max_drift_over_tau_gated": max(gated) / TAU if gated else None,
            "later_share_above_tau": sum(v > TAU for v in later) / len(later) if later else None,
            "replayed_groups": sum(len(s["groups"]) for s in tr.selections)}


def main() -> None:
    t0 = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="regate-"))
    res = {name: {scope: measure(scope, over, 24, out / name) for scope in ("generation", "update")}
           for name, over in CONFIGS.items()}
    result = {"tau": TAU, "configs": {k: {**v} for k, v in CONFIGS.items()}, "results": res,
              "workload": "tiny Qwen2 (trl_fixtures.tiny_model), 24 optimizer updates, pd 4, num_generations 4, "
                          "K_rep 2, lr 1e-3, one process",
              "wall_s": time.perf_counter() - t0}
    path = RESULTS / "trl_regate.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    print(f"wrote {path} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
