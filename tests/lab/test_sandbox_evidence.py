"""The comparison's evidence machinery: regime numbers, curves, thread settings, prompt order, resuming."""

import json
import os

import numpy as np
import pytest

from hdreplay_lab.env import DEFAULT_THREADS, THREADS_ENV, configure_threads, sandbox_threads
from hdreplay_lab.sandbox.curves import auc, cost_to_target, first_reach, method_curve, wall_at_cost
from hdreplay_lab.sandbox.instrument import StepStats, zero_variance_groups
from hdreplay_lab.sandbox.regime import generation_share, method_regime, run_regime


def test_zero_variance_groups_by_hand():
    # groups of 4: all right, all wrong, mixed, all 0.9 (equal), 1e-12 apart (equal)
    r = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5 + 1e-12, 0.5, 0.5]
    assert zero_variance_groups(r, 4) == 4
    assert zero_variance_groups([0, 1], 2) == 0
    with pytest.raises(ValueError, match="groups of n=3"):
        zero_variance_groups([0, 1, 1, 0], 3)


def test_step_stats_reset_and_accumulate():
    s = StepStats(gen_s=0.5, gen_tokens=10, groups=4, zero_var_groups=1, prompts=["a"])
    first = s.take()
    assert first["zero_variance_share"] == 0.25 and first["cum_gen_tokens"] == 10 and first["prompts"] == ["a"]
    s.gen_tokens = 5
    second = s.take()
    assert second["cum_gen_tokens"] == 15 and second["groups"] == 0 and second["zero_variance_share"] is None
    assert s.cum_groups == 4


def _write_run(d, log, steps=None, ms=0.0):
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"rollout_ms_per_token": ms}))
    (d / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    if steps is not None:
        (d / "replay").mkdir()
        (d / "replay" / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))


def test_regime_numbers_of_a_constructed_run(tmp_path):
    log = [{"step": t, "zero_variance_share": z, "gen_s": 0.2, "step_s": 0.5, "gen_tokens": 100}
           for t, z in zip(range(1, 6), [0.9, 0.5, 0.45, 0.7, 0.3])]
    steps = [{"step": t, "accept_rate": a, "budget_fill": 1.0, "scanned": 10, "replay_kl": 0.001 * t,
              "ingress_candidates": 16, "ingress_admitted": 8} for t, a in zip(range(5), [None, 0.4, 0.2, 0.35, 0.6])]
    _write_run(tmp_path / "r", log, steps)
    r = run_regime(tmp_path / "r", model_ms_per_token=3.0)
    # steps >= 1 of the replay diagnostics = train-log steps >= 2 (the first logged step fills the empty buffer)
    assert r["zero_variance_share"]["mean"] == pytest.approx((0.5 + 0.45 + 0.7 + 0.3) / 4)
    assert r["zero_variance_in_band"] == pytest.approx(2 / 4)
    assert r["acceptance"]["mean"] == pytest.approx((0.4 + 0.2 + 0.35 + 0.6) / 4)
    assert r["acceptance_in_band"] == pytest.approx(2 / 4)
    assert r["replay_kl"]["mean"] == pytest.approx(0.001 * (1 + 2 + 3 + 4) / 4)
    assert r["generation_share_native"]["mean"] == pytest.approx(0.4)
    assert r["generation_share_modelled"]["mean"] == pytest.approx((0.2 + 0.3) / (0.5 + 0.3))
    assert r["ingress_admitted_share"]["mean"] == pytest.approx(0.5)
    on_policy = tmp_path / "o"
    _write_run(on_policy, log)
    o = run_regime(on_policy)
    assert "acceptance" not in o and o["zero_variance_share"]["mean"] == r["zero_variance_share"]["mean"]
    both = method_regime([r, o])
    assert both["zero_variance_share"] == pytest.approx(r["zero_variance_share"]["mean"])
    assert both["acceptance"] == pytest.approx(r["acceptance"]["mean"])


def test_cost_that_makes_generation_two_thirds_of_the_step(tmp_path):
    from hdreplay_lab.sandbox.regime import cost_for_share
    from hdreplay_lab.sandbox.summary import _round_up

    log = [{"step": t, "gen_s": 0.2, "step_s": 0.5, "gen_tokens": 100} for t in range(1, 5)]
    _write_run(tmp_path / "a", log)
    c = cost_for_share([tmp_path / "a"])
    assert c == pytest.approx(4.0)  # (2 x 0.5 - 3 x 0.2) / 100 s per token
    assert generation_share([0.2], [0.5], [100], c)[0] == pytest.approx(2 / 3)
    # the same run made with 1 ms/token slept: the calibration removes the slept part first
    slept = [{**r, "gen_s": 0.3, "step_s": 0.6} for r in log]
    _write_run(tmp_path / "b", slept, ms=1.0)
    assert cost_for_share([tmp_path / "b"]) == pytest.approx(4.0)
    fast = [{**r, "gen_s": 0.45} for r in log]
    _write_run(tmp_path / "c", fast)
    assert cost_for_share([tmp_path / "c"]) == 0.0  # generation already 90 % of the step
    assert [_round_up(x) for x in (0.1234, 4.0, 0.0, 12.01)] == [pytest.approx(0.13), pytest.approx(4.0), 0.0,
                                                                   pytest.approx(13.0)]


def test_gate_verdict_block_from_constructed_replay_logs(tmp_path):
    from types import SimpleNamespace

    from hdreplay_lab.sandbox.summary import gate_numbers
    from hdreplay_lab.sandbox.tables import _gate

    def run(name, steps):
        d = tmp_path / "runs" / name / "seed0" / "replay"
        d.mkdir(parents=True)
        (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))

    run("headroom_drift", [{"step": 0, "scanned": 0, "accepted_ages": []},
                           {"step": 1, "accept_rate": 0.25, "scanned": 12, "budget_fill": 1.0, "replay_kl": 0.002,
                            "accepted_ages": [1, 1, 3]},
                           {"step": 2, "accept_rate": 0.35, "scanned": 8, "budget_fill": 0.5, "replay_kl": 0.004,
                            "accepted_ages": [2]}])
    run("recency_matched", [{"step": 1, "scanned": 4, "replay_kl": 0.03, "accepted_ages": [1, 1]},
                            {"step": 2, "scanned": 4, "replay_kl": 0.03, "accepted_ages": [1, 1]}])
    g = gate_numbers(tmp_path, SimpleNamespace(seeds=1), ["headroom_drift", "recency_matched"])
    h, r = g["headroom_drift"], g["recency_matched"]
    assert h["acceptance"] == pytest.approx(0.3) and h["scanned_per_step"] == 10 and h["budget_fill"] == 0.75
    assert h["replay_kl"] == pytest.approx(0.003) and h["mean_age"] == pytest.approx(7 / 4)
    assert h["share_age_1"] == 0.5 and h["max_age"] == 3 and h["age_hist"] == {1: 2, 2: 1, 3: 1}
    assert r["max_age"] == 1 and r["acceptance"] is None
    text = "\n".join(_gate({"tau": 0.01, "gate": g, "methods": {}}))
    assert "30% of the buffered groups" in text and "10.0x closer" in text and "only age 1" in text


def test_generation_share_removes_a_slept_cost():
    # a run that slept 1 ms/token: 100 tokens added 0.1 s to gen and step
    native = generation_share([0.3], [0.6], [100], ms_per_token=-1.0)
    assert native[0] == pytest.approx(0.2 / 0.5)


def test_curve_helpers_by_hand():
    assert first_reach([0, 10, 20], [0.1, 0.2, 0.4], 0.3) == pytest.approx(15.0)
    assert first_reach([0, 10], [0.5, 0.6], 0.3) == 0.0
    assert first_reach([0, 10], [0.1, 0.2], 0.3) is None
    assert auc([0, 10, 20], [0.0, 1.0, 1.0]) == pytest.approx((5 + 10) / 20)
    assert wall_at_cost([10.0], [2000], 0.0, 0.5)[0] == pytest.approx(11.0)
    assert wall_at_cost([11.0], [2000], 0.5, 0.0)[0] == pytest.approx(10.0)
    curve = lambda acc, wall: [{"step": s, "fresh_responses": 128 * s, "wall_s": w, "cum_gen_tokens": 600 * s,  # noqa: E731
                                "macro_mean_at_n": a} for s, a, w in zip((0, 10, 20), acc, wall)]
    c = method_curve([curve((0.1, 0.2, 0.3), (0, 5, 10)), curve((0.1, 0.3, 0.3), (0, 7, 12))],
                     run_ms_per_token=0.0, model_ms_per_token=1.0)
    assert c["mean_at_n"] == pytest.approx([0.1, 0.25, 0.3])
    assert c["wall_s_modelled"] == pytest.approx([0, 6 + 6.0, 11 + 12.0])
    t = cost_to_target(c, 0.25)
    assert t["step"] == pytest.approx(10) and t["fresh_responses"] == pytest.approx(1280)
    with pytest.raises(ValueError, match="different steps"):
        method_curve([curve((0.1, 0.2, 0.3), (0, 1, 2)), curve((0.1, 0.2, 0.3), (0, 1, 2))[::2]],
                     run_ms_per_token=0, model_ms_per_token=0)


def test_thread_settings(monkeypatch):
    import torch

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert sandbox_threads() == DEFAULT_THREADS == 1
    before = torch.get_num_threads()
    try:
        assert configure_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv(THREADS_ENV, "2")
        assert configure_threads() == 2 and torch.get_num_threads() == 2
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv(THREADS_ENV, bad)
            with pytest.raises(ValueError, match=THREADS_ENV):
                sandbox_threads()
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- through trainer.train() (tiny model)
trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hdreplay_lab.sandbox.model import build_tiny_model
    from hdreplay_lab.sandbox.tasks import VOCAB

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", chars=VOCAB, hidden=32, layers=1)


def _tiny_config(tiny, **kw):
    from hdreplay_lab.sandbox.compare import CompareConfig

    base = dict(task="mix", methods=("onpolicy_matched",), seeds=1, prompts_per_step=4, eval_n=1, model=str(tiny),
                replay={"tau": 10.0, "capacity": 8}, eval_every=0, curve_prompts=2, curve_n=1, workers=1,
                signatures=False)
    return CompareConfig(**{**base, **kw})


@pytest.mark.trl
def test_every_method_of_a_seed_reads_the_same_prompt_order(tiny, tmp_path):
    """Same permutation for b, 1.5b and replay methods: each reads it at its own rate (runner.py)."""
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import run_one
    from hdreplay_lab.sandbox.tasks import get_task

    streams = {}
    cfg = _tiny_config(tiny, steps=4, generations=2)
    for name in ("onpolicy_matched", "onpolicy_larger", "headroom_drift"):
        run_one(cfg.spec(name, 3), METHODS[name], get_task("mix"), tiny, tmp_path / name)
        log = [json.loads(x) for x in open(tmp_path / name / "prompts.jsonl")]
        assert [len(r["prompts"]) for r in log] == [METHODS[name].fresh_groups(4)] * 4
        groups = [json.loads(x)["groups"] for x in open(tmp_path / name / "train_log.jsonl")]
        assert groups == [len(r["prompts"]) for r in log]
        streams[name] = [p for r in log for p in r["prompts"]]
        run = json.loads((tmp_path / name / "run.json").read_text())
        assert run["torch_threads"] == 1 and run["dataset_prompts"] == 256  # max(3 x steps x b, 256): same for all
    assert streams["headroom_drift"] == streams["onpolicy_matched"]
    assert streams["onpolicy_larger"][:16] == streams["onpolicy_matched"]
    run_one(cfg.spec("onpolicy_matched", 4), METHODS["onpolicy_matched"], get_task("mix"), tiny, tmp_path / "seed4")
    seed4 = [p for x in open(tmp_path / "seed4" / "prompts.jsonl") for p in json.loads(x)["prompts"]]
    assert seed4 != streams["onpolicy_matched"], "another seed, another order"


@pytest.mark.trl
def test_an_interrupted_comparison_continues_without_redoing_finished_runs(tiny, tmp_path, monkeypatch):
    from hdreplay_lab.sandbox import runner
    from hdreplay_lab.sandbox.compare import CompareConfig, run_compare

    cfg = _tiny_config(tiny, methods=("onpolicy_matched", "headroom_drift"), steps=2, eval_every=1)
    real, calls = runner.run_one, []

    def interrupted(spec, method, task, model_dir, run_dir, on_step=None):
        calls.append(spec.method)
        if spec.method == "headroom_drift":  # killed half way: a started run without metrics.json
            run_dir.mkdir(parents=True)
            (run_dir / "train_log.jsonl").write_text('{"step": 1}\n')
            raise KeyboardInterrupt
        return real(spec, method, task, model_dir, run_dir, on_step)

    monkeypatch.setattr(runner, "run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_compare(cfg, tmp_path / "c", progress=False, log=lambda *a: None)
    done = tmp_path / "c" / "runs" / "onpolicy_matched" / "seed0" / "metrics.json"
    assert (runner.is_finished(done.parent)
            and not runner.is_finished(tmp_path / "c" / "runs" / "headroom_drift" / "seed0"))
    stamp = (done.read_bytes(), os.stat(done).st_mtime_ns)
    monkeypatch.setattr(runner, "run_one", lambda *a, **k: (calls.append(a[0].method), real(*a, **k))[1])
    calls.clear()
    summary = run_compare(cfg, tmp_path / "c", progress=False, log=lambda *a: None)
    assert calls == ["headroom_drift"], "only the unfinished run is redone"
    assert (done.read_bytes(), os.stat(done).st_mtime_ns) == stamp
    assert summary["environment"]["runs_reused"] == 1 and summary["environment"]["runs_trained"] == 1
    hdr_log = [json.loads(x) for x in open(tmp_path / "c" / "runs" / "headroom_drift" / "seed0" / "train_log.jsonl")]
    assert [r["step"] for r in hdr_log] == [1, 2], "the stale partial log was replaced"
    # a torn metrics.json does not count as finished
    done.write_text('{"format": "hdreplay.sandbox.metrics/2", "benchm')
    assert not runner.is_finished(done.parent)
    # changing only how many run at once keeps the finished runs
    calls.clear()
    cfg2 = CompareConfig(**{**cfg.__dict__, "workers": 2, "seeds": 1})
    done.write_bytes(stamp[0])
    run_compare(cfg2, tmp_path / "c", progress=False, log=lambda *a: None)
    assert calls == []


@pytest.mark.trl
def test_zero_variance_share_matches_ingress_on_a_real_run(tiny, tmp_path):
    """Mixed-outcome ingress admits exactly the groups that are not zero-variance."""
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import run_one
    from hdreplay_lab.sandbox.tasks import get_task

    spec = _tiny_config(tiny, steps=4, generations=4, rollout_ms_per_token=0.01).spec("headroom_drift", 0)
    run_one(spec, METHODS["headroom_drift"], get_task("mix"), tiny, tmp_path / "r")
    log = [json.loads(x) for x in open(tmp_path / "r" / "train_log.jsonl")]
    steps = [json.loads(x) for x in open(tmp_path / "r" / "replay" / "steps.jsonl")]
    for row, st in zip(log, steps):
        assert st["step"] == row["step"] - 1
        assert st["ingress_candidates"] == row["groups"] == 4
        assert st["ingress_admitted"] == row["groups"] - row["zero_var_groups"]
        assert row["gen_tokens"] > 0 and row["gen_s"] >= row["gen_tokens"] * 1e-5
    assert np.diff([r["cum_gen_tokens"] for r in log]).tolist() == [r["gen_tokens"] for r in log[1:]]
