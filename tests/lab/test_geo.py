"""The ``geo`` task: images that carry the answer, the Geometry3K reward, held-out splits, the tiny VLM."""

import numpy as np
import pytest

from hdreplay import make_ingress_rule
from hdreplay_lab.sandbox.geo import (
    FONT,
    INK,
    PATCH,
    QUESTIONS,
    SCALE,
    SHAPES,
    GeoTask,
    completion_text,
    geo_score,
    render,
)
from hdreplay_lab.sandbox.tasks import get_task

pytestmark = pytest.mark.multimodal


def read_labels(img, shape: str) -> dict:
    """Read every label of a geo image back by template matching the 3x5 font (independent of the renderer's
    drawing code: it only knows where a label's patch is and what the glyphs look like)."""
    a = np.asarray(img)
    ink = np.all(a == np.array(INK, dtype=a.dtype), axis=-1)
    out = {}
    for name, (r, c) in SHAPES[shape]["labels"].items():
        cell = ink[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
        ys, xs = np.nonzero(cell)
        y0, x0 = ys.min(), xs.min()
        glyph = cell[y0:y0 + 5 * SCALE:SCALE, x0:x0 + 3 * SCALE:SCALE]
        hits = [d for d, rows in FONT.items()
                if glyph.shape == (5, 3)
                and np.array_equal(glyph, np.array([[ch == "1" for ch in row] for row in rows]))]
        assert len(hits) == 1, (name, glyph)
        out[name] = int(hits[0])
    return out


@pytest.mark.parametrize("text, answer, reward", [
    ("[11]", "11", 1.0), ("11", "11", 0.9), (" [11] ", "11", 1.0), ("11]", "11", 0.9), ("[11", "11", 0.9),
    ("[12]", "11", 0.1), ("12", "11", 0.0), ("", "11", 0.0), ("[]", "11", 0.0), ("[1]1", "11", 0.0),
    ("[11][11]", "11", 0.9), ("x=11", "11", 0.9), ("[-3]", "-3", 1.0), ("[111]", "11", 0.1),
])
def test_geo3k_reward_is_answer_times_format(text, answer, reward):
    assert geo_score(text, answer) == reward
    # TRL hands a VLM's reward function conversational completions
    assert geo_score([{"role": "assistant", "content": text}], answer) == reward
    assert geo_score([{"role": "assistant", "content": [{"type": "text", "text": text}]}], answer) == reward


def test_completion_text_never_raises_on_malformed_completions():
    for bad in (None, [], [{}], [{"role": "assistant", "content": None}], 3, [{"content": 5}]):
        assert completion_text(bad) == "" and geo_score(bad, "4") == 0.0


def test_the_answer_is_in_the_image_and_not_in_the_question():
    task = GeoTask()
    problems = task.train_problems(300, seed=1)
    for p in problems:
        values = read_labels(p.image(), p.shape)
        assert values == dict(p.values)
        fn = next(q[3] for q in QUESTIONS if q[:2] == (p.shape, p.question))
        assert str(fn(values)) == p.answer
    # the question text alone does not determine the answer: every question is asked with several answers
    answers = {}
    for p in problems:
        answers.setdefault((p.shape, p.question), set()).add(p.answer)
    assert len(answers) == len(QUESTIONS) and all(len(a) >= 3 for a in answers.values())


def test_rendering_is_deterministic_and_jitter_moves_the_labels():
    img = render("tri", {"x": 3, "y": 8, "z": 5}, ((0, 0), (1, 2), (2, 1)))
    assert np.array_equal(np.asarray(img),
                          np.asarray(render("tri", {"x": 3, "y": 8, "z": 5}, ((0, 0), (1, 2), (2, 1)))))
    assert img.size == (56, 56) and img.mode == "RGB"
    moved = render("tri", {"x": 3, "y": 8, "z": 5}, ((1, 0), (1, 2), (2, 1)))
    assert not np.array_equal(np.asarray(img), np.asarray(moved))
    assert read_labels(moved, "tri") == read_labels(img, "tri") == {"x": 3, "y": 8, "z": 5}


def test_benchmarks_are_held_out_and_cover_each_family():
    task = get_task("geo")
    assert isinstance(task, GeoTask) and task.is_multimodal and not task.is_multiturn
    held = task.heldout_keys()
    train = task.train_problems(2000, seed=0)
    assert not held & {p.key for p in train}
    for b in task.benchmarks:
        probs = task.benchmark_problems(b)
        assert len(probs) == b.size == len({p.key for p in probs})
        assert {p.family for p in probs} == {b.family}
        assert all(task.score(f"[{p.answer}]", p.answer) == 1.0 for p in probs)
        assert [p.key for p in probs] == [p.key for p in task.benchmark_problems(b)]  # fixed across calls
    assert {b.family for b in task.benchmarks} == {"read", "sum", "perim"}
    assert task.train_problems(50, seed=0) == task.train_problems(50, seed=0) != task.train_problems(50, seed=1)


def test_answer_based_ingress_drops_format_only_groups():
    from hdreplay_lab.synthetic import TablePolicy, make_group

    policy = TablePolicy(vocab=8, seed=0)
    task = GeoTask()
    answer, mixed = make_ingress_rule("answer", answer_threshold=task.answer_threshold), make_ingress_rule("mixed")

    def admitted(texts, truth="7"):
        g = make_group(0, policy=policy, step=0, n=len(texts), rewards=[geo_score(t, truth) for t in texts])
        return mixed(g), answer(g)

    assert admitted(["[3]", "3", "[4]", "5"]) == (True, False)  # rewards 0.1 / 0.0: format-only variance
    assert admitted(["[7]", "7", "[3]", "3"]) == (True, True)
    assert admitted(["[7]", "7", "7", "[7]"]) == (True, False)  # all right, only the format varies
    assert admitted(["[3]", "[4]", "[5]", "[6]"]) == (False, False)


def test_compare_on_geo_defaults_to_the_papers_multimodal_set_and_answer_ingress():
    from hdreplay_lab.sandbox.compare import CompareConfig
    from hdreplay_lab.sandbox.methods import METHODS

    cfg = CompareConfig(task="geo")
    assert cfg.methods == ("onpolicy_matched", "onpolicy_larger", "dapo", "headroom_drift")
    hd = cfg.replay_config(METHODS["headroom_drift"])
    assert (hd["ingress"], hd["answer_threshold"]) == ("answer", 0.9)
    mixed = CompareConfig(task="geo", replay={"ingress": "mixed"}).replay_config(METHODS["headroom_drift"])
    assert mixed["ingress"] == "mixed"
    assert CompareConfig(task="add").replay_config(METHODS["headroom_drift"])["ingress"] == "mixed"
