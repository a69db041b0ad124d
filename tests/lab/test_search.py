"""Agentic search sandbox through TRL's environment mechanism: masks, exact replay, robust parsing."""

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import group_scores  # noqa: E402
from hdreplay_lab.sandbox.search import (  # noqa: E402
    KB,
    SearchEnv,
    SearchTask,
    exact_answer,
    install_chat_format,
    render_with_mask,
    rollout,
)


@pytest.fixture(scope="module")
def search_model(tmp_path_factory):
    """A tiny model warm-started for a few seconds: it emits the tool-call format, answers are mostly wrong."""
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, warm_start

    cfg = WarmStartConfig(hidden=48, layers=2, heads=4, kv_heads=2, max_steps=150, eval_every=150, eval_prompts=4,
                          eval_n=1, target=1.1, batch=32, lr=3e-3)
    return warm_start(SearchTask(), tmp_path_factory.mktemp("ws"), cfg, log=lambda *_: None)


def test_environment_rejects_malformed_calls_without_raising():
    env = SearchEnv()
    env.reset(question="city of x?")
    name = sorted(KB.facts)[0]
    assert env.search(name).startswith(f"{name}:city=")
    assert env.search("") == "error:bad query" and env.search("a b") == "error:bad query"
    assert env.search("zzzzzz") == "zzzzzz:none"
    malformed = [{"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "search", "arguments": {}}}]},
                 {"role": "tool", "name": "search", "content": "{'error': 'missing q'}"}]
    assert exact_answer(malformed, "vora") == 0.0
    assert exact_answer([{"role": "assistant", "content": "vora"}], "vora") == 1.0
    assert exact_answer(None, "vora") == 0.0 and exact_answer([{"no": "role"}], "vora") == 0.0
    task = SearchTask()
    assert task.reward_func()([malformed, [{"role": "assistant", "content": "vora"}]], ["vora", "vora"]) == [0.0, 1.0]


def test_chat_format_masks_tool_text_and_parses_tool_calls():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from hdreplay_lab.sandbox.model import build_tokenizer

    task = SearchTask()
    tok = install_chat_format(build_tokenizer(task.vocab))
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    p = next(q for q in task.train_problems(50, 0) if len(q.hops) == 2)
    ids, mask = render_with_mask(tok, task.conversation(p))
    text_gen = tok.decode([i for i, m in zip(ids, mask) if m])
    assert text_gen == f"<search q={p.hops[0]}><eos><search q={p.hops[1]}><eos>{p.answer}<eos>"
    prefix = tok.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    call = tok(f"<search q={p.hops[0]}>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert parse_response(tok, call, prefix=prefix)["tool_calls"][0]["function"] == {
        "name": "search", "arguments": {"q": p.hops[0]}}
    for garbage in ("<<<q==", "<search", "]]]"):  # not a tool call: plain assistant text, nothing for the env to run
        parsed = parse_response(tok, tok(garbage, add_special_tokens=False)["input_ids"], prefix=prefix)
        assert parsed == {"role": "assistant", "content": garbage}
    empty = parse_response(tok, tok("<search q=>", add_special_tokens=False)["input_ids"], prefix=prefix)
    (call,) = empty["tool_calls"]  # a call with an empty query: the environment answers with an error, not a raise
    assert call["function"] == {"name": "search", "arguments": {"q": ""}}
    env = SearchEnv()
    env.reset(question=p.question)
    assert env.search(**call["function"]["arguments"]) == "error:bad query"


def test_multiturn_replay_through_trl_environment_factory(search_model, tmp_path):
    from datasets import Dataset

    from hdreplay_lab.sandbox.model import load_model
    from trl_fixtures import RecordingTrainer, make_args

    task = SearchTask()
    model, tok = load_model(search_model)
    install_chat_format(tok)
    probs = task.train_problems(64, seed=0)
    ds = Dataset.from_dict({"prompt": [p.prompt for p in probs], "answer": [p.answer for p in probs],
                            "question": [p.question for p in probs]})
    SearchEnv.latency_s = 0.0

    def shaped(completions, answer, **kw):  # a reward that is mixed under a barely trained model
        return [exact_answer(c, a) + 0.5 * float(any(m.get("role") == "tool" for m in c))
                for c, a in zip(completions, answer)]

    tr = RecordingTrainer(model=model, reward_funcs=shaped, train_dataset=ds, processing_class=tok,
                          environment_factory=SearchEnv,
                          args=make_args(tmp_path / "o", max_steps=3, max_completion_length=128, replay_k_rep=2,
                                         max_tool_calling_iterations=2, replay_tau=1e9, learning_rate=1e-3))
    tr.train()
    buf = tr.replay.buffer
    groups = buf.get(buf.insertion_ids().tolist())
    with_tool = [g for g in groups if not bool(g.loss_mask.all())]
    assert with_tool, "the episodes must contain tool results"
    for g in with_tool:
        for resp, m in zip(g.responses(), g.split(g.loss_mask)):
            # every run of loss-mask-0 tokens is one environment turn: "[<tool result>]" + "A "
            runs, cur = [], []
            for t, keep in zip(resp.tolist(), m.tolist()):
                if not keep:
                    cur.append(t)
                elif cur:
                    runs.append(cur)
                    cur = []
            runs += [cur] if cur else []
            for run in runs:
                text = tok.decode(run)
                assert text.startswith("[") and text.endswith("]A "), text
        assert (g.logprobs[~g.loss_mask] == 0).all()
    # Drift / Headroom / replay KL of a stored episode ignore the environment tokens
    g = with_tool[0]
    cur = tr._replay_scorer([g])
    s = group_scores([g], cur)
    m = g.loss_mask
    d = (cur[0][m] - g.logprobs[m]).square().mean()
    assert float(s.drift[0]) == pytest.approx(float(d), rel=1e-5, abs=1e-9)
    d_all = (cur[0] - g.logprobs).square().mean()
    assert float(d_all) != pytest.approx(float(d), rel=1e-3)  # including them would change the score
    # replayed episodes enter the batch with exactly their stored masks and log-probs
    sels = [s for s in tr.selections if s["groups"]]
    assert sels
    by_gen = {}  # loss-call records (fresh micro-batch, replay chunks) by generation
    for r in tr.records:
        by_gen.setdefault(r["micro"] // tr.args.steps_per_generation, []).append(r)
    for cyc, sel in zip([by_gen[k] for k in sorted(by_gen)], tr.selections):
        rows = [(r["old"][k], r["mask"][k]) for r in cyc if r["old"] is not None
                for k in torch.nonzero(r["is_replay"]).flatten().tolist()]
        stored = [(lp, mk) for lp, mk, ln in zip(sel["stored_logps"], sel["stored_mask"], sel["lengths"])
                  for lp, mk in zip(torch.split(lp, ln), torch.split(mk, ln))]
        assert len(rows) == len(stored)
        for (old, mask), (lp, mk) in zip(rows, stored):
            L = len(lp)
            assert torch.equal(mask[:L].bool(), mk) and not mask[L:].any()
            assert torch.equal(old[:L][mk], lp[mk])


def test_rollout_with_an_untrained_model_scores_zero_without_raising(tmp_path):
    from hdreplay_lab.sandbox.model import build_tiny_model, load_model

    task = SearchTask()
    build_tiny_model(tmp_path / "m", chars=task.vocab, hidden=32, layers=1)
    model, tok = load_model(tmp_path / "m")
    install_chat_format(tok)
    probs = task.benchmark_problems(task.benchmarks[0])[:4]
    comps = rollout(model, tok, probs, n=2, max_new_tokens=12)
    assert [len(c) for c in comps] == [2, 2, 2, 2]
    for cs, p in zip(comps, probs):
        for c in cs:  # an episode ends with the model's own turn, and random text is never the exact answer
            assert c[-1]["role"] == "assistant" and c[-1]["content"] != p.answer
            assert task.score(c, p.answer) == 0.0
    # the same scorer gives 1.0 to the exact answer, so the zeros above are the model's, not the scorer's
    assert all(task.score([{"role": "assistant", "content": p.answer}], p.answer) == 1.0 for p in probs)


def test_latency_is_slept_once_per_turn_or_once_per_call_and_never_in_evaluation(search_model, tmp_path, monkeypatch):
    """The two concurrency models as slept: per turn, the trainer sleeps once per round of the tool loop that made
    calls; sequentially, the environment sleeps in every call.  Held-out evaluation (the curve every step, the final
    evaluation) calls the tool too, and never sleeps."""
    import json
    import sys
    import time
    from pathlib import Path

    from hdreplay_lab.sandbox.compare import CompareConfig
    from hdreplay_lab.sandbox.methods import METHODS
    from hdreplay_lab.sandbox.runner import run_one
    from hdreplay_lab.sandbox.tasks import get_task

    monkeypatch.setattr(SearchEnv, "latency_s", 0.0)  # restored after the test: other tests share the class
    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append((Path(sys._getframe(1).f_code.co_filename).name, s)))
    for conc, who in (("per_turn", "instrument.py"), ("sequential", "search.py")):
        slept.clear()
        calls0 = SearchEnv.calls
        cfg = CompareConfig(task="search", methods=("onpolicy_matched",), seeds=1, steps=2, prompts_per_step=4,
                            generations=4, eval_n=1, eval_every=1, curve_prompts=2, curve_n=1, latency_ms=40.0,
                            tool_concurrency=conc, signatures=False)
        run_dir = tmp_path / conc
        run_one(cfg.spec("onpolicy_matched", 0), METHODS["onpolicy_matched"], get_task("search"), search_model,
                run_dir)
        log = [json.loads(x) for x in open(run_dir / "train_log.jsonl")]
        calls, turns = sum(r["tool_calls"] for r in log), sum(r["tool_turns"] for r in log)
        assert calls > 0 and all((r["tool_turns"] > 0) == (r["tool_calls"] > 0) and r["tool_turns"] <= 2 for r in log)
        assert SearchEnv.calls - calls0 > calls  # evaluation called the tool too (not counted, not slept)
        ours = [(f, s) for f, s in slept if f in ("instrument.py", "search.py")]
        assert ours == [(who, 0.04)] * (turns if conc == "per_turn" else calls), (conc, ours[:5], turns, calls)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["env_calls_per_step"] == calls / 2 and metrics["tool_turns_per_step"] == turns / 2
        assert metrics["tool_concurrency"] == conc and metrics["cpu_s_per_step"] > 0


def _cli(*args):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "hdreplay_lab.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=900)


def test_tiny_search_comparison_models_wall_clock_from_the_counts_and_refuses_mixed_seeds(search_model, tmp_path):
    """The issue-31 comparison at toy size: counts per step, modelled step times at each latency under both
    concurrency models, the paper's column, crossovers and plots; then a seed rerun with another latency makes the
    same command refuse to summarize."""
    import json

    import numpy as np

    out = tmp_path / "s"
    args = ["compare", "--task", "search", "--methods", "onpolicy_matched,onpolicy_larger,headroom_drift",
            "--seeds", "2", "--steps", "3", "--prompts-per-step", "4", "--generations", "4", "--eval-n", "1",
            "--curve-prompts", "3", "--curve-n", "1", "--eval-every", "1", "--latency-ms", "0",
            "--latencies-ms", "0,50,1000", "--replay.max_scan", "16", "--no-signatures", "--no-progress",
            "--model", search_model, "--out", out]
    p = _cli(*args)
    assert p.returncode == 0, p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)  # strict JSON
    ec = s["env_cost"]
    assert ec["latencies_ms"] == [0.0, 50.0, 1000.0] and ec["concurrency"] == "per_turn"
    for name, e in s["methods"].items():
        per_seed = []
        for seed in range(2):
            run = out / "runs" / name / f"seed{seed}"
            log = [json.loads(x) for x in open(run / "train_log.jsonl")]
            if name == "headroom_drift":  # the scan cap off: max_scan = capacity (4 b), as the real comparison runs
                assert json.loads((run / "run.json").read_text())["replay"]["max_scan"] == 16
            rows = log[0]["groups"] * 4  # fresh rows of a step: groups x n
            assert e["fresh_responses"]["mean"] == 3 * rows == 3 * (24 if name == "onpolicy_larger" else 16)
            for r in log:  # the environment's count = TRL's count of calls that reached it
                trl = r["tools/call_frequency"] * rows * (1 - r["tools/failure_frequency"])
                assert r["tool_calls"] == pytest.approx(trl)
            per_seed.append({k: np.mean([r[k] for r in log[1:]]) for k in ("cpu_s", "tool_calls", "tool_turns")})
        c = ec["counts"][name]
        for k in ("cpu_s", "tool_calls", "tool_turns"):
            assert c[k]["mean"] == pytest.approx(np.mean([x[k] for x in per_seed]))
        for conc, unit in (("per_turn", "tool_turns"), ("sequential", "tool_calls")):
            want = np.mean([x["cpu_s"] + 1.0 * x[unit] for x in per_seed])
            assert ec["step_time"][conc]["1000"][name]["mean"] == pytest.approx(want)
    assert sum(ec["counts"][n]["tool_calls"]["mean"] for n in s["methods"]) > 0  # the warm start calls the tool
    assert set(ec["wallclock"]["per_turn"]["crossover"]) == {"onpolicy_matched", "onpolicy_larger"}
    md = (out / "summary.md").read_text()
    assert "## Environment cost and wall-clock" in md and "| Paper (s)" in md and "197.2 (1.35x)" in md
    assert "reaches the target sooner" in md
    paired = ec["step_time"]["per_turn"]["1000"]["onpolicy_larger"]["ref_minus"]  # HDR minus 1.5b, paired by seed
    assert paired["diff"] == pytest.approx(ec["step_time"]["per_turn"]["1000"]["headroom_drift"]["mean"]
                                           - ec["step_time"]["per_turn"]["1000"]["onpolicy_larger"]["mean"])
    assert "modelled step time minus each method's" in md
    assert f"{paired['diff']:+.3f} [{paired['lo']:+.3f}, {paired['hi']:+.3f}]" in md
    for png in ("step_time", "quality_wallclock", "time_to_target"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 0
    # a seed of one method redone with a slept latency: the same command no longer summarizes
    run = out / "runs" / "headroom_drift" / "seed1" / "run.json"
    spec = json.loads(run.read_text())
    spec["extra"]["latency_s"] = 0.2
    run.write_text(json.dumps(spec))
    p = _cli(*args)
    err = [x for x in p.stderr.splitlines() if x.startswith("hdreplay compare: error:")]
    assert p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "refusing to summarize" in err[0] and "headroom_drift/seed1" in err[0] and "extra.latency_s" in err[0]


def _refuse(token):
    raise ValueError(f"summary.json holds the non-standard JSON token {token}")
