"""Count the outcomes of a simulated crash at every file-system call of a controller save (and a torn write at every
write), for the three starting points of tests/core/checkpoint/test_checkpoint_faults.py: an empty directory
("fresh"), a complete previous checkpoint ("overwrite") and one with a dead writer's leftovers ("leftovers").

    python benchmarks/crash_points.py      # a few seconds; writes benchmarks/results/crash_points.json

The test asserts the same outcomes (0 unloadable, 0 mixed, 0 orphans after the next save); this prints the counts,
the figures quoted in docs/core_api.md and the issue notes.  "old" counts a crash that left the previous state (for
"fresh": no checkpoint, as expected), "new" one that left the new state.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "support"), str(ROOT / "tests" / "core")]

import test_checkpoint_faults as faults  # noqa: E402

from hdreplay.checkpoint import files as checkpoint  # noqa: E402


def sweep(scenario: str, tmp: Path) -> dict:
    tmp.mkdir(parents=True)
    old, new, third = faults.controller(3), faults.controller(5), faults.controller(6)
    before, after, real = faults.previous_hash(scenario, old), faults.state_hash(new), checkpoint.FS
    probe, d = faults.CrashingFS(real), faults.prepare(tmp / "probe", scenario, old)
    checkpoint.FS = probe
    try:
        new.save(d)
    finally:
        checkpoint.FS = real
    points = [(i, False) for i in range(len(probe.calls))] + [(i, True) for i, n in enumerate(probe.calls)
                                                               if n == "write"]
    out = Counter()
    for at, torn in points:
        d = faults.prepare(tmp / "run", scenario, old)
        checkpoint.FS = faults.CrashingFS(real, at, torn)
        try:
            new.save(d)
        except faults.Crash:
            pass
        finally:
            checkpoint.FS = real
        got = faults.loaded_hash(d)
        out["old" if got == before else "new" if got == after else "unloadable" if got is None else "mixed"] += 1
        third.save(d)  # the next save cleans every leftover
        out["orphans after the next save"] += len([p for p in d.iterdir() if p.name != "manifest.json"][1:])
    return {"crash_points": len(points), "fs_calls": len(probe.calls), **out}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = {s: sweep(s, Path(tmp) / s) for s in ("fresh", "overwrite", "leftovers")}
    result["ok"] = all(r.get("unloadable", 0) == r.get("mixed", 0) == r["orphans after the next save"] == 0
                       for r in result.values() if isinstance(r, dict))
    out = ROOT / "benchmarks" / "results" / "crash_points.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
