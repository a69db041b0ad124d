"""The core's size is measured (scripts/core_size.py: every module ``import hdreplay`` loads) and may only shrink.

A ratchet, not a target: the ceiling is the size at the last change that measured it.  A change that grows the core
fails here; put what is not the method around the core (docs/architecture.md), or raise the ceiling in the same
commit and say why in its message.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: physical lines of every module `import hdreplay` loads (5,400 at issue 30; issue 37's token-budgeted walk, cost
#: record and warning made it 5,607, and moved the controller's checkpoint methods to controller_state.py; issue 39's
#: lock fence and the identity a checkpoint carries made it 5,741, all in the checkpoints concern; issue 43's clock-skew
#: rule of the writer lock, 21 lines of dirlock.py, 5,762; issue 44's identity policy (a state without an identity, a
#: value recorded on one side only or of another type: refused, checkpoint.py) and the rewind that moves records to
#: side files instead of deleting them (records.py, controller_state.rewind_logs), 5,841; issue 45's folders by
#: concern: the two folders' faces (store/__init__, checkpoint/__init__: 2 lines each) and the checkpoint schema split
#: between its owners (store/state.py, controller_state.py: +2 lines of imports), then the linter's import order
#: and 120-column wrapping (+5, all in store/: imports sorted and split per module), 5,852 in 26 modules)
CEILING_LINES = 5_852
CEILING_MODULES = 26
#: the method concern (Algorithm 1, the walk, scores, selectors, config, the step protocol): the project's bound
CEILING_METHOD = 2_000
#: each concern (a folder, or named modules at the top of the package: scripts/core_size.py) may only shrink
CEILING_BY_CONCERN = {"the method": 1_997, "the group and its storage": 1_934, "the step record": 383,
                      "checkpoints": 1_332, "argument checks": 206}
#: Algorithm 1 reads at once (issue 30: under 60 lines)
CEILING_ALGORITHM1 = 60


def test_the_core_is_measured_by_concern_and_does_not_grow():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "core_size.py"), "--json", "-"], check=True,
                         capture_output=True, text=True, cwd=ROOT)
    r = json.loads(out.stdout)
    unassigned = [m["module"] for m in r["modules"] if m["concern"] == "unassigned"]
    assert not unassigned, f"new core modules {unassigned}: give each a concern in scripts/core_size.py CONCERNS"
    total = r["total"]
    assert total["lines"] == sum(m["lines"] for m in r["modules"]) == sum(
        m["code"] + m["docstring"] + m["comment"] + m["blank"] for m in r["modules"])
    assert {m["module"] for m in r["modules"]} >= {"__init__", "selection", "scores", "store/buffer", "controller"}
    assert total["lines"] <= CEILING_LINES, (
        f"the core grew to {total['lines']} lines (ceiling {CEILING_LINES}): put what is not the method around it, "
        "or raise the ceiling with the reason")
    assert total["modules"] <= CEILING_MODULES, f"{total['modules']} core modules (ceiling {CEILING_MODULES})"
    method = next(v for k, v in r["by_concern"].items() if k.startswith("the method"))
    assert method["lines"] <= CEILING_METHOD, f"the method concern grew to {method['lines']} lines"
    for prefix, ceiling in CEILING_BY_CONCERN.items():
        (lines,) = [v["lines"] for k, v in r["by_concern"].items() if k.startswith(prefix)]
        assert lines <= ceiling, f"the concern '{prefix}' grew to {lines} lines (ceiling {ceiling})"
    assert r["select_replay_lines"] <= CEILING_ALGORITHM1, r["select_replay_lines"]
    committed = json.loads((ROOT / "docs" / "results" / "core_size.json").read_text())
    assert (committed["total"], committed["select_replay_lines"]) == (total, r["select_replay_lines"]), (
        "docs/results/core_size.* are stale: rerun `.venv/bin/python scripts/core_size.py` (and update the table in "
        "docs/architecture.md if a concern's size moved)")
