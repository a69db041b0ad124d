"""benchmarks/bf16_floor.py runs end to end on tiny models (--tiny), so it cannot rot, and measures what it says: every
layout, the prompt-shared re-score included, reproduces the birth log-probs in fp32 (the floor is a precision effect),
and bf16 (autocast or weights) does not."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.trl
pytest.importorskip("trl")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
LAYOUTS = {"batch", "padding", "chunking", "shared_prompt"}


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_bf16_floor", BENCH / "bf16_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bf16_floor_tiny_writes_its_results_and_fp32_is_the_zero_control(tmp_path):
    _bench().main(["--tiny", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "bf16_floor_tiny.json").read_text())
    assert (tmp_path / "bf16_floor_tiny.png").stat().st_size > 0
    md = (tmp_path / "bf16_floor_tiny.md").read_text()
    assert "python benchmarks/bf16_floor.py --tiny" in md and "## Verdict" in md
    assert saved["models"]["sandbox"]["source"].startswith("random-init")  # --tiny never uses a cached warm start
    for name in ("sandbox", "qwen0.1b"):
        res = saved["results"][name]
        assert set(res) == set(saved["models"][name]["modes"]) and {"fp32", "bf16_weights"} <= set(res)
        worst = {}
        for mode, r in res.items():
            assert set(r["l2"]["settings"]) == LAYOUTS | {"all"} and set(r["l1"]) == LAYOUTS | {"all"}
            assert all(len(v) == saved["models"][name]["groups"] for v in r["per_group"]["l2"].values())
            for s in r["l2"]["settings"].values():
                assert 0.0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
            worst[mode] = max(max(v) for v in r["per_group"]["l2"].values())
            assert r["l2"]["settings"]["all"]["max"] == pytest.approx(worst[mode])
        # fp32: every layout, the prompt-shared path included, gives the birth log-probs up to float round-off
        assert worst["fp32"] < 1e-9 and max(res["fp32"]["per_group"]["l2"]["shared_prompt"]) < 1e-9
        assert all(worst[m] > 100 * worst["fp32"] for m in res if m != "fp32")
