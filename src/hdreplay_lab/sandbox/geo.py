"""``geo``: a synthetic visual geometry task with the Geometry3K reward structure.

Each problem is a 56x56 image drawn locally with PIL (a segment split at a point, a rectangle, or a
triangle) whose parts carry labelled lengths 1..9, and a short question that names the quantity
asked for. The numbers are only in the image, so the answer needs reading it::

    image: segment A--C--B, "4" over AC, "7" over CB         question "ab=?"   answer 11
    image: rectangle, "3" over the top side, "5" beside      question "w+h=?"  answer 8
    image: triangle, "2" "6" "5" beside its three sides      question "p=?"    answer 13

Digits are drawn from a fixed 3x5 bitmap font scaled x2 (no font files, identical on every machine),
each label inside its own 14x14 image patch with a small random offset (``jitter`` pixels).

Reward (the paper's Geometry3K table): answer x format, ``1.0`` right answer in the format ``[n]``,
``0.9`` right answer without it, ``0.1`` wrong answer in the format, ``0.0`` neither. The answer is the
first integer of the completion; the format holds iff the completion is exactly ``[<integer>]``.
Answer-based ingress uses threshold 0.9 (a_i = 1[r_i >= 0.9]).

Question families (the held-out benchmarks are one per family, disjoint from the training problems):

    read   one label:        seg "ac=?" "cb=?", rect "w=?" "h=?", tri "x=?" "y=?" "z=?"
    sum    two labels:       seg "ab=?" (AC + CB), rect "w+h=?"
    perim  perimeter:        rect "p=?" (2w + 2h), tri "p=?" (x + y + z)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace
from typing import Any

SIDE = 56  # image side in pixels (4 x 4 patches of 14)
PATCH = 14
VOCAB = "0123456789+=?[]: abcdefghijklmnopqrstuvwxyz"  # the chat template writes "user:" / "assistant:"
FONT = {  # 3 x 5 bitmap digits, rows top to bottom
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
}
SCALE = 2  # a digit is 6 x 10 pixels
#: the background is the image processor's normalisation mean, so an empty patch embeds to ~0 and a patch's
#: features are its ink: on a white background a ~200k-parameter VLM did not learn to read the digits in 500
#: warm-start steps (loss stayed at the prior); on this grey it does in ~100
BACKGROUND = (122, 117, 104)
INK = (255, 255, 255)
LINE = (0, 0, 0)

#: per shape: the drawn outline (polylines, pixel coordinates) and the patch (row, col) of each label
SHAPES: dict[str, dict[str, Any]] = {
    "seg": {"lines": [((3, 38), (52, 38))], "ticks": [(3, 38), (28, 38), (52, 38)],
            "labels": {"ac": (1, 0), "cb": (1, 3)}},
    "rect": {"lines": [((8, 18), (40, 18), (40, 50), (8, 50), (8, 18))], "ticks": [],
             "labels": {"w": (0, 1), "h": (2, 3)}},
    "tri": {"lines": [((28, 16), (6, 52), (50, 52), (28, 16))], "ticks": [],
            "labels": {"x": (1, 0), "y": (1, 3), "z": (0, 1)}},
}
#: (shape, question text, family, answer as a function of the labels)
QUESTIONS: tuple = (
    ("seg", "ac=?", "read", lambda v: v["ac"]), ("seg", "cb=?", "read", lambda v: v["cb"]),
    ("seg", "ab=?", "sum", lambda v: v["ac"] + v["cb"]),
    ("rect", "w=?", "read", lambda v: v["w"]), ("rect", "h=?", "read", lambda v: v["h"]),
    ("rect", "w+h=?", "sum", lambda v: v["w"] + v["h"]), ("rect", "p=?", "perim", lambda v: 2 * (v["w"] + v["h"])),
    ("tri", "x=?", "read", lambda v: v["x"]), ("tri", "y=?", "read", lambda v: v["y"]),
    ("tri", "z=?", "read", lambda v: v["z"]), ("tri", "p=?", "perim", lambda v: v["x"] + v["y"] + v["z"]),
)
FAMILIES = ("read", "sum", "perim")


@dataclass(frozen=True)
class GeoProblem:
    shape: str
    question: str
    values: tuple  # (label, value) pairs, in SHAPES[shape]["labels"] order
    answer: str
    family: str
    offsets: tuple  # per label (dx, dy) pixel offset inside its patch

    @property
    def key(self) -> tuple:
        """Identity for the held-out split: shape, question and labels (not the jitter)."""
        return self.shape, self.question, self.values

    @property
    def prompt(self) -> list[dict]:
        """The conversational prompt TRL expects for a VLM (TRL inserts the image part)."""
        return [{"role": "user", "content": self.question}]

    def image(self):
        return render(self.shape, dict(self.values), self.offsets)


def render(shape: str, values: dict, offsets) -> "Image.Image":  # noqa: F821
    """The problem's 56x56 RGB image (deterministic given its arguments)."""
    from PIL import Image, ImageDraw

    spec = SHAPES[shape]
    img = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for line in spec["lines"]:
        draw.line(line, fill=LINE, width=1)
    for x, y in spec["ticks"]:
        draw.line(((x, y - 3), (x, y + 3)), fill=LINE, width=1)
    for (name, (r, c)), (dx, dy) in zip(spec["labels"].items(), offsets):
        _digit(draw, str(values[name]), c * PATCH + 4 + dx, r * PATCH + 2 + dy)
    return img


def _digit(draw, ch: str, x0: int, y0: int) -> None:
    for j, row in enumerate(FONT[ch]):
        for i, bit in enumerate(row):
            if bit == "1":
                draw.rectangle((x0 + i * SCALE, y0 + j * SCALE, x0 + (i + 1) * SCALE - 1, y0 + (j + 1) * SCALE - 1),
                               fill=INK)


def make_geo_problem(rng: random.Random, q: tuple, jitter: int) -> GeoProblem:
    shape, text, family, fn = q
    names = list(SHAPES[shape]["labels"])
    values = {n: rng.randint(1, 9) for n in names}
    offsets = tuple((rng.randint(0, jitter), rng.randint(0, jitter)) for _ in names)
    return GeoProblem(shape, text, tuple(values.items()), str(fn(values)), family, offsets)


_ANSWER = re.compile(r"-?\d+")
_FORMAT = re.compile(r"\[-?\d+\]")


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, list):  # content parts
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""
    return ""


def geo_score(completion, answer: str) -> float:
    """Geometry3K reward: 1.0 / 0.9 / 0.1 / 0.0 = (answer right, format right) x (yes, no)."""
    text = completion_text(completion).strip()
    m = _ANSWER.search(text)
    right = m is not None and m.group(0) == answer
    fmt = _FORMAT.fullmatch(text) is not None
    return {(True, True): 1.0, (True, False): 0.9, (False, True): 0.1, (False, False): 0.0}[(right, fmt)]


@dataclass(frozen=True)
class GeoBenchmark:
    name: str
    family: str
    size: int


@dataclass(frozen=True)
class GeoTask:
    """The ``geo`` task: the interface the sandbox runner, warm start and evaluation use."""

    name: str = "geo"
    vocab: str = VOCAB
    benchmarks: tuple = (GeoBenchmark("read", "read", 100), GeoBenchmark("sum", "sum", 80),
                         GeoBenchmark("perim", "perim", 80))
    jitter: int = 2
    answer_threshold: float | None = 0.9
    default_ingress: str = "answer"  # `hdreplay compare --task geo` trains with answer-based ingress unless told
    format_rate: float = 0.5  # share of warm-start targets written in the [n] format
    arch: str = "qwen2vl"
    #: a ~270k-parameter Qwen2-VL; it reaches macro Mean@4 ~0.25 after ~1000 steps of batch 64 (~10 min on 2 cores)
    warmstart_overrides: tuple = (("arch", "qwen2vl"), ("hidden", 64), ("layers", 2), ("batch", 64), ("lr", 1e-3),
                                  ("eval_every", 100), ("eval_prompts", 32), ("target", 0.25))
    notes: str = "visual: labels are read from the image; reward 1.0/0.9/0.1/0.0 = answer x format; --ingress answer"
    extra: dict = field(default_factory=dict)

    @property
    def is_multiturn(self) -> bool:
        return False

    @property
    def is_multimodal(self) -> bool:
        return True

    def benchmark_problems(self, bench: GeoBenchmark) -> list[GeoProblem]:
        rng = random.Random(f"geo/bench/{bench.name}")
        pool = [q for q in QUESTIONS if q[2] == bench.family]
        seen, out = set(), []
        while len(out) < bench.size:
            p = make_geo_problem(rng, rng.choice(pool), self.jitter)
            if p.key not in seen:
                seen.add(p.key)
                out.append(p)
        return out

    def heldout_keys(self) -> set:
        return {p.key for b in self.benchmarks for p in self.benchmark_problems(b)}

    def heldout_prompts(self) -> set:
        return self.heldout_keys()

    def train_problems(self, k: int, seed: int) -> list[GeoProblem]:
        rng = random.Random(f"geo/train/{seed}")
        held = self.heldout_keys()
        out = []
        while len(out) < k:
            p = make_geo_problem(rng, rng.choice(QUESTIONS), self.jitter)
            if p.key not in held:
                out.append(p)
        return out

    def target(self, p: GeoProblem, rng: random.Random) -> str:
        """Warm-start completion: the answer, in the ``[n]`` format with probability ``format_rate``."""
        return f"[{p.answer}]" if rng.random() < self.format_rate else p.answer

    def score(self, completion, answer: str) -> float:
        return geo_score(completion, answer)

    def reward_func(self):
        from .rewards import score_reward

        return score_reward(self.name, self.score)

    def dataset(self, problems):
        """A ``datasets.Dataset`` with TRL's VLM columns: conversational ``prompt``, ``image``, ``answer``."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [p.prompt for p in problems], "image": [p.image() for p in problems],
                                  "answer": [p.answer for p in problems]})

    def completion_width(self, problems) -> int:
        """max_new_tokens: ``[`` + answer digits + ``]`` + EOS."""
        return max(len(p.answer) for p in problems) + 3

    def with_sizes(self, size: int) -> "GeoTask":
        return replace(self, benchmarks=tuple(replace(b, size=min(b.size, size)) for b in self.benchmarks))


