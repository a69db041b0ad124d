"""SIGKILL a process at random moments while it saves controller checkpoints, then check what loads.

    python benchmarks/kill_saves.py                 # 200 kills (about a minute)
    python benchmarks/kill_saves.py --kills 50

A forked child saves two controller states A and B alternately into one directory, forever; the
parent kills it with SIGKILL after a random delay, then loads the directory.  The load must give
exactly A or exactly B (or, if the child died during its very first save, report that no checkpoint
exists); a clean save afterwards must leave no leftovers.  This complements the deterministic
crash-point sweep of tests/core/checkpoint/test_checkpoint_faults.py with real process deaths (Python
buffers, the kernel's view of half-written files).  Writes benchmarks/results/kill_saves.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "support")]

from hdreplay import CheckpointError, ReplayConfig, ReplayController  # noqa: E402
from protocol import run_steps, state_hash  # noqa: E402

CFG = ReplayConfig(k_rep=3, tau=5e-3, capacity=40, group_size=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kill_saves.json"))
    args = ap.parse_args()
    a, b = run_steps(ReplayController(CFG), range(6), k=4), run_steps(ReplayController(CFG), range(9), k=4)
    hashes = {state_hash(a): "A", state_hash(b): "B"}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ck"
        t0 = time.perf_counter()
        a.save(d)
        save_s = time.perf_counter() - t0
        rng, outcome = random.Random(args.seed), Counter()
        t_start = time.perf_counter()
        for k in range(args.kills):
            fresh = k % 10 == 0
            if fresh:  # now and then start from nothing, so that first saves get killed too
                shutil.rmtree(d, ignore_errors=True)
            pid = os.fork()
            if pid == 0:  # the child: save A and B in turn until killed
                try:
                    while True:
                        a.save(d)
                        b.save(d)
                finally:
                    os._exit(1)
            time.sleep(rng.uniform(0, 6 * save_s))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            probe = ReplayController(CFG)
            try:
                probe.load(d)
                outcome[hashes.get(state_hash(probe), "mixed")] += 1
            except CheckpointError as e:  # acceptable only when no save had completed yet
                outcome["none (killed in its first save)" if fresh else f"unloadable: {e}"] += 1
            a.save(d)  # the next save cleans up
            leftovers = [p.name for p in d.iterdir() if p.name != "manifest.json"][1:]
            outcome["leftovers after the next save"] += len(leftovers)
    result = {"kills": args.kills, "outcome": dict(outcome), "save_s": save_s,
              "wall_s": time.perf_counter() - t_start}
    bad = {k: v for k, v in outcome.items() if k.startswith(("mixed", "unloadable")) or
           (k.startswith("leftovers") and v)}
    result["ok"] = not bad
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if not bad else 1)


if __name__ == "__main__":
    main()
