"""The ``search_mix`` setting (issue 38): its question mix, and the refusal of a warm start whose zero-variance share
lies outside the band the setting asks for, before any run (no training here)."""

import json

import pytest

from hdreplay_lab.sandbox.compare import CompareConfig, run_compare
from hdreplay_lab.sandbox.search import KB, make_search_problem
from hdreplay_lab.sandbox.tasks import get_task
from hdreplay_lab.sandbox.warmstart import RegimeOutOfBand, check_regime


def test_search_mix_spans_one_to_three_lookups_and_asks_for_the_papers_band():
    task = get_task("search_mix")
    assert task.is_multiturn and task.max_tool_calls == 3 and task.zero_variance_band == (0.40, 0.60)
    assert "zero_variance_target" not in dict(task.warmstart_overrides)  # the accuracy stop; the mix sets the share
    assert [b.kind for b in task.benchmarks] == ["hop1", "boss", "hop2", "hop3"]
    probs = task.train_problems(200, seed=0)
    assert {len(p.hops) for p in probs} == {1, 2, 3}
    # the warm start demonstrates one and two lookups; a third is left for GRPO to discover (the all-wrong end)
    assert {len(p.hops) for p in task.warmstart_problems(200, seed=0)} == {1, 2}
    # the warm start records the share of this mix: another mix must not reuse its cache entry
    from dataclasses import replace

    from hdreplay_lab.sandbox.warmstart import WarmStartConfig

    assert WarmStartConfig().key(task) != WarmStartConfig().key(replace(task, train_kinds=("hop1", "hop3")))
    assert sum(len(p.hops) == 3 for p in probs) / len(probs) == pytest.approx(0.5, abs=0.1)  # half are three-hop
    held = task.heldout_prompts()
    assert not held & {p.question for p in probs}  # benchmark entities never asked in training
    e = sorted(KB.facts)[3]
    p = make_search_problem("hop3", e)
    b = KB.facts[e]["boss"]
    bb = KB.facts[b]["boss"]
    assert p.question == f"city of boss of boss of {e}?" and p.hops == (e, b, bb) and p.answer == KB.facts[bb]["city"]
    calls = [m for m in task.conversation(p) if m.get("tool_calls")]
    assert [c["tool_calls"][0]["function"]["arguments"]["q"] for c in calls] == [e, b, bb]
    assert get_task("search").zero_variance_band is None  # the 6 % regime asks for no band


def _model_dir(parent, share):
    d = parent / "ws"
    d.mkdir(parents=True)
    (d / "warmstart.json").write_text(json.dumps({"zero_variance_share": share}))
    return d


def test_check_regime_names_the_measured_share_outside_the_band(tmp_path):
    task = get_task("search_mix")
    with pytest.raises(RegimeOutOfBand,
                       match=r"search_mix: 12% of fresh groups are zero-variance.*outside the 40%-60%"):
        check_regime(task, _model_dir(tmp_path, 0.12), log=lambda *_: None)
    assert check_regime(task, _model_dir(tmp_path / "in", 0.47), log=lambda *_: None) == pytest.approx(0.47)
    # the 6 % regime asks for no band: nothing is measured or refused
    assert check_regime(get_task("search"), _model_dir(tmp_path / "plain", 0.06), log=lambda *_: None) is None


def test_compare_stops_before_any_run_when_the_regime_is_missed(tmp_path):
    cfg = CompareConfig(task="search_mix", seeds=1, steps=1, prompts_per_step=2, signatures=False, workers=1)
    out = tmp_path / "out"
    with pytest.raises(RegimeOutOfBand, match="71% of fresh groups"):
        run_compare(cfg, out, model_dir=_model_dir(tmp_path, 0.71), progress=False, log=lambda *_: None)
    assert not (out / "runs").exists() and not (out / "summary.md").exists()


def test_interval_regime_averages_each_run_then_the_seeds():
    from hdreplay_lab.sandbox.regime import interval_regime

    a = {"series": {"step": [1, 2, 3, 4], "zero_variance_share": [0.5, 0.5, 0.25, None],
                    "replay_step": [1, 2, 3, 4], "acceptance": [0.2, 0.4, 0.1, 0.1], "scanned": [8, 10, 12, 12]}}
    b = {"series": {"step": [1, 2, 3, 4], "zero_variance_share": [0.0, 1.0, 0.75, 0.75]}}  # on-policy: no gate
    rows = interval_regime([a, b], 4, 2)
    assert [r["steps"] for r in rows] == [[1, 2], [3, 4]]
    assert rows[0]["zero_variance_share"] == pytest.approx(0.5) and rows[1]["zero_variance_share"] == pytest.approx(0.5)
    assert rows[0]["acceptance"] == pytest.approx(0.3) and rows[1]["scanned"] == pytest.approx(12)
    assert interval_regime([b], 3, 2)[1] == {"steps": [3, 3], "zero_variance_share": 0.75, "acceptance": None,
                                             "scanned": None}
    with pytest.raises(ValueError, match="width"):
        interval_regime([a], 4, 0)


def test_best_at_n_per_prompt_is_any_right_for_0_1_rewards():
    from hdreplay_lab.sandbox.evaluate import best_at_n
    from hdreplay_lab.sandbox.summary import _prompt_scores

    scores = [[0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]  # one benchmark, 3 prompts, n = 4
    runs = [{"benchmarks": {"b": {"prompt_mean": [sum(s) / 4 for s in scores]}}}]
    best = _prompt_scores(runs, best=True)["b"]
    assert best.tolist() == [[1.0, 0.0, 1.0]] and best.mean() == pytest.approx(best_at_n(scores))
