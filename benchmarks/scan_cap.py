"""Where the old default scan cap, min(C, 8 K_rep), changed a decision: paired runs with and without it.

    python benchmarks/scan_cap.py                    # 4 paired seeds x 40 steps, ~45 min on one busy core
    python benchmarks/scan_cap.py --seeds 2 --steps 40 --out /tmp/s.json   # a smoke run

Until 0.2 ``ReplayConfig.max_scan`` unset meant min(C, 8 K_rep) groups re-scored per step; now it means no cap, the
paper's scan (to K_rep admitted or the end of the buffer).  The cap can only change a step where the gate admitted
fewer than K_rep within the first 8 K_rep groups of the order, so it binds only when C > 8 K_rep.  This runs the
synthetic driver (``hdreplay_lab.synthetic``: a moving table policy, random groups, no model) on paired seeds -- the
same fresh groups and policy trajectory for both configurations -- at the shape of the paper's settings (C <= 8 K_rep)
and at the README's TRL example (C 512, K_rep 8), for a loose and a tight tau, and counts per run the steps whose
replayed groups differ, the budget fill and the groups re-scored per step.

Writes benchmarks/results/scan_cap.json (one row per setting: means over seeds and the paired differences).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial

import numpy as np

from hdreplay import ReplayConfig, ReplayController
from hdreplay_lab.synthetic import drive, fresh_groups, policy_walk

#: (label, capacity, k_rep, groups per step).  Where C <= 8 K_rep -- the paper's settings (C 512, K_rep 128), the
#: sandbox's (C = 2b or 4b, K_rep = b/2) -- the old cap equals the buffer and cannot change anything; that is checked
#: on a small instance of the same shape (C = 8 K_rep), not simulated at the paper's size.
SETTINGS = [
    ("C = 8 K_rep (the paper's and the sandbox's shape: C 64, K_rep 8)", 64, 8, 16),
    ("README TRL example (C 512, K_rep 8)", 512, 8, 16),
]


def run(capacity: int, k_rep: int, per_step: int, tau: float, max_scan, seed: int, steps: int) -> dict:
    cfg = ReplayConfig(k_rep=k_rep, tau=tau, capacity=capacity, max_scan=max_scan, scan_passes=4)
    ctrl = ReplayController(cfg)
    out = {"replayed": [], "fill": [], "rescored": [], "capped": 0}
    walk = partial(policy_walk, step_size=0.05, walk_seed=seed)
    fresh = partial(fresh_groups, per_step=per_step, seed=seed, max_len=6)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for st in drive(ctrl, range(steps), policy_at=walk, fresh=fresh):
            sel = st.selection
            out["replayed"].append(sorted(g.group_id for g in sel.groups))
            out["fill"].append(len(sel.accepted) / k_rep)
            out["rescored"].append(len(sel.scanned) + sel.scored_unused)
            out["capped"] += bool(sel.scan_capped)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "scan_cap.json"))
    args = ap.parse_args()
    rows = []
    for label, C, K, per in SETTINGS:
        for tau in (1e-2, 1e-3):
            differ, fill_old, fill_new, scan_old, scan_new, capped = [], [], [], [], [], []
            for seed in range(args.seeds):
                old = run(C, K, per, tau, min(C, 8 * K), seed, args.steps)
                new = run(C, K, per, tau, None, seed, args.steps)
                differ.append(sum(a != b for a, b in zip(old["replayed"], new["replayed"])) / args.steps)
                fill_old.append(statistics.mean(old["fill"]))
                fill_new.append(statistics.mean(new["fill"]))
                scan_old.append(statistics.mean(old["rescored"]))
                scan_new.append(statistics.mean(new["rescored"]))
                capped.append(old["capped"] / args.steps)
            d = np.asarray(fill_new) - np.asarray(fill_old)
            half = 1.96 * float(d.std(ddof=1)) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
            row = {"setting": label, "capacity": C, "k_rep": K, "tau": tau, "seeds": args.seeds, "steps": args.steps,
                   "cap_binds": C > 8 * K, "share_of_steps_capped": statistics.mean(capped),
                   "share_of_steps_replaying_other_groups": statistics.mean(differ),
                   "budget_fill_capped": statistics.mean(fill_old), "budget_fill_paper": statistics.mean(fill_new),
                   "budget_fill_paired_difference": [float(d.mean()), half],
                   "groups_rescored_per_step_capped": statistics.mean(scan_old),
                   "groups_rescored_per_step_paper": statistics.mean(scan_new)}
            rows.append(row)
            print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump({"benchmark": "scan_cap", "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
