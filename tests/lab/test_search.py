"""Agentic search sandbox through TRL's environment mechanism: masks, exact replay, robust parsing."""

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from hdreplay import group_scores  # noqa: E402
from hdreplay_lab.sandbox.search import (  # noqa: E402
    KB, SearchEnv, SearchTask, exact_answer, install_chat_format, render_with_mask, rollout,
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
    from hdreplay_lab.sandbox.model import build_tokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

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
