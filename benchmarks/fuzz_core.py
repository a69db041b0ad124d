"""The long fuzz of the core's public API and the crash/byte-flip counts the reliability report quotes.

    python benchmarks/fuzz_core.py                  # every case + 300 random programs of 40 calls (a few minutes)
    python benchmarks/fuzz_core.py --programs 20    # quicker

The suite (tests/core/test_fuzz_api.py) runs the same engine (tests/support/core_fuzz.py) on fewer random
programs.  Counts (each must be 0):
    unexpected     an exception that is not one of hdreplay's errors (TypeError / KeyError ... from inside)
    silent         a call that accepted an invalid input
    changed        a refused call that changed the state (state hash before != after)
    valid_failed   a valid call that was refused (the fuzz cannot pass by refusing everything)
Writes benchmarks/results/fuzz_core.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "support")]

from core_fuzz import random_programs, run_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=300)
    ap.add_argument("--length", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_core.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cases = run_cases(Path(tmp))
    programs = random_programs(args.programs, seed=args.seed, length=args.length)
    result = {
        "cases": cases.summary(), "case_error_types": dict(cases.types),
        "random_programs": programs.summary() | {"programs": args.programs, "length": args.length,
                                                 "seed": args.seed},
        "program_error_types": dict(programs.types),
        "examples": {k: v for k, v in {**cases.examples, **programs.examples}.items() if v},
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("cases", "random_programs")}, indent=2))
    print(f"wrote {out} in {result['wall_s']:.1f} s")
    bad = [k for part in ("cases", "random_programs") for k in ("unexpected", "silent", "changed", "valid_failed")
           if result[part][k]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
