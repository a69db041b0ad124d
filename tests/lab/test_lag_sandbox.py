"""The policy-lag sandbox (hdreplay compare-async): the modelled pipeline, one tiny run per rule, the CLI's refusals,
and the ledger section of ``hdreplay report``."""

import json

import numpy as np
import pytest

from hdreplay_lab.sandbox.lag.methods import ASYNC_METHODS
from hdreplay_lab.sandbox.lag.pipeline import Pipeline, PipelineConfig


def test_long_completions_arrive_later_and_the_throttle_holds_generation_back():
    cfg = PipelineConfig(slots=4, gen_fixed_ms=100, gen_ms_per_token=50, jitter_sigma=0.0)
    rng = np.random.default_rng(0)
    assert cfg.duration_ms(10, rng) == 600 and cfg.duration_ms(2, rng) == 200
    pipe = Pipeline(cfg, budget=100, rng=rng, throttle=1, groups_per_step=1)
    n = 0
    while pipe.can_dispatch(version=0):
        pipe.dispatch(0.0, f"g{n}", 2)
        n += 1
    assert n == 2  # (0 + eta + 1) * b = 2 groups ahead at version 0, although 4 slots are free
    assert pipe.can_dispatch(version=1)
    t, g = pipe.pop()
    assert (t, g) == (200.0, "g0") and pipe.free == 3
    with pytest.raises(ValueError, match="--slots must be an integer >= 1"):
        PipelineConfig(slots=0)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from hdreplay_lab.sandbox.lag.run import LagRunSpec, run_lag
    from hdreplay_lab.sandbox.model import build_tiny_model
    from hdreplay_lab.sandbox.tasks import get_task

    root = tmp_path_factory.mktemp("lag")
    model = build_tiny_model(root / "model", chars=get_task("add").vocab, hidden=32, layers=1)
    out = {}
    for m in ("age1", "gated", "wait"):
        spec = LagRunSpec(task="add", method=m, seed=0, groups=40, prompts_per_step=4, generations=4, eval_n=1,
                          pool=4, pipeline={"slots": 12})
        out[m] = (run_lag(spec, ASYNC_METHODS[m], model, root / m), root / m)
    return out


def _ledger(run_dir):
    return [json.loads(x) for x in open(run_dir / "async.jsonl")]


def test_every_generated_group_is_routed_once_and_the_rules_hold(tiny_runs):
    for m, (metrics, run_dir) in tiny_runs.items():
        t = metrics["totals"]
        assert t["generated_groups"] == 40 == sum(metrics["lags"])  # the equal budget, every group routed
        assert t["generated_groups"] == t["fresh_groups"] + t["diverted_groups"] + t["dropped_groups"]
        ages = {k: {int(a) for r in _ledger(run_dir) for a in r["ages"][k]} for k in ("fresh", "dropped", "diverted")}
        if m == "age1":
            assert ages["fresh"] <= {0, 1} and all(a > 1 for a in ages["dropped"]) and not ages["diverted"]
        if m == "gated":
            assert ages["fresh"] <= {0, 1} and all(a > 1 for a in ages["diverted"] | ages["dropped"])
            assert metrics["floor"] is not None
        if m == "wait":
            assert t["dropped_groups"] == 0 and t["fresh_groups"] == 40
    # the same budget for every rule: age-drop discards what arrives stale, so it takes fewer updates than wait
    assert tiny_runs["age1"][0]["steps"] <= tiny_runs["wait"][0]["steps"]


def test_report_shows_the_ledger(tiny_runs, tmp_path):
    from hdreplay_lab.analysis import build_report, load_run, write_report

    _, run_dir = tiny_runs["gated"]
    rep = build_report([load_run(run_dir, label="gated", warn=False)])
    sec = rep["runs"]["gated"]["async_ledger"]
    assert sec["available"] and sec["totals"]["generated_groups"] == 40
    s = sec["share"]
    assert s["fresh"] + s["diverted"] + s["dropped"] == pytest.approx(1.0)
    paths = write_report(rep, tmp_path, figures=False)
    assert "## 11. Asynchronous pipeline: where generated groups went" in paths["markdown"].read_text()
    unavailable = build_report([load_run(tiny_runs["gated"][1] / "replay", label="bare", warn=False)])
    assert not unavailable["runs"]["bare"]["async_ledger"]["available"]
    # a rule without replay writes no trainer log and no step records: its ledger alone makes it a run to report
    age1 = load_run(tiny_runs["age1"][1], label="age1", warn=False)
    assert not age1.has_replay and not age1.problems
    assert build_report([age1])["runs"]["age1"]["async_ledger"]["totals"]["generated_groups"] == 40


@pytest.mark.parametrize("argv,match", [
    (["--seeds", "1"], "--seeds must be an integer >= 2"),
    (["--task", "search"], "runs single-turn text tasks"),
    (["--methods", "age1,nope"], "unknown method"),
    (["--prompts-per-step", "5"], "must be even"),
    (["--slots", "0"], "--slots must be an integer >= 1"),
])
def test_compare_async_refuses_bad_input(argv, match, capsys, tmp_path):
    from hdreplay_lab.cli import main

    assert main(["compare-async", "--out", str(tmp_path / "o"), *argv]) == 2
    assert match in capsys.readouterr().err
