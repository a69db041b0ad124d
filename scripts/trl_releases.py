"""Run the TRL test subset against every trl release from --since on that the package index offers.

    nice -n 10 .venv/bin/python scripts/trl_releases.py                     # every release >= 1.14, default subset
    .venv/bin/python scripts/trl_releases.py --versions 1.15.0 --tests tests/trl/test_trl_plan.py
    .venv/bin/python scripts/trl_releases.py --versions 1.16.0 --transformers 5.24.0 --merge   # a newer transformers

Each release is installed with ``pip install --no-deps --target <work>/trl-X trl==X`` and put first on PYTHONPATH, so it
shadows the shared .venv's trl while reusing every other package of the .venv (torch, transformers, accelerate, ...)
as it is: nothing is downloaded but TRL, and the .venv is not touched.  ``trl.__version__`` is checked inside before
the tests run; the release the .venv pins (1.16.0) runs from the .venv itself.  ``HDREPLAY_UNTESTED_TRL=1`` lets
``hdreplay.integrations.trl`` import under another release (it refuses by default).  When ``from trl import
GRPOTrainer`` fails for a module that neither trl's declared requirements nor the .venv provide, that module is
installed into the release's folder too (listed in the table).  ``--transformers X`` does the same for transformers
(``--no-deps --target <work>/transformers-X``, ahead of the .venv's for every release run); its requirements the .venv
does not meet are listed with trl's.  ``--merge`` keeps the rows of ``<out>.json`` for other (trl, transformers) pairs,
and the notes below ``## Reading it`` in ``<out>.md`` are kept across regenerations.

Per release: the tests passed / failed / errored / skipped (pytest's JUnit XML), the failing tests with the first
line of their error, the seam items whose signature or source differ from the record (tests/trl/data/trl_seam.json,
see tests/support/trl_seam.py) and, apart, the lab's own items that differ, TRL's own requirements that the .venv does
not satisfy, and the wall time.  Writes
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
changed = lambda section: [{"key": c.key, "kind": c.kind, "what": c.what} for c in trl_seam.compare(rec, section)]
print(json.dumps({"trl": trl.__version__, "reference": rec["recorded_with"]["trl"], "changed": changed("items"),
                  "lab_changed": changed("lab")}))
"""


def index_versions(package: str = "trl") -> list[str]:
    """The versions the package index offers (``pip index versions``)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("Available versions:")), None)
    if line is None:
        raise RuntimeError(f"pip index versions {package} gave no 'Available versions:' line:\n{out}")
    return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]


def install(version: str, work: Path, package: str = "trl") -> Path:
    """package==version (no dependencies) in a folder of its own; reused when already there."""
    target = work / f"{package}-{version}"
    if not (target / package / "__init__.py").is_file():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "--target", str(target), f"{package}=={version}"], check=True)
    return target


def unmet_requirements(target: Path | None, package: str = "trl") -> list[str]:
    """The package's unconditional requirements (its METADATA) that the .venv's installed versions do not satisfy."""
    dists = list(target.glob(f"{package}-*.dist-info")) if target else []
    dist = metadata.PathDistribution(dists[0]) if dists else metadata.distribution(package)
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


def run_release(version: str, target: Path | None, tests: list[str], work: Path, timeout: float,
                transformers_dir: Path | None = None) -> dict:
    env = dict(os.environ, HDREPLAY_UNTESTED_TRL="1", PYTHONPATH=os.pathsep.join(
        [str(d) for d in (target, transformers_dir) if d] + [str(ROOT / "src")]))
    row: dict = {"version": version, "unmet_requirements": unmet_requirements(target) + [
        f"transformers: {r}"
        for r in (unmet_requirements(transformers_dir, "transformers") if transformers_dir else [])]}
    t0 = time.perf_counter()
    got = subprocess.run([sys.executable, "-c", "import trl, transformers; print(trl.__version__, "
                          "transformers.__version__)"], env=env, cwd=ROOT, capture_output=True, text=True)
    seen = got.stdout.split()
    row["trl_version_seen"] = seen[0] if len(seen) == 2 else "".join(got.stderr.strip().splitlines()[-1:])
    row["transformers"] = seen[1] if len(seen) == 2 else None
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
        diff = json.loads(seam.stdout.strip().splitlines()[-1])
        row["seam_changed"], row["lab_changed"] = diff["changed"], diff["lab_changed"]
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


def _label(r: dict, result: dict) -> str:
    pinned = r["version"] == result["pinned"] and r["transformers"] == result["pinned_transformers"]
    return f"trl {r['version']} / transformers {r['transformers']}{' (pinned)' if pinned else ''}"


def _items(changed: list | None, error: str | None = None) -> str:
    if changed is None:
        return error or "?"
    return "none" if not changed else "<br>".join(
        f"`{c['key']}` ({', '.join(w.split(' ')[0].rstrip(':') for w in c['what'])})" for c in changed)


def markdown(result: dict, notes: str = "") -> str:
    """The tables and lists of ``result``; ``notes`` (the hand-written ``## Reading it`` part) appended as is."""
    rows = result["releases"]
    out = ["# The TRL test subset against trl and transformers releases", ""]
    for run in result["runs"]:
        out.append(f"Command: `{run['command']}` (hdreplay {run['commit']}, {run['date']}; torch {run['torch']}, "
                   f"Python {run['python']}; rows with transformers {run['transformers']}).")
    out += [
        "",
        f"The pin: trl {result['pinned']}, transformers {result['pinned_transformers']} (constraints.txt). Each other "
        "trl release, and each other transformers release, is installed without dependencies ahead of the shared "
        ".venv (`HDREPLAY_UNTESTED_TRL=1` for another trl); everything else is the .venv's.",
        f"Subset: {', '.join('`' + t + '`' for t in result['tests'])}. Seam items: the recorded overrides and private "
        f"uses of the library (`tests/trl/data/trl_seam.json`, recorded against trl {result['reference']}) whose "
        "signature or source differ in that pair; lab items: the same for what only the lab (`hdreplay_lab`) uses, "
        "recorded apart. Wall time includes the seam check and pytest's start-up on a shared, loaded 2-core machine.",
        "",
        "| trl / transformers | passed | failed | errors | skipped | seam items changed vs the record | lab-only items "
        "changed | requirements the .venv does not meet | also in the release's folder (for `from trl import "
        "GRPOTrainer`) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {_label(r, result).removeprefix('trl ').replace(' / transformers ', ' / ')} | "
                   f"{r.get('passed', '-')} | {r.get('failed', '-')} | {r.get('errors', '-')} | "
                   f"{r.get('skipped', '-')} | {_items(r.get('seam_changed'), r.get('seam_error'))} | "
                   f"{_items(r.get('lab_changed'), r.get('seam_error'))} | "
                   f"{'<br>'.join(r['unmet_requirements']) or 'none'} | "
                   f"{', '.join(r.get('installed_for_import') or []) or 'none'} | {r.get('wall_s', '-')} |")
    out += ["", "## Seam and lab changes, by release", "",
            "Each recorded item whose fingerprint differs from the record: signature (old -> new), source (normalized "
            "source hash, old -> new), owner (the class that defines it), missing (absent in that release).", ""]
    for r in rows:
        for section, what in (("seam_changed", "seam"), ("lab_changed", "lab only")):
            for c in r.get(section) or []:
                out.append(f"* **{_label(r, result)}** `{c['key']}` ({c['kind']}, {what}): {'; '.join(c['what'])}")
    out += ["", "## What failed, by release", ""]
    for r in rows:
        label = _label(r, result)
        if r.get("error"):
            out.append(f"* **{label}**: {r['error']}")
        fails = r.get("failures") or []
        by_message: dict[str, list[str]] = {}
        for f in fails:
            by_message.setdefault(f"{f['kind']}: {f['message']}", []).append(f["test"].rsplit("::", 1)[-1])
        for msg, tests in by_message.items():
            out.append(f"* **{label}** ({len(tests)}: {', '.join(tests[:6])}{', ...' if len(tests) > 6 else ''}"
                       f"): `{msg}`")
        if not fails and not r.get("error"):
            out.append(f"* **{label}**: nothing")
    return "\n".join(out) + "\n" + (f"\n{notes.strip()}\n" if notes.strip() else "")


def upgrade(result: dict, lab_keys: set[str]) -> dict:
    """A result written before rows carried their transformers and before the record kept the lab apart: every row
    gets the run's transformers, and its recorded changes of lab-only items move to ``lab_changed``."""
    if "runs" not in result:
        result["runs"] = [{k: result.pop(k) for k in ("command", "commit", "date", "torch", "transformers", "python")}]
        result["pinned_transformers"] = result["runs"][0]["transformers"]
    for r in result["releases"]:
        r.setdefault("transformers", result["runs"][0]["transformers"])
        if "lab_changed" not in r and r.get("seam_changed") is not None:
            r["lab_changed"] = [c for c in r["seam_changed"] if c["key"] in lab_keys]
            r["seam_changed"] = [c for c in r["seam_changed"] if c["key"] not in lab_keys]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--since", default="1.14", help="oldest release to run (inclusive)")
    p.add_argument("--versions", nargs="*", help="these releases instead of the index's")
    p.add_argument("--transformers", default=None,
                   help="run against this transformers release (installed without dependencies ahead of the .venv's)")
    p.add_argument("--merge", action="store_true",
                   help="keep <out>.json's rows of other (trl, transformers) pairs instead of starting afresh")
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
    record = trl_seam.load_record()
    tf_version = a.transformers or transformers.__version__
    run = {"command": "python scripts/trl_releases.py " + " ".join(args), "commit": commit,
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": tf_version,
           "python": sys.version.split()[0]}
    result = {"pinned": pinned, "pinned_transformers": transformers.__version__,
              "reference": record["recorded_with"]["trl"], "tests": a.tests, "runs": [], "releases": []}
    json_out, md_out = a.out.with_suffix(".json"), a.out.with_suffix(".md")
    if a.merge and json_out.is_file():
        result = upgrade(json.loads(json_out.read_text()), set(record.get("lab", {})))
        result["releases"] = [r for r in result["releases"]
                              if not (r["version"] in versions and r["transformers"] == tf_version)]
    result["runs"].append(run)
    notes = md_out.read_text().partition("\n## Reading it")[1:] if md_out.is_file() else ("", "")
    notes = "".join(notes).strip()
    tf_dir = (install(a.transformers, a.work, "transformers")
              if a.transformers not in (None, transformers.__version__) else None)
    for v in versions:
        print(f"[trl_releases] trl {v}, transformers {tf_version}: installing and running {len(a.tests)} test file(s)",
              flush=True)
        target = None if v == pinned else install(v, a.work)
        row = run_release(v, target, a.tests, a.work, a.timeout, tf_dir)
        print(f"[trl_releases] trl {v}, transformers {row.get('transformers')}: {row.get('passed')} passed, "
              f"{row.get('failed')} failed, {row.get('errors')} errors, {len(row.get('seam_changed') or [])} seam "
              f"items changed, {row.get('wall_s')} s {row.get('error', '')}", flush=True)
        result["releases"].append(row)
        result["releases"].sort(key=lambda r: (Version(r["transformers"] or "0"), Version(r["version"])))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=1) + "\n")  # after every release
        md_out.write_text(markdown(result, notes))
    return result


if __name__ == "__main__":
    main()
