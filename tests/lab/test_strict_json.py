"""Result files are strict JSON: no NaN / Infinity tokens, which jq, JSON.parse and strict readers reject."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hdreplay_lab import jsonout

ROOT = Path(__file__).resolve().parents[2]


def strict_loads(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_or_named_infinities_and_the_rest_is_unchanged():
    obj = {"nan": float("nan"), "inf": math.inf, "ninf": -math.inf, "np": np.float64("inf"), "ok": 1.5,
           "nested": [np.array([1.0, np.nan]), (np.int64(3), True, None, "x")], "bool": np.bool_(True)}
    got = strict_loads(jsonout.dumps(obj))
    assert got == {"nan": None, "inf": "inf", "ninf": "-inf", "np": "inf", "ok": 1.5,
                   "nested": [[1.0, None], [3, True, None, "x"]], "bool": True}
    assert float(got["inf"]) == math.inf and float(got["ninf"]) == -math.inf  # read back as numbers


def test_python_json_alone_would_write_tokens_strict_readers_refuse():
    with pytest.raises(ValueError, match="Infinity"):
        strict_loads(json.dumps({"x": math.inf}))


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for d in ("docs/results", "benchmarks/results")
                                        for p in (ROOT / d).rglob("*.json")), ids=str)
def test_committed_result_files_are_strict_json(path):
    strict_loads((ROOT / path).read_text())
