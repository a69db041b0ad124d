"""The environment-cost model of the search comparison (envcost.py) on hand-made counts and curves, and the
summary's refusal of a comparison whose seeds ran different settings (no training here)."""

import json
import math
from dataclasses import asdict

import numpy as np
import pytest

from hdreplay_lab.sandbox import envcost
from hdreplay_lab.sandbox.compare import CompareConfig
from hdreplay_lab.sandbox.methods import get_methods
from hdreplay_lab.sandbox.summary import check_runs_agree


def test_wait_charges_the_latency_per_turn_or_per_call():
    assert envcost.wait_s(70, 2, 200.0, "per_turn") == pytest.approx(0.4)
    assert envcost.wait_s(70, 2, 200.0, "sequential") == pytest.approx(14.0)
    assert envcost.wait_s([70, 10], [2, 1], 0.0, "sequential").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="per_turn"):
        envcost.wait_s(1, 1, 1.0, "parallel")
    cost = {"cpu_s": 1.5, "tool_calls": 76.0, "tool_turns": 2.0}
    assert envcost.modelled_step_s(cost, 1000.0, "per_turn") == pytest.approx(3.5)
    assert envcost.modelled_step_s(cost, 50.0, "sequential") == pytest.approx(1.5 + 3.8)


def _arr(acc, cpu, turns, calls=None):
    """A method's curve arrays with identical seeds: acc / cpu / turns per evaluation point."""
    rows = lambda v: np.tile(np.asarray(v, dtype=float), (3, 1))  # noqa: E731
    return {"step": np.arange(len(acc)) * 10.0, "acc": rows(acc), "cpu": rows(cpu), "tool_turns": rows(turns),
            "tool_calls": rows(calls if calls is not None else [10 * t for t in turns])}


def test_time_to_target_is_linear_in_latency_and_interpolated_like_the_curve():
    a = _arr([0.3, 0.35, 0.45], [0.0, 10.0, 20.0], [0, 20, 40])
    c, u = envcost.reach_line(a, 0.4, "per_turn")  # halfway between points 1 and 2
    assert (c, u) == pytest.approx((15.0, 30.0))
    assert envcost.time_at((c, u), 200.0) == pytest.approx(15.0 + 30 * 0.2)
    assert envcost.reach_line(a, 0.4, "sequential") == pytest.approx((15.0, 300.0))
    assert envcost.reach_line(a, 0.5, "per_turn") is None and envcost.time_at(None, 50.0) is None


def test_crossover_latency_and_its_degenerate_cases():
    # HDR: 10 s of CPU and 20 turns to the target; the other: 5 s and 30 turns -> equal at 500 ms, HDR sooner above
    assert envcost.sooner_above((10.0, 20.0), (5.0, 30.0)) == pytest.approx(500.0)
    assert envcost.sooner_above((4.0, 20.0), (5.0, 30.0)) == 0.0  # cheaper on both: sooner at every latency
    assert envcost.sooner_above((4.0, 40.0), (5.0, 30.0)) == math.inf  # sooner only below 100 ms, not above
    assert envcost.sooner_above((6.0, 30.0), (5.0, 30.0)) == math.inf  # same waits, more CPU: never
    assert envcost.sooner_above(None, (5.0, 30.0)) == math.inf and envcost.sooner_above((1.0, 1.0), None) == 0.0
    hdr = _arr([0.3, 0.5], [0.0, 20.0], [0, 40])  # reaches 0.4 at C=10, U=20
    other = _arr([0.3, 0.5], [0.0, 10.0], [0, 60])  # C=5, U=30
    x = envcost.crossover(hdr, other, 0.4, "per_turn", reps=50)
    assert x["latency_ms"] == pytest.approx(500.0) and x["lo"] == pytest.approx(500.0) == x["hi"]
    assert x["never_share"] == 0.0 and x["line_a"] == pytest.approx((10.0, 20.0))
    # sequential charges calls: 200 vs 300 calls to the target -> 5 s / 100 calls = 50 ms
    assert envcost.crossover(hdr, other, 0.4, "sequential", reps=10)["latency_ms"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="paired seeds"):
        envcost.crossover(hdr, {k: v[:2] for k, v in other.items()}, 0.4, "per_turn")
    # neither reaches the target: no answer, not "never" (nan, kept out of the interval and of never_share)
    assert math.isnan(envcost.sooner_above(None, None))
    n = envcost.crossover(hdr, other, 0.9, "per_turn", reps=20)
    assert math.isnan(n["latency_ms"]) and math.isnan(n["lo"]) and n["neither_share"] == 1.0 and n["never_share"] == 0.0


def test_crossover_interval_widens_with_seeds_that_disagree():
    hdr = _arr([0.3, 0.5], [0.0, 20.0], [0, 40])
    other = _arr([0.3, 0.5], [0.0, 10.0], [0, 60])
    other["cpu"] = other["cpu"] * np.array([[0.6], [1.0], [1.4]])  # the other method's CPU differs by seed
    x = envcost.crossover(hdr, other, 0.4, "per_turn", reps=400)
    assert x["lo"] < x["latency_ms"] < x["hi"] and x["latency_ms"] == pytest.approx(500.0)


def test_step_time_table_ratios_and_paired_differences():
    costs = {"onpolicy_matched": [{"cpu_s": 1.0, "tool_calls": 70.0, "tool_turns": 2.0}] * 2,
             "headroom_drift": [{"cpu_s": 1.4, "tool_calls": 70.0, "tool_turns": 2.0},
                                {"cpu_s": 1.6, "tool_calls": 70.0, "tool_turns": 2.0}]}
    t = envcost.step_time_table(costs, [0.0, 1000.0], base="onpolicy_matched", reference="headroom_drift", reps=200)
    assert t["per_turn"]["0"]["headroom_drift"]["mean"] == pytest.approx(1.5)
    assert t["per_turn"]["1000"]["headroom_drift"]["ratio_to_base"] == pytest.approx(3.5 / 3.0)
    assert t["sequential"]["1000"]["onpolicy_matched"]["mean"] == pytest.approx(71.0)
    d = t["per_turn"]["0"]["onpolicy_matched"]["ref_minus"]  # Headroom-Drift minus on-policy b, per seed
    assert d["diff"] == pytest.approx(0.5) and d["lo"] <= 0.5 <= d["hi"]


def _fake_comparison(tmp_path, cfg):
    for m in get_methods(cfg.methods):
        for s in range(cfg.seeds):
            d = tmp_path / "runs" / m.name / f"seed{s}"
            d.mkdir(parents=True)
            spec = cfg.spec(m.name, s)
            d.joinpath("run.json").write_text(json.dumps({**asdict(spec), "label": m.label, "model": "/ws/search",
                                                          "dataset_prompts": spec.num_dataset_prompts(),
                                                          "torch_threads": 1}))


def test_a_comparison_whose_seeds_disagree_on_settings_refuses_to_summarize(tmp_path):
    cfg = CompareConfig(task="search", methods=("onpolicy_matched", "headroom_drift"), seeds=3, steps=5,
                        prompts_per_step=4, latency_ms=0.0)
    methods = get_methods(cfg.methods)
    _fake_comparison(tmp_path, cfg)
    check_runs_agree(tmp_path, cfg, methods)  # agreeing runs pass
    path = tmp_path / "runs" / "headroom_drift" / "seed2" / "run.json"
    good = path.read_text()
    run = json.loads(good)
    run["extra"]["latency_s"] = 0.2  # this seed slept 200 ms per call, the others none
    path.write_text(json.dumps(run))
    with pytest.raises(ValueError,
                       match=r"refusing to summarize .*headroom_drift/seed2 ran with extra\.latency_s=0\.2"):
        check_runs_agree(tmp_path, cfg, methods)
    run = json.loads(good)
    run["replay"]["tau"] = 0.1
    path.write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"seed2 ran with replay\.tau=0\.1 .* replay\.tau=0\.01"):
        check_runs_agree(tmp_path, cfg, methods)
    run = json.loads(good)
    run["model"] = "/another/warm/start"
    path.write_text(json.dumps(run))
    with pytest.raises(ValueError, match="different models"):
        check_runs_agree(tmp_path, cfg, methods)
    run = json.loads(good)
    run["added_later"] = 1  # a key the comparison does not know is not a disagreement
    path.write_text(json.dumps(run))
    check_runs_agree(tmp_path, cfg, methods)


def test_step_stats_count_tool_calls_turns_and_cpu_per_step_and_in_total():
    from hdreplay_lab.sandbox.instrument import StepStats

    s = StepStats(counts_tools=True, tool_calls=70, tool_turns=2, policy_tokens=1500, cpu_s=1.25)
    first = s.take()
    assert (first["tool_calls"], first["tool_turns"], first["policy_tokens"], first["cpu_s"]) == (70, 2, 1500, 1.25)
    second = s.take()  # a step without calls logs zeros, and the totals stay
    assert (second["tool_calls"], second["tool_turns"], second["cpu_s"]) == (0, 0, 0.0)
    s.tool_calls, s.tool_turns, s.cpu_s = 5, 1, 0.5
    s.take()
    assert s.cum == {"policy_tokens": 1500, "tool_calls": 75, "tool_turns": 3, "cpu_s": 1.75}
    assert "tool_calls" not in StepStats().take()  # a task without tools logs no tool counts
