"""Sandbox pieces: metrics against hand-computed values, rewards, ingress on the multi-reward task, warm start."""

import json

import pytest

from hdreplay import AnswerBased, MixedOutcome, ReplayConfig, ReplayController
from hdreplay_lab.sandbox.evaluate import best_at_n, macro_average, mean_at_n, weighted_average
from hdreplay_lab.sandbox.methods import METHODS, get_methods
from hdreplay_lab.sandbox.tasks import TASKS, answer_and_format, exact_match, get_task, parse_answer
from hdreplay_lab.synthetic import TablePolicy, make_group


def test_mean_and_best_at_n_by_hand():
    scores = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert mean_at_n(scores) == pytest.approx((0.5 + 0.0 + 0.75) / 3)
    assert best_at_n(scores) == pytest.approx(2 / 3)
    multi = [[0.1, 0.9], [0.0, 1.0]]
    assert mean_at_n(multi) == pytest.approx((0.5 + 0.5) / 2) and best_at_n(multi) == pytest.approx(0.95)
    with pytest.raises(ValueError):
        mean_at_n([])


def test_macro_vs_weighted_by_hand():
    vals, sizes = {"a": 0.5, "b": 0.2}, {"a": 300, "b": 100}
    assert macro_average(vals) == pytest.approx(0.35)
    assert weighted_average(vals, sizes) == pytest.approx((0.5 * 300 + 0.2 * 100) / 400)


@pytest.mark.parametrize("completion, answer, em, mixed", [
    ("46", "46", 1.0, 0.9), ("46.", "46", 1.0, 1.0), ("45.", "46", 0.0, 0.1), ("45", "46", 0.0, 0.0),
    ("46x", "46", 0.0, 0.9), ("", "46", 0.0, 0.0), (" 46.", "46", 1.0, 1.0), ("-3.", "-3", 1.0, 1.0),
    ("46..", "46", 0.0, 0.9), ("x46.", "46", 0.0, 0.0),
])
def test_rewards(completion, answer, em, mixed):
    assert exact_match(completion, answer) == em
    assert answer_and_format(completion, answer) == mixed


def test_parse_answer():
    assert parse_answer("12.") == ("12", True)
    assert parse_answer("12") == ("12", False)
    assert parse_answer("abc") == (None, False)


def test_answer_based_ingress_on_the_multi_reward_task():
    task = get_task("multi_reward")
    assert task.answer_threshold == 0.9
    pol = TablePolicy()
    # rewards from the task's own reward function on real completions
    def group(comps, answer="46"):
        r = [task.score(c, answer) for c in comps]
        return make_group(str(comps), policy=pol, step=0, rewards=r)
    format_only = group(["45.", "44", "45", "1."])           # 0.1/0.0 only: no answer variation
    answer_mixed = group(["46.", "45.", "46", "3"])           # right and wrong answers
    all_right = group(["46.", "46", "46.", "46"])             # 1.0/0.9 only
    gs = [format_only, answer_mixed, all_right]
    assert [MixedOutcome()(g) for g in gs] == [True, True, True]
    assert [AnswerBased(0.9)(g) for g in gs] == [False, True, False]
    ctrl = ReplayController(ReplayConfig(ingress="answer", answer_threshold=task.answer_threshold))
    assert ctrl.stage(gs, step=0) == [False, True, False]


def test_tasks_hold_out_their_benchmarks_and_validate_names():
    for task in (t for t in TASKS.values() if not getattr(t, "is_multimodal", False)):  # geo: tests/lab/test_geo.py
        key = (lambda p: p.question) if task.is_multiturn else (lambda p: p.prompt)  # noqa: E731
        perfect = ((lambda p: [{"role": "assistant", "content": p.answer}]) if task.is_multiturn
                   else (lambda p: p.answer + "."))  # noqa: E731
        held = task.heldout_prompts()
        assert not held & {key(p) for p in task.train_problems(2000, seed=0)}
        for b in task.benchmarks:
            probs = task.benchmark_problems(b)
            assert len(probs) == b.size == len({key(p) for p in probs})
            assert all(task.score(perfect(p), p.answer) == 1.0 for p in probs)
    with pytest.raises(ValueError, match="valid tasks"):
        get_task("algebra")
    with pytest.raises(ValueError, match="valid methods"):
        get_methods(["onpolicy_matched", "per"])


def test_method_budgets():
    b = 16
    assert METHODS["onpolicy_larger"].fresh_groups(b) == 24
    assert METHODS["headroom_drift"].replay_groups(b) == 8
    assert METHODS["recency_larger"].replay_groups(b) == 16
    with pytest.raises(ValueError, match="even"):
        METHODS["headroom_drift"].replay_groups(7)


@pytest.mark.trl
def test_warm_start_is_cached_and_loads_through_from_pretrained(tmp_path):
    import random

    import torch

    from hdreplay_lab.sandbox.model import build_tiny_model, load_model
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, _batch, warm_start

    task = get_task("add")
    cfg = WarmStartConfig(hidden=32, layers=1, max_steps=20, eval_every=10, eval_prompts=4, eval_n=2, target=1.1)
    logs = []
    d = warm_start(task, tmp_path, cfg, log=logs.append)
    meta = json.loads((d / "warmstart.json").read_text())
    assert meta["steps"] == 20 and [h["step"] for h in meta["history"]] == [10, 20] and len(logs) == 2
    again = warm_start(task, tmp_path, cfg, log=logs.append)
    assert again == d and len(logs) == 2  # reused, not retrained
    model, tok = load_model(d)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.decode(tok("12+3=").input_ids) == "12+3="
    # it learned: on held-out problems the saved model's answer loss is below the same-seed untrained model's
    untrained, _ = load_model(build_tiny_model(tmp_path / "init", chars=task.vocab, hidden=32, layers=1,
                                               heads=cfg.heads, kv_heads=cfg.kv_heads, seed=cfg.seed,
                                               max_positions=512))
    batch = _batch(tok, task, task.benchmark_problems(task.benchmarks[0])[:64], random.Random(1))
    with torch.no_grad():
        losses = [m(**batch).loss.item() for m in (model, untrained)]
    # the checkpoint holds the trained weights (a save of the initial weights, or a reload that re-initialises, fails
    # here); comparing its recorded Mean@n with a re-evaluation could not show that: 20 steps of a tiny model score
    # 0.0 whatever was saved
    assert losses[0] < 0.9 * losses[1], losses  # measured: 2.46 vs 2.92


@pytest.mark.trl
def test_warm_start_can_stop_at_a_zero_variance_share(tmp_path, monkeypatch):
    """The regime is calibrated directly: stop at the first check whose share of zero-variance groups is <= the
    target.  The share recorded at each check is a share of the 6 probe prompts and what the saved model scores.
    The stop rule is then driven with shares the probe reports (the tiny model barely trained for a test gives 1.0 at
    every check, which cannot tell <= from < or a target from the share): it stops exactly at the first check at or
    below the target."""
    from hdreplay_lab.sandbox import warmstart
    from hdreplay_lab.sandbox.model import load_model
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, warm_start, zero_variance_share

    small = dict(hidden=32, layers=1, max_steps=30, eval_every=10, eval_prompts=4, eval_n=2, zero_variance_prompts=6,
                 zero_variance_n=3)
    task = get_task("mix")
    cfg = WarmStartConfig(zero_variance_target=-1.0, **small)
    meta = json.loads((warm_start(task, tmp_path / "never", cfg, log=lambda *_: None) / "warmstart.json").read_text())
    assert meta["steps"] == 30 and [("mean_at_n" in h) for h in meta["history"]] == [False, False, True]
    shares = [h["zero_variance_share"] for h in meta["history"]]
    assert all(round(s * 6) == pytest.approx(s * 6) for s in shares), shares  # a share of 6 probe prompts
    model, tok = load_model(tmp_path / "never" / cfg.key(task))
    assert zero_variance_share(model, tok, task, cfg) == shares[-1] == meta["zero_variance_share"]

    def stops_at(probe: list[float], target: float) -> int:
        reported = iter(probe)
        monkeypatch.setattr(warmstart, "zero_variance_share", lambda *a: next(reported))
        out = warm_start(task, tmp_path / f"t{target}-{probe}", WarmStartConfig(zero_variance_target=target, **small),
                         log=lambda *_: None)
        meta = json.loads((out / "warmstart.json").read_text())
        assert [h["zero_variance_share"] for h in meta["history"]] == probe[:len(meta["history"])]
        assert "mean_at_n" in meta["history"][-1] and meta["zero_variance_share"] == meta["history"][-1][
            "zero_variance_share"]
        return meta["steps"]

    assert stops_at([4 / 6, 2 / 6, 1 / 6], target=2 / 6) == 20  # <=: the share equal to the target stops
    assert stops_at([4 / 6, 3 / 6, 3 / 6], target=2 / 6) == 30  # never at or below: max_steps
    assert stops_at([1 / 6, 0.0, 0.0], target=2 / 6) == 10


def test_a_comparison_written_before_a_setting_existed_is_reused_with_that_setting_at_its_default(tmp_path):
    """compare.json from before ``train_pool`` existed still identifies the same comparison (its runs did the
    default); a real difference is still refused, naming the setting."""
    import json

    import pytest

    from hdreplay_lab.sandbox.compare import CompareConfig, _marker, check_out_dir

    marker = _marker(CompareConfig(task="add", seeds=2))
    del marker["config"]["train_pool"]
    (tmp_path / "compare.json").write_text(json.dumps(marker))
    assert check_out_dir(tmp_path, CompareConfig(task="add", seeds=5), overwrite=False) is False  # seeds: neutral
    with pytest.raises(FileExistsError, match="train_pool"):
        check_out_dir(tmp_path, CompareConfig(task="add", train_pool=100), overwrite=False)
