"""The core's size, measured the way issue 30 defines it: every module that ``import hdreplay`` loads.

    .venv/bin/python scripts/core_size.py                 # table by concern and module; writes docs/results/core_size.*
    .venv/bin/python scripts/core_size.py --json -        # the JSON only, on stdout (tests/core/test_core_size.py)

A fresh interpreter imports ``hdreplay`` and nothing else of the project; each module it loaded is counted as physical
lines and split into code, docstrings, comments and blank lines (docstrings: the first string statement of the
module, a class or a function, found with ``ast``).  Modules are grouped by concern (:data:`CONCERNS`); a module the
table does not name (by its folder, or by name at the top of the package) is counted under "unassigned" (the test
refuses that, so a new core module gets a concern).  Also measured: the length of Algorithm 1
(``hdreplay.selection.select_replay``, docstring included).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

#: concern -> what serves it: a folder of the core ("store/": every module in it, its __init__ too) or a module at the
#: top of the package (hdreplay.<name>)
CONCERNS = {
    "the method (Algorithm 1, scores, selectors, config, the step protocol)": (
        "selection", "rescore", "selectors", "scores", "controller", "config", "ingress", "sampling", "__init__"),
    "the group and its storage (store/: records, ingest, padded rows, images, FIFO buffer, its schema)": ("store/",),
    "the step record (replay/* metrics, steps.jsonl)": ("records",),
    "checkpoints (checkpoint/: crash-safe directories, writer lock, streaming; the controller's state)": (
        "checkpoint/", "controller_state"),
    "argument checks and errors": ("validate", "errors"),
}
ROOT = Path(__file__).resolve().parents[1]


def loaded_modules() -> dict[str, str]:
    """name -> file of every hdreplay module a fresh ``import hdreplay`` loads."""
    code = ("import json, sys, hdreplay; print(json.dumps({n: m.__file__ for n, m in sorted(sys.modules.items()) "
            "if (n == 'hdreplay' or n.startswith('hdreplay.')) and getattr(m, '__file__', None)}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)


def count(path: str) -> dict[str, int]:
    """Physical lines of ``path`` split into code / docstring / comment / blank."""
    src = Path(path).read_text()
    lines = src.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    blank = {i for i, line in enumerate(lines, 1) if not line.strip()}
    comment = {i for i, line in enumerate(lines, 1) if line.strip().startswith("#")} - doc
    return {"lines": len(lines), "code": len(lines) - len(doc | blank | comment), "docstring": len(doc - blank),
            "comment": len(comment), "blank": len(blank)}


def algorithm1_lines() -> int:
    tree = ast.parse((ROOT / "src" / "hdreplay" / "selection.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "select_replay")
    return fn.end_lineno - fn.lineno + 1


def measure() -> dict:
    concern_of = {m: c for c, mods in CONCERNS.items() for m in mods}
    modules = []
    for name, path in loaded_modules().items():
        short = "__init__" if name == "hdreplay" else name.removeprefix("hdreplay.")
        folder = short.split(".")[0] + "/"
        concern = concern_of.get(folder if folder in concern_of else short, "unassigned")
        face = "/__init__" if name != "hdreplay" and path.endswith("__init__.py") else ""
        modules.append({"module": short.replace(".", "/") + face, "concern": concern, **count(path)})
    total = {k: sum(m[k] for m in modules) for k in ("lines", "code", "docstring", "comment", "blank")}
    by_concern = {c: {k: sum(m[k] for m in modules if m["concern"] == c) for k in total} for c in
                  [*CONCERNS, "unassigned"] if any(m["concern"] == c for m in modules)}
    return {"modules": modules, "total": {**total, "modules": len(modules)}, "by_concern": by_concern,
            "select_replay_lines": algorithm1_lines()}


def markdown(r: dict) -> str:
    t = r["total"]
    rows = ["| concern / module | lines | code | docstring | comment | blank |", "|---|---:|---:|---:|---:|---:|"]
    for c, s in r["by_concern"].items():
        rows.append(f"| **{c}** | **{s['lines']:,}** | {s['code']:,} | {s['docstring']:,} | {s['comment']} | "
                    f"{s['blank']} |")
        for m in sorted((m for m in r["modules"] if m["concern"] == c), key=lambda m: -m["lines"]):
            rows.append(f"| &nbsp; {m['module']}.py | {m['lines']} | {m['code']} | {m['docstring']} | {m['comment']} "
                        f"| {m['blank']} |")
    rows.append(f"| **all {t['modules']} modules** | **{t['lines']:,}** | {t['code']:,} | {t['docstring']:,} | "
                f"{t['comment']} | {t['blank']} |")
    return ("# The core's size: every module `import hdreplay` loads\n\n"
            "Written by `.venv/bin/python scripts/core_size.py` (counted, not estimated). Algorithm 1 "
            f"(`selection.select_replay`, docstring included): {r['select_replay_lines']} lines.\n\n"
            + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "core_size.json"),
                    help="where to write the JSON ('-': stdout only, no markdown)")
    ap.add_argument("--md", default=str(ROOT / "docs" / "results" / "core_size.md"), help="where to write the table")
    a = ap.parse_args()
    r = measure()
    if a.json == "-":
        print(json.dumps(r, indent=1))
        return
    Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    Path(a.md).write_text(markdown(r))
    print(markdown(r))
    print(f"wrote {a.json} and {a.md}")


if __name__ == "__main__":
    main()
