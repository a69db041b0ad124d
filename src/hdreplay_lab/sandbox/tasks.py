"""Synthetic verifiable tasks: prompts, held-out benchmarks, exact-match rewards.

Prompts are plain strings (no chat template), e.g. ``"47+385="``; the model answers with the
digits and EOS.  Each task has a training prompt stream, several held-out *benchmarks* of
different difficulty (different operand sizes / operations), a reward function for TRL, the
target completion used by the supervised warm start, and (multi-reward) an answer threshold.

Tasks
-----
``mix``           (default) addition whose operand sizes span easy..hard: 1+2, 2+2, 2+3, 3+3 and 4+4
                  digits, uniformly; one benchmark per size.  After the warm start about half of the fresh
                  groups are zero-variance (the easy sizes all right, the hard ones all wrong), the regime
                  of math GRPO that replay is meant for (docs/results/fidelity measures it per step)
``add``           2/3-digit addition; benchmarks add2, add3 (in distribution), add2x3 (mixed sizes)
``arith``         addition and subtraction; benchmarks add2, add3, sub2, sub3
``multi_reward``  addition whose reward mixes answer and format like the paper's Geometry3K table:
                  the answer must be followed by ``.``; 1.0 right+format, 0.9 right, 0.1 wrong+format,
                  0.0 wrong.  Use with answer-based ingress (threshold 0.9).
``search``        multi-turn agentic search with a local tool (see search.py); after its warm start few fresh
                  groups are zero-variance (6 %, docs/results/search)
``search_mix``    the search task in the paper's regime: questions from one lookup to three (hop1, boss, hop2 and,
                  for half of them, hop3; up to 3 tool calls); the warm start demonstrates one and two lookups
                  only, so the three-hop groups start almost all wrong and about half of the fresh groups are
                  zero-variance; a comparison refuses a warm start that leaves the share outside 40-60 %
                  (docs/results/search_mix)
``geo``           visual geometry with a tiny VLM: labelled lengths read from a PIL-drawn image, the
                  Geometry3K answer x format reward (see geo.py)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable

from .rewards import score_reward  # noqa: F401  (its home before rewards.py)

VOCAB = "0123456789+-=.?"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # canonical answer digits (with sign)


def _operands(rng: random.Random, digits: int) -> int:
    lo = 10 ** (digits - 1) if digits > 1 else 0
    return rng.randint(lo, 10 ** digits - 1)


def make_problem(rng: random.Random, op: str, da: int, db: int) -> Problem:
    a, b = _operands(rng, da), _operands(rng, db)
    if op == "+":
        return Problem(f"{a}+{b}=", str(a + b))
    if op == "-":
        a, b = max(a, b), min(a, b)
        return Problem(f"{a}-{b}=", str(a - b))
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class Benchmark:
    name: str
    spec: tuple  # (op, digits_a, digits_b) families, sampled uniformly
    size: int


_NUM = re.compile(r"^(-?\d+)")


def parse_answer(completion: str) -> tuple[str | None, bool]:
    """(leading integer or None, format ok = the integer is followed by '.' and nothing else)."""
    text = completion.strip()
    m = _NUM.match(text)
    if not m:
        return None, False
    return m.group(1), text[m.end():] == "."


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff the completion is exactly the answer (optionally followed by '.'), else 0.0."""
    got, _ = parse_answer(completion)
    rest = completion.strip()[len(got):] if got is not None else None
    return float(got == answer and rest in ("", "."))


def answer_and_format(completion: str, answer: str) -> float:
    """The Geometry3K-style mixed reward: 1.0 / 0.9 / 0.1 / 0.0 (answer right x format right)."""
    got, fmt = parse_answer(completion)
    right = got == answer
    return {(True, True): 1.0, (True, False): 0.9, (False, True): 0.1, (False, False): 0.0}[(right, fmt)]


@dataclass(frozen=True)
class Task:
    name: str
    train_spec: tuple
    benchmarks: tuple[Benchmark, ...]
    score: Callable[[str, str], float]
    answer_threshold: float | None = None  # for answer-based ingress
    format_rate: float = 0.0  # share of warm-start targets that carry the '.' format marker
    notes: str = ""
    vocab: str = VOCAB
    is_multiturn: bool = False
    extra: dict = field(default_factory=dict)
    #: WarmStartConfig fields this task sets differently (name, value) pairs
    warmstart_overrides: tuple = ()
    #: default replay buffer capacity in units of b: a few steps of *admitted* groups (compare.py)
    capacity_per_b: int = 4

    def train_problems(self, k: int, seed: int) -> list[Problem]:
        rng = random.Random(f"{self.name}/train/{seed}")
        held = self.heldout_prompts()
        out = []
        while len(out) < k:
            p = make_problem(rng, *rng.choice(self.train_spec))
            if p.prompt not in held:
                out.append(p)
        return out

    def benchmark_problems(self, bench: Benchmark) -> list[Problem]:
        rng = random.Random(f"{self.name}/bench/{bench.name}")
        seen, out = set(), []
        while len(out) < bench.size:
            p = make_problem(rng, *rng.choice(bench.spec))
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        return out

    def heldout_prompts(self) -> set[str]:
        return {p.prompt for b in self.benchmarks for p in self.benchmark_problems(b)}

    def target(self, p: Problem, rng: random.Random) -> str:
        """Warm-start completion for a problem."""
        return p.answer + ("." if rng.random() < self.format_rate else "")

    def reward_func(self):
        """A TRL reward function: reads the ``answer`` column of the dataset."""
        return score_reward(self.name, self.score)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("mix", train_spec=(("+", 1, 2), ("+", 2, 2), ("+", 2, 3), ("+", 3, 3), ("+", 4, 4)),
             benchmarks=(Benchmark("add1x2", (("+", 1, 2),), 150), Benchmark("add2", (("+", 2, 2),), 150),
                         Benchmark("add2x3", (("+", 2, 3),), 150), Benchmark("add3", (("+", 3, 3),), 150),
                         Benchmark("add4", (("+", 4, 4),), 150)),
             score=exact_match, notes="difficulty mixture: about half of the fresh groups zero-variance",
             warmstart_overrides=(("zero_variance_target", 0.5), ("eval_every", 50)), capacity_per_b=2),
        Task("add", train_spec=(("+", 2, 2), ("+", 3, 3), ("+", 2, 3), ("+", 3, 2)),
             benchmarks=(Benchmark("add2", (("+", 2, 2),), 200), Benchmark("add3", (("+", 3, 3),), 300),
                         Benchmark("add2x3", (("+", 2, 3), ("+", 3, 2)), 100)),
             score=exact_match),
        Task("arith", train_spec=(("+", 2, 2), ("+", 3, 3), ("-", 2, 2), ("-", 3, 3)),
             benchmarks=(Benchmark("add2", (("+", 2, 2),), 150), Benchmark("add3", (("+", 3, 3),), 150),
                         Benchmark("sub2", (("-", 2, 2),), 150), Benchmark("sub3", (("-", 3, 3),), 150)),
             score=exact_match),
        Task("multi_reward", train_spec=(("+", 2, 2), ("+", 3, 3), ("+", 2, 3), ("+", 3, 2)),
             benchmarks=(Benchmark("add2", (("+", 2, 2),), 200), Benchmark("add3", (("+", 3, 3),), 300)),
             score=answer_and_format, answer_threshold=0.9, format_rate=0.5,
             notes="reward 1.0/0.9/0.1/0.0 = answer x format; use --ingress answer"),
    )
}


def _register_search() -> None:
    from .search import SearchBenchmark, SearchTask

    TASKS["search"] = SearchTask()
    TASKS["search_mix"] = SearchTask(
        # half of the questions need a third lookup the warm start never shows (92 % of their groups all wrong after it,
        # the rest 2-12 % zero-variance: docs/results/search_mix), so about half of the fresh groups start zero-variance
        name="search_mix", train_kinds=("hop1", "boss", "hop2", "hop3", "hop3", "hop3"),
        warmstart_kinds=("hop1", "boss", "hop2"),
        max_tool_calls=3,
        benchmarks=(SearchBenchmark("hop1", "hop1", 40), SearchBenchmark("boss", "boss", 40),
                    SearchBenchmark("hop2", "hop2", 40), SearchBenchmark("hop3", "hop3", 40)),
        warmstart_overrides=(("batch", 64), ("eval_every", 20), ("eval_prompts", 24)),
        zero_variance_band=(0.40, 0.60),
        notes="search from one to three lookups, warm-started to about half zero-variance fresh groups")


_register_search()


def _register_geo() -> None:
    from .geo import GeoTask

    TASKS["geo"] = GeoTask()


_register_geo()


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    return TASKS[name]
