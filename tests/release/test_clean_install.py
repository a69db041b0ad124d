"""Installable as released: build the wheel from this checkout, install it into a fresh venv (no system site packages,
nothing of the test environment) from hdreplay's own metadata and its ``[trl]`` extra, unconstrained, and run a short
TRL training through ``HDRGRPOTrainer`` there (tests/support/release_train.py: the README's example, tiny Qwen2 built
on the fly).  Only torch is installed first, pinned to the CPU build the constraints use (``torch==2.13.0``, a local
wheel here; an unpinned torch would download a multi-GB CUDA build): every other package is what pip resolves today
for ``hdreplay[trl]``.  The versions it resolved are printed to the terminal, and checked against what the package
declares (``pip check``).

It downloads trl / transformers / accelerate / datasets / tensorboard (and installs torch from its wheel), 2-3 minutes
on 2 cores: marked ``release`` and run once by ``make test`` (``make test-release``), not by ``make test-core``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

pytestmark = [pytest.mark.release, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "release_train.py"
TORCH = "torch==2.13.0"  # the constraints' CPU build (constraints.txt)
OFFLINE = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
                     r"Network is unreachable|ConnectTimeout|No route to host")


def run(cmd: list, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if p.returncode and OFFLINE.search(p.stderr):
        pytest.skip(f"the package index is unreachable: {OFFLINE.search(p.stderr).group(0)}")
    assert p.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def build_wheel(dest: Path) -> Path:
    """The wheel of this checkout, built as pip builds it (an isolated build environment with the build-system's
    requirements) from a copy of what the build reads (no stale build/ of the tree leaks in)."""
    src = dest / "src-copy"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", dest / "dist"], cwd=src, timeout=300)
    (wheel,) = (dest / "dist").glob("hdreplay-*.whl")
    return wheel


def test_the_wheel_installs_into_a_clean_venv_and_trains_through_hdrgrpo_trainer(tmp_path, capsys):
    t0 = time.perf_counter()
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=300)
    py = venv / "bin" / "python"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "install", "-q", "--no-compile", TORCH], timeout=900)
    run([*pip, "install", "-q", "--no-compile", f"{wheel}[trl]"], timeout=900)
    installed = time.perf_counter() - t0
    run([*pip, "check"], timeout=120)  # every requirement of what was installed is met
    out = run([py, DRIVER, tmp_path / "train"], cwd=tmp_path, timeout=900).stdout
    result = json.loads(out.strip().splitlines()[-1])
    v = result["versions"]
    with capsys.disabled():
        print(f"\n[clean install] {wheel.name}[trl] into a fresh venv in {installed:.0f} s, trained in "
              f"{time.perf_counter() - t0 - installed:.0f} s; resolved: "
              + ", ".join(f"{k} {v[k]}" for k in v), flush=True)
    # the released package, not the checkout, and what its metadata pins
    assert Path(result["hdreplay_file"]).is_relative_to(venv), result["hdreplay_file"]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert v["hdreplay"] == declared and v["torch"].startswith("2.13.0") and v["trl"].startswith("1.16.")
    assert v["tensorboard"] is not None  # the [trl] extra covers the README's report_to="tensorboard"
    # three optimizer steps through HDRGRPOTrainer, the replay step running in them, logged where the README says
    assert result["global_step"] == 3 and len(result["loss"]) == 3
    assert result["buffer_size"][0] == 0 and max(result["accepted"]) > 0  # replay rows trained after the first step
    assert {"train/replay/accepted", "train/replay/buffer_size", "train/loss"} <= set(result["tensorboard_tags"])
    assert result["steps_jsonl_lines"] == 3 and result["train_log_lines"] == 3
