"""Run the TRL test subset against every trl release from --since on that the package index offers.

    nice -n 10 .venv/bin/python scripts/trl_releases.py                     # every release >= 1.14, default subset
    .venv/bin/python scripts/trl_releases.py --versions 1.15.0 --tests tests/trl/test_trl_plan.py

Each release is installed with ``pip install --no-deps --target <work>/trl-X trl==X`` and put first on PYTHONPATH, so it
shadows the shared .venv's trl while reusing every other package of the .venv (torch, transformers, accelerate, ...)
as it is: nothing is downloaded but TRL, and the .venv is not touched.  ``trl.__version__`` is checked inside before
the tests run; the release the .venv pins (1.16.0) runs from the .venv itself.  ``HDREPLAY_UNTESTED_TRL=1`` lets
``hdreplay.integrations.trl`` import under another release (it refuses by default).  When ``from trl import
GRPOTrainer`` fails for a module that neither trl's declared requirements nor the .venv provide, that module is
installed into the release's folder too (listed in the table).

Per release: the tests passed / failed / errored / skipped (pytest's JUnit XML), the failing tests with the first
line of their error, the seam items whose signature or source differ from the record (tests/trl/data/trl_seam.json,
see tests/support/trl_seam.py), TRL's own requirements that the .venv does not satisfy, and the wall time.  Writes
``<out>.json`` and ``<out>.md`` (default docs/results/trl_releases).  Outside ``make test``: it takes minutes per
release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["tests/trl/test_trl.py", "tests/trl/test_trl_loss.py", "tests/trl/test_trl_config.py",
          "tests/trl/test_trl_plan.py", "tests/trl/test_trl_seam_contract.py"]
SEAM_DIFF = """
import json, sys
sys.path.insert(0, "tests/support")
import trl, trl_seam
rec = trl_seam.load_record()
print(json.dumps({"trl": trl.__version__, "reference": rec["recorded_with"]["trl"],
                  "changed": [{"key": c.key, "kind": c.kind, "what": c.what} for c in trl_seam.compare(rec)]}))
"""


def index_versions(package: str = "trl") -> list[str]:
    """The versions the package index offers (``pip index versions``)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("Available versions:")), None)
    if line is None:
        raise RuntimeError(f"pip index versions {package} gave no 'Available versions:' line:\n{out}")
    return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]


def install(version: str, work: Path) -> Path:
    """trl==version (no dependencies) in a folder of its own; reused when already there."""
    target = work / f"trl-{version}"
    if not (target / "trl" / "__init__.py").is_file():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "--target", str(target), f"trl=={version}"], check=True)
    return target


def unmet_requirements(target: Path | None) -> list[str]:
    """trl's unconditional requirements (its METADATA) that the .venv's installed versions do not satisfy."""
    dists = list(target.glob("trl-*.dist-info")) if target else []
    dist = metadata.PathDistribution(dists[0]) if dists else metadata.distribution("trl")
    unmet = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (have {have})")
    return unmet


def missing_imports(target: Path, env: dict, tries: int = 3) -> tuple[list[str], str | None]:
    """Modules ``from trl import GRPOTrainer`` needs but neither trl's requirements nor the .venv provide (trl
    1.14.x imports ``requests`` unconditionally but lists it only under its ``vllm`` extra): installed, with their
    dependencies, into the release's own folder.  Returns what was installed and the import error left, if any."""
    added: list[str] = []
    for _ in range(tries):
        probe = subprocess.run([sys.executable, "-c", "from trl import GRPOTrainer"], env=env, cwd=ROOT,
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return added, None
        missing = re.findall(r"No module named '([\w.]+)'", probe.stderr)
        if not missing or missing[-1].split(".")[0] in added:
            return added, "from trl import GRPOTrainer failed: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
        name = missing[-1].split(".")[0]
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target",
                        str(target), name], check=True)
        added.append(name)
    return added, f"from trl import GRPOTrainer still failing after installing {added}"


def folder_packages(target: Path) -> list[str]:
    """What the release's folder holds besides trl (installed by :func:`missing_imports`, now or on an earlier run)."""
    return sorted(d.name.removesuffix(".dist-info") for d in target.glob("*.dist-info")
                  if not d.name.startswith("trl-"))


def run_release(version: str, target: Path | None, tests: list[str], work: Path, timeout: float) -> dict:
    env = dict(os.environ, HDREPLAY_UNTESTED_TRL="1", PYTHONPATH=os.pathsep.join(
        ([str(target)] if target else []) + [str(ROOT / "src")]))
    row: dict = {"version": version, "unmet_requirements": unmet_requirements(target)}
    t0 = time.perf_counter()
    got = subprocess.run([sys.executable, "-c", "import trl; print(trl.__version__)"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    row["trl_version_seen"] = got.stdout.strip() or "".join(got.stderr.strip().splitlines()[-1:])
    if got.returncode != 0 or row["trl_version_seen"] != version:
        row["error"] = f"trl {version} did not import as itself: {row['trl_version_seen']}"
        return row
    if target is not None:
        _, problem = missing_imports(target, env)
        if problem:
            row["error"] = problem
        row["installed_for_import"] = folder_packages(target)
    seam = subprocess.run([sys.executable, "-c", SEAM_DIFF], env=env, cwd=ROOT, capture_output=True, text=True)
    if seam.returncode == 0:
        row["seam_changed"] = json.loads(seam.stdout.strip().splitlines()[-1])["changed"]
    else:
        row["seam_error"] = (seam.stderr.strip().splitlines() or ["?"])[-1]
    xml = work / f"junit-{version}.xml"
    log = work / f"pytest-{version}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    try:
        with open(log, "w") as f:
            subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        row["error"] = f"pytest ran past {timeout:.0f} s"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row.update(junit_counts(xml))
    return row


def junit_counts(xml: Path) -> dict:
    if not xml.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    counts, failures = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, []
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if bad is None:
            counts["passed"] += 1
            continue
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped"}[bad.tag]] += 1
        if bad.tag != "skipped":
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": bad.tag,
                             "message": (first[0] if first else "")[:300]})
    return {**counts, "failures": failures}


def markdown(result: dict) -> str:
    rows = result["releases"]
    out = [
        "# The TRL test subset against trl releases",
        "",
        f"Command: `{result['command']}` (hdreplay {result['commit']}, {result['date']}; torch {result['torch']}, "
        f"transformers {result['transformers']}, Python {result['python']}; trl {result['pinned']} is the pinned "
        "release; each other release installed without dependencies ahead of the shared .venv, with "
        "`HDREPLAY_UNTESTED_TRL=1`).",
        f"Subset: {', '.join('`' + t + '`' for t in result['tests'])}. Seam items: the recorded overrides and private "
        f"uses (`tests/trl/data/trl_seam.json`, recorded against trl {result['reference']}) whose signature or "
        "source differ in that release. Wall time includes the seam check and pytest's start-up on a shared, loaded "
        "2-core machine.",
        "",
        "| trl | passed | failed | errors | skipped | seam items changed vs the record | trl requirements the .venv "
        "does not meet | also in the release's folder (for `from trl import GRPOTrainer`) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seam = r.get("seam_changed")
        seam_txt = (r.get("seam_error") or "?") if seam is None else ("none" if not seam else "<br>".join(
            f"`{c['key']}` ({', '.join(w.split(' ')[0].rstrip(':') for w in c['what'])})" for c in seam))
        out.append(f"| {r['version']}{' (pinned)' if r['version'] == result['pinned'] else ''} | "
                   f"{r.get('passed', '-')} | {r.get('failed', '-')} | {r.get('errors', '-')} | "
                   f"{r.get('skipped', '-')} | {seam_txt} | {'<br>'.join(r['unmet_requirements']) or 'none'} | "
                   f"{', '.join(r.get('installed_for_import') or []) or 'none'} | {r.get('wall_s', '-')} |")
    out += ["", "## Seam changes, by release", "",
            "Each recorded item whose fingerprint differs from the record: signature (old -> new), source (normalized "
            "source hash, old -> new), owner (the class that defines it), missing (absent in that release).", ""]
    for r in rows:
        for c in r.get("seam_changed") or []:
            out.append(f"* **{r['version']}** `{c['key']}` ({c['kind']}): {'; '.join(c['what'])}")
    out += ["", "## What failed, by release", ""]
    for r in rows:
        if r.get("error"):
            out.append(f"* **{r['version']}**: {r['error']}")
        fails = r.get("failures") or []
        by_message: dict[str, list[str]] = {}
        for f in fails:
            by_message.setdefault(f"{f['kind']}: {f['message']}", []).append(f["test"].rsplit("::", 1)[-1])
        for msg, tests in by_message.items():
            out.append(f"* **{r['version']}** ({len(tests)}: {', '.join(tests[:6])}{', ...' if len(tests) > 6 else ''}"
                       f"): `{msg}`")
        if not fails and not r.get("error"):
            out.append(f"* **{r['version']}**: nothing")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--since", default="1.14", help="oldest release to run (inclusive)")
    p.add_argument("--versions", nargs="*", help="these releases instead of the index's")
    p.add_argument("--tests", nargs="+", default=SUBSET, help="the test files / node ids to run")
    p.add_argument("--work", type=Path, default=Path("/tmp/hdreplay_trl_releases"), help="scratch folder")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "trl_releases",
                   help="writes <out>.json and <out>.md")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per release")
    p.add_argument("--commit", default=None, help="the hdreplay commit tested (default: git rev-parse HEAD)")
    a = p.parse_args(argv)
    import torch
    import transformers
    import trl

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import trl_seam

    pinned = trl.__version__
    versions = a.versions or [v for v in index_versions() if Version(v) >= Version(a.since)
                              and not Version(v).is_prerelease]
    versions = sorted(set(versions), key=Version)
    a.work.mkdir(parents=True, exist_ok=True)
    commit = a.commit or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip() or None
    args = argv if argv is not None else sys.argv[1:]
    result = {"commit": commit, "command": "python scripts/trl_releases.py " + " ".join(args),
              "date": time.strftime("%Y-%m-%d"), "pinned": pinned, "reference": trl_seam.load_record()[
                  "recorded_with"]["trl"], "tests": a.tests, "torch": torch.__version__,
              "transformers": transformers.__version__, "python": sys.version.split()[0], "releases": []}
    for v in versions:
        print(f"[trl_releases] trl {v}: installing and running {len(a.tests)} test file(s)", flush=True)
        target = None if v == pinned else install(v, a.work)
        row = run_release(v, target, a.tests, a.work, a.timeout)
        print(f"[trl_releases] trl {v}: {row.get('passed')} passed, {row.get('failed')} failed, "
              f"{row.get('errors')} errors, {len(row.get('seam_changed') or [])} seam items changed, "
              f"{row.get('wall_s')} s {row.get('error', '')}", flush=True)
        result["releases"].append(row)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")  # after every release
        a.out.with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
