"""Agentic search sandbox: a local search tool over a synthetic knowledge base, multi-turn through
TRL's own environment mechanism (``GRPOTrainer(environment_factory=...)``).

Knowledge base (generated from a seed, on the machine): entities with made-up names, each with a
``city`` and a ``boss`` (another entity).  ``search(q)`` returns the entity's fact line, e.g.
``lum:city=vora,boss=tek``.  Questions need one or two lookups:

    hop1   "city of lum?"           -> search lum -> vora
    boss   "boss of lum?"           -> search lum -> tek
    hop2   "city of boss of lum?"   -> search lum -> search tek -> (tek's city)
    hop3   "city of boss of boss of lum?" -> three lookups (the ``search_mix`` setting's hard end, tasks.py)

Conversation format (a char-level chat template, prefix-preserving, tool calling supported)::

    Q city of lum?\\n          user
    A <search q=lum><eos>       assistant: a tool call
    [lum:city=vora,boss=tek]    tool result (environment tokens: loss mask 0)
    A vora<eos>                 assistant: the answer

The tokenizer carries that chat template and a transformers ``response_template`` that parses
``<search q=...>`` into a tool call, so TRL's tool-call loop runs unchanged.  A per-call latency
(``SearchEnv.latency_s``, slept in each call: TRL runs sync tools one after another) or per turn of the tool loop
(the sandbox trainer's ``turn_latency_s``, instrument.py) models an expensive environment; envcost.py models
both from the counted calls and turns.  Rewards are exact match of the last
assistant message; a malformed or failing tool call is not an exception: the environment answers
with an error line and the episode scores 0 unless the final answer is right.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

VOCAB = "abcdefghijklmnopqrstuvwxyzAQ0123456789 <>[]=:,?._\n"
GEN_PROMPT = "A "

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ 'Q ' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ 'A ' + (m['content'] or '') }}"
    "{%- for tc in m.get('tool_calls') or [] -%}{{ '<' + tc['function']['name'] }}"
    "{%- for k, v in (tc['function']['arguments'] or {}).items() -%}{{ ' ' + k + '=' + v|string }}{%- endfor -%}"
    "{{ '>' }}{%- endfor -%}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' -%}{{ '[' + m['content'] + ']' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A ' }}{%- endif -%}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": GEN_PROMPT,
    "fields": {
        "tool_calls": {
            "open_pattern": r"<(?P<name>[a-z_]+) ",
            "close": ">",
            "repeats": True,
            "content": "kv-lines",
            "content_args": {"line_sep": " ", "kv_sep": "="},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<eos>\s*|$", "content": "text"},
    },
}

CITIES = ("vora", "miro", "tal", "sen", "oru", "kea", "bel", "nim", "rask", "dov", "pel", "ula")


def _name(rng: random.Random, taken: set) -> str:
    cons, vow = "bdfghklmnprstvz", "aeiou"
    while True:
        n = rng.choice(cons) + rng.choice(vow) + rng.choice(cons) + (rng.choice(vow) if rng.random() < 0.5 else "")
        if n not in taken and n not in CITIES:
            taken.add(n)
            return n


@dataclass(frozen=True)
class KnowledgeBase:
    facts: dict  # name -> {"city": str, "boss": str}

    @classmethod
    def generate(cls, size: int = 150, seed: int = 0) -> "KnowledgeBase":
        rng = random.Random(f"kb/{seed}")
        taken: set = set()
        names = [_name(rng, taken) for _ in range(size)]
        facts = {}
        for n in names:
            boss = rng.choice([x for x in names if x != n])
            facts[n] = {"city": rng.choice(CITIES), "boss": boss}
        return cls(facts)

    def lookup(self, q: str) -> str:
        f = self.facts.get(q)
        return f"{q}:city={f['city']},boss={f['boss']}" if f else f"{q}:none"


KB = KnowledgeBase.generate()


class SearchEnv:
    """A TRL environment: ``reset(**row)`` per episode, ``search`` is the tool the model calls."""

    latency_s: float = 0.0  # per call; set by the runner (models an expensive environment)
    calls: int = 0  # class-wide counter, for step-time accounting

    def reset(self, **row) -> None:
        self.question = row.get("question")

    def search(self, q: str) -> str:
        """Look an entity up in the knowledge base.

        Args:
            q: the entity name to look up
        """
        type(self).calls += 1
        if self.latency_s:
            time.sleep(self.latency_s)
        q = str(q).strip()
        if not q or not q.isalpha():
            return "error:bad query"
        return KB.lookup(q)


@dataclass(frozen=True)
class SearchProblem:
    question: str
    answer: str
    hops: tuple  # the entities looked up, in order

    @property
    def prompt(self):
        return [{"role": "user", "content": self.question}]


@dataclass(frozen=True)
class SearchBenchmark:
    name: str
    kind: str  # hop1 | boss | hop2 | hop3
    size: int


def make_search_problem(kind: str, e: str, kb: KnowledgeBase = KB) -> SearchProblem:
    f = kb.facts[e]
    if kind == "hop1":
        return SearchProblem(f"city of {e}?", f["city"], (e,))
    if kind == "boss":
        return SearchProblem(f"boss of {e}?", f["boss"], (e,))
    if kind == "hop2":
        b = f["boss"]
        return SearchProblem(f"city of boss of {e}?", kb.facts[b]["city"], (e, b))
    if kind == "hop3":
        b = f["boss"]
        bb = kb.facts[b]["boss"]
        return SearchProblem(f"city of boss of boss of {e}?", kb.facts[bb]["city"], (e, b, bb))
    raise ValueError(f"unknown question kind {kind!r}")


def final_answer(completion) -> str | None:
    """The content of the last assistant message of a (multi-turn) completion, or None."""
    if isinstance(completion, str):
        return completion.strip()
    msgs = [m for m in completion if m.get("role") == "assistant"]
    if not msgs:
        return None
    return (msgs[-1].get("content") or "").strip()


def exact_answer(completion, answer: str) -> float:
    """1.0 iff the final assistant answer equals ``answer`` (malformed or missing -> 0.0, never raises)."""
    try:
        got = final_answer(completion)
    except (AttributeError, TypeError):
        return 0.0
    return float(got == answer)


@dataclass(frozen=True)
class SearchTask:
    """The ``search`` task: the same interface the sandbox runner uses for the arithmetic tasks."""

    name: str = "search"
    vocab: str = VOCAB
    train_kinds: tuple = ("hop1", "boss", "hop2")
    #: the kinds the supervised warm start demonstrates (None: train_kinds); a kind left out is one GRPO must discover
    warmstart_kinds: tuple | None = None
    benchmarks: tuple = (SearchBenchmark("hop1", "hop1", 60), SearchBenchmark("boss", "boss", 60),
                         SearchBenchmark("hop2", "hop2", 60))
    heldout_share: float = 0.4  # entities whose questions are only asked in the benchmarks
    answer_threshold: float | None = None
    max_tool_calls: int = 2
    #: warm start: sequences are ~90 tokens, accuracy rises fast, so check it often
    warmstart_overrides: tuple = (("batch", 64), ("eval_every", 20), ("eval_prompts", 24))
    default_latency_ms: float = 5.0
    #: the zero-variance share of fresh groups the warm start must leave, or None (no regime asked): a comparison on
    #: a task whose share after the warm start lies outside it stops before training, naming the share (compare.py)
    zero_variance_band: tuple | None = None
    notes: str = "multi-turn: model calls <search q=...>, the environment appends [facts] (loss mask 0)"
    extra: dict = field(default_factory=dict)

    @property
    def is_multiturn(self) -> bool:
        return True

    def _split(self):
        names = sorted(KB.facts)
        rng = random.Random("search/split")
        rng.shuffle(names)
        k = int(len(names) * self.heldout_share)
        return names[k:], names[:k]  # train entities, held-out entities

    def train_problems(self, k: int, seed: int) -> list[SearchProblem]:
        train, _ = self._split()
        rng = random.Random(f"search/train/{seed}")
        return [make_search_problem(rng.choice(self.train_kinds), rng.choice(train)) for _ in range(k)]

    def warmstart_problems(self, k: int, seed: int) -> list[SearchProblem]:
        """The warm start's training problems: :meth:`train_problems` over ``warmstart_kinds``."""
        return replace(self, train_kinds=self.warmstart_kinds or self.train_kinds).train_problems(k, seed)

    def benchmark_problems(self, bench: SearchBenchmark) -> list[SearchProblem]:
        _, held = self._split()
        rng = random.Random(f"search/bench/{bench.name}")
        pool = [make_search_problem(bench.kind, e) for e in held]
        rng.shuffle(pool)
        return pool[: bench.size]

    def heldout_prompts(self) -> set[str]:
        return {p.question for b in self.benchmarks for p in self.benchmark_problems(b)}

    def score(self, completion, answer: str) -> float:
        return exact_answer(completion, answer)

    def reward_func(self):
        from .rewards import score_reward

        return score_reward(self.name, self.score)

    def conversation(self, p: SearchProblem) -> list[dict]:
        """The ideal trajectory (for the warm start)."""
        msgs = [{"role": "user", "content": p.question}]
        for e in p.hops:
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": e}}}]})
            msgs.append({"role": "tool", "name": "search", "content": KB.lookup(e)})
        msgs.append({"role": "assistant", "content": p.answer})
        return msgs

    def with_sizes(self, size: int) -> "SearchTask":
        return replace(self, benchmarks=tuple(replace(b, size=min(b.size, size)) for b in self.benchmarks))


def install_chat_format(tok):
    """Give a char-level tokenizer the search chat template and response template (in place)."""
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def render_with_mask(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on the tokens the model generates
    (assistant turns, their EOS included) and 0 on prompt and tool tokens; built by rendering growing
    prefixes of the conversation, exactly how TRL's tool loop assembles a multi-turn completion."""
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        gen = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        full = tok.apply_chat_template(messages[: i + 1], add_generation_prompt=gen, tokenize=True, return_dict=False)
        if full[: len(ids)] != ids:
            raise ValueError("the chat template is not prefix-preserving")
        new = full[len(ids):]
        if m["role"] == "assistant":
            mask += [1] * len(new)
        else:
            mask += [0] * len(new)
        ids = full
    return ids, mask


def rollout(model, tok, problems, *, n: int, max_new_tokens: int = 24, max_tool_calls: int = 2,
            temperature: float = 1.0, batch_rows: int = 512) -> list[list[list[dict]]]:
    """Sample n multi-turn episodes per problem (no latency): the same format and parser as training.

    Each turn, every unfinished episode is rendered with the chat template, sampled until EOS,
    parsed with TRL's ``parse_response`` (the response template above) and, if it called the tool,
    extended with the tool result.  Returns per problem n completions (lists of messages).
    """
    import torch
    from trl.chat_template_utils import parse_response

    env = SearchEnv()
    env.latency_s = 0.0  # evaluation never pays the modelled environment latency of training
    episodes = [[dict(m) for m in p.prompt] for p in problems for _ in range(n)]
    completions: list[list[dict]] = [[] for _ in episodes]
    live = list(range(len(episodes)))
    was_training = model.training
    model.eval()
    try:
        for turn in range(max_tool_calls + 1):
            if not live:
                break
            nxt = []
            for s in range(0, len(live), batch_rows):
                rows = live[s:s + batch_rows]
                prompts = [tok.apply_chat_template(episodes[i], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False) for i in rows]
                L = max(map(len, prompts))
                ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts])
                att = (torch.arange(L)[None, :] >= torch.tensor([L - len(p) for p in prompts])[:, None]).long()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature,
                                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                for i, p, gen in zip(rows, prompts, out[:, L:].tolist()):
                    if tok.eos_token_id in gen:
                        gen = gen[: gen.index(tok.eos_token_id) + 1]
                    gen = [t for t in gen if t != tok.pad_token_id]
                    msg = parse_response(tok, gen, prefix=p)
                    msg = {"role": "assistant", "content": msg.get("content") or "",
                           **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})}
                    episodes[i].append(msg)
                    completions[i].append(msg)
                    calls = msg.get("tool_calls") or []
                    if calls and turn < max_tool_calls:
                        for tc in calls:
                            fn = tc.get("function", {})
                            try:
                                res = env.search(**(fn.get("arguments") or {})) if fn.get("name") == "search" \
                                    else f"error:unknown tool {fn.get('name')}"
                            except TypeError as e:
                                res = f"error:{e}"
                            tool = {"role": "tool", "name": fn.get("name", "unknown"), "content": res}
                            episodes[i].append(tool)
                            completions[i].append(tool)
                        nxt.append(i)
            live = nxt
    finally:
        model.train(was_training)
    return [completions[k * n:(k + 1) * n] for k in range(len(problems))]
