"""Runs the 2-process async resume test N times with CPU cores kept busy, and counts the failures (issue 43, item 4).

    python scripts/async_resume_flake.py --runs 20                 # this checkout, one core busy
    python scripts/async_resume_flake.py --runs 10 --rev f14b790   # an exported revision (e.g. before the fix)

Not part of ``make test``: about 2-3 minutes a run on 2 cores.  The test in
``tests/trl/asynchronous/test_trl_async_resume.py``
(``test_two_processes_interrupted_and_resumed_equal_the_uninterrupted_run``) failed about one run in three to six
with a core busy: both ranks built the lock-step worker and both wrote its state into the checkpoint, so when rank
1's never-used one was written last the resumed run continued another stream.

``--rev``: the test runs in a ``git archive`` export of that revision (its ``src`` first on PYTHONPATH), so a
working tree that others are editing does not change what is measured.  Writes ``--out`` (JSON, every run) and the
same name with ``.md`` (a short summary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = ("tests/trl/asynchronous/test_trl_async_resume.py::"
        "test_two_processes_interrupted_and_resumed_equal_the_uninterrupted_run")
#: where the test was before issue 45's folders (an export of an older --rev)
OLD_TEST = TEST.replace("tests/trl/asynchronous/", "tests/trl/")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _export(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def _error_lines(out: str, keep: int = 6) -> list[str]:
    lines = [ln for ln in out.splitlines() if ln.startswith("E ") or ln.startswith("FAILED")]
    return lines[:keep] or out.splitlines()[-keep:]


def run_once(tree: Path, test: str, timeout: float) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", f"timed out after {timeout:g} s\n{e.stdout or ''}"
    return {"passed": rc == 0, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "error": None if rc == 0 else _error_lines(out if isinstance(out, str) else out.decode())}


def markdown(res: dict) -> str:
    lines = [f"# Async resume flake: {res['runs']} runs with {res['busy_cores']} core(s) busy", "",
             f"`{res['command']}`", "",
             f"Test: `{res['test']}`  ",
             f"Code: {res['code']}  ",
             f"Machine: {res['cpus']} CPUs, {res['busy_cores']} kept busy by `python -c 'while 1: pass'`; "
             f"{res['started']} - {res['finished']} (UTC)", "",
             f"**{res['failures']} failure(s) in {res['runs']} runs**; per run {res['seconds_min']:.0f}-"
             f"{res['seconds_max']:.0f} s.", ""]
    for r in res["results"]:
        if not r["passed"]:
            lines += [f"* run {r['run']} failed (rc {r['rc']}):", "", "  ```", *("  " + ln for ln in r["error"]),
                      "  ```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--busy-cores", type=int, default=1)
    ap.add_argument("--rev", default=None, help="run the test in an export of this git revision (default: this tree)")
    ap.add_argument("--test", default=TEST)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "async_resume_flake.json")
    a = ap.parse_args()
    if a.runs < 1 or a.busy_cores < 0:
        ap.error(f"--runs must be >= 1 and --busy-cores >= 0 (got {a.runs}, {a.busy_cores})")
    with tempfile.TemporaryDirectory(prefix="hdr_flake_") as tmp:
        if a.rev:
            code = f"git archive of {a.rev} ({_git('rev-parse', '--short', a.rev)})"
            tree = _export(a.rev, Path(tmp))
        else:
            dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
            code = (f"checkout at {_git('rev-parse', '--short', 'HEAD')}"
                    + (" with uncommitted changes" if dirty else ""))
            tree = ROOT
        if a.test == TEST and not (tree / TEST.split("::")[0]).exists():
            a.test = OLD_TEST
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.busy_cores)]
        results = []
        try:
            for i in range(1, a.runs + 1):
                r = {"run": i, **run_once(tree, a.test, a.timeout)}
                results.append(r)
                print(f"run {i}/{a.runs}: {'passed' if r['passed'] else 'FAILED'} ({r['seconds']} s)", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    secs = [r["seconds"] for r in results]
    res = {"command": "python scripts/async_resume_flake.py " + " ".join(sys.argv[1:]), "test": a.test, "code": code,
           "runs": len(results), "failures": sum(not r["passed"] for r in results), "busy_cores": a.busy_cores,
           "cpus": os.cpu_count(), "python": platform.python_version(), "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "seconds_min": min(secs),
           "seconds_max": max(secs), "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(res))
    print(f"{res['failures']} failure(s) in {res['runs']} runs -> {a.out}")


if __name__ == "__main__":
    main()
