"""HDRGRPOTrainer with vision-language models through trainer.train(): a tiny Qwen2-VL (mrope) and a tiny LLaVA
(1-D rope), built locally and reloaded with from_pretrained, on the geo task's PIL images."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("trl")
pytestmark = [pytest.mark.trl, pytest.mark.multimodal]

from trl import GRPOTrainer  # noqa: E402

from hdreplay import ReplayController  # noqa: E402
from hdreplay.integrations.trl import HDRGRPOTrainer  # noqa: E402
from hdreplay.integrations.trl.mm import NUM_IMAGES, group_inputs, row_inputs  # noqa: E402
from hdreplay_lab.sandbox.geo import GeoTask  # noqa: E402
from hdreplay_lab.sandbox.vlm import build_tiny_vlm, load_vlm  # noqa: E402
from trl_fixtures import (  # noqa: E402
    RecordingTrainer,
    buffer_hash,
    grpo_and_replay_none,
    loss_log,
    make_args,
    plain_config,
)

TASK = GeoTask()


def reward_digit(completions, **kw):
    """1 if a digit appears in the completion: mixed outcomes under a random model."""
    text = lambda c: c[0]["content"] if isinstance(c, list) else c  # noqa: E731
    return [float(any(ch.isdigit() for ch in text(c)[:3])) for c in completions]


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return {arch: build_tiny_vlm(root / arch, arch=arch, chars=TASK.vocab, hidden=32) for arch in ("qwen2vl", "llava")}


def vlm(vlm_dirs, arch="qwen2vl"):
    model, proc = load_vlm(vlm_dirs[arch])
    with torch.no_grad():  # larger weights: images and positions change the log-probs visibly
        for p in model.parameters():
            p.mul_(3.0)
    return model, proc


def dataset(k=64, seed=0):
    return TASK.dataset(TASK.train_problems(k, seed=seed))


def vlm_args(out, **over):
    kw = dict(max_steps=4, per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=2,
              max_completion_length=4, replay_k_rep=2, replay_tau=10.0, disable_dropout=True, learning_rate=2e-2)
    kw.update(over)
    return make_args(out, **kw)


def train(vlm_dirs, out, arch="qwen2vl", cls=RecordingTrainer, **over):
    model, proc = vlm(vlm_dirs, arch)
    tr = cls(model=model, reward_funcs=reward_digit, args=vlm_args(out, **over), train_dataset=dataset(),
             processing_class=proc)
    tr.train()
    return tr


@pytest.mark.parametrize("arch", ["qwen2vl", "llava"])
def test_replayed_rows_carry_their_own_images_through_trls_forward(vlm_dirs, tmp_path, arch):
    """lr = 0: every replayed row's log-probs under TRL's own multimodal forward equal the stored generation-time
    ones (ratio exactly 1), which only holds with the group's own image and the right positions."""
    tr = train(vlm_dirs, tmp_path, arch, learning_rate=0.0)
    assert tr._is_vlm and tr.replay_padding_drift < 1e-5
    assert (tr._position_hook is None) == (arch == "qwen2vl")  # mrope: no 1-D position-id hook
    steps = [json.loads(x) for x in open(tmp_path / "replay" / "steps.jsonl")]
    assert sum(s["accepted"] for s in steps) > 0
    assert all(d is not None and d < 1e-9 for s in steps for d in s["scan_drift"])  # Drift 0 at unchanged weights
    replayed = [r for r in tr.records if r["is_replay"].any()]
    assert replayed
    stored = {g: (lp, m) for s in tr.selections for g, lp, m in zip(s["groups"], s["stored_logps"], s["stored_mask"])}
    assert stored
    for r in replayed:
        m = r["mask"].bool()
        assert (r["now"] - r["old"])[m].abs().max() < 1e-5
        imgs = r["images"]
        assert imgs["num_images"] == [1] * r["now"].shape[0]
        if arch == "qwen2vl":
            assert imgs["image_grid_thw"].tolist() == [[1, 4, 4]] * r["now"].shape[0]
            assert imgs["pixel_values"].shape == (16 * r["now"].shape[0], 1176)
        else:
            assert imgs["pixel_values"].shape == (r["now"].shape[0], 3, 56, 56)
    # the buffer holds each group's inputs once
    buf = tr.replay.buffer
    groups = buf.get(buf.insertion_ids().tolist())
    assert groups and all(int(g.mm_inputs[NUM_IMAGES]) == 1 for g in groups)
    assert buf.mm_nbytes() < 1.1 * sum(g.mm_nbytes for g in groups)


def test_a_wrong_image_changes_the_logprobs(vlm_dirs, tmp_path):
    """The equality above is not vacuous: re-scoring stored groups with another group's image moves them."""
    tr = train(vlm_dirs, tmp_path, learning_rate=0.0, max_steps=2)
    buf = tr.replay.buffer
    a, b = buf.get(buf.insertion_ids()[:2].tolist())
    image = {**a.mm_inputs, "pixel_values": b.mm_inputs["pixel_values"]}
    assert not torch.equal(image["pixel_values"], a.mm_inputs["pixel_values"])
    swapped = type(a)(**{**{f: getattr(a, f) for f in a.__dataclass_fields__}, "mm_inputs": image})
    own, other = tr._replay_scorer([a]), tr._replay_scorer([swapped])
    assert (own[0] - a.logprobs)[a.loss_mask].abs().max() < 1e-5
    assert (other[0] - a.logprobs)[a.loss_mask].abs().max() > 1e-3


def test_replay_happens_and_moves_the_policy(vlm_dirs, tmp_path):
    tr = train(vlm_dirs, tmp_path, replay_tau=10.0)
    later = [r for r in tr.records if r["is_replay"].any() and r["global_step"] >= 2]
    assert later and any((r["now"] - r["old"])[r["mask"].bool()].abs().max() > 1e-3 for r in later)
    logs = [h for h in tr.state.log_history if "replay/accepted" in h]
    assert logs and sum(h["replay/accepted"] for h in logs) > 0


def test_selector_none_equals_grpo_trainer_loss_for_loss(vlm_dirs, tmp_path):
    common = dict(max_steps=3, seed=7)
    g, h = grpo_and_replay_none(lambda: vlm(vlm_dirs), dataset, vlm_args(tmp_path / "a", **common),
                                vlm_args(tmp_path / "b", replay_selector="none", **common), reward_digit)
    a, b = loss_log(g), loss_log(h)
    assert len(a) == 3 and a == b


def test_a_vlm_without_replay_resumed_with_true_continues_from_its_weights(vlm_dirs, tmp_path):
    """Replay off (selector none): ``resume_from_checkpoint=True`` is resolved as the Trainer resolves it
    (transformers' get_last_checkpoint), and the weights saved under their original key names are reloaded there too
    (huggingface/transformers#43701): the resumed steps train as the uninterrupted run's."""
    over = dict(max_steps=6, save_strategy="steps", save_steps=3, replay_selector="none", seed=7)
    full = train(vlm_dirs, tmp_path / "full", **over)
    shutil.copytree(tmp_path / "full" / "checkpoint-3", tmp_path / "again" / "checkpoint-3")
    model, proc = vlm(vlm_dirs)
    resumed = RecordingTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "again", **over),
                               train_dataset=dataset(), processing_class=proc)
    assert not resumed.replay_active
    resumed.train(resume_from_checkpoint=True)
    assert len(loss_log(full)) == 6 and loss_log(resumed)[-3:] == loss_log(full)[3:]
    wa, wb = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("how", ["path", "newest"])
def test_checkpoint_resume_equals_uninterrupted(vlm_dirs, tmp_path, how):
    """Also the VLM weights transformers 5 saves under their original key names (huggingface/transformers#43701):
    without hdreplay's reload the resumed run continues from the initial weights and selects other groups."""
    over = dict(max_steps=6, save_strategy="steps", save_steps=3, replay_tau=5.0)  # some scanned groups pass, some not
    full = train(vlm_dirs, tmp_path / "full", **over)
    ck = tmp_path / "full" / "checkpoint-3" / "hdreplay"
    assert ReplayController.verify(ck) is not None
    model, proc = vlm(vlm_dirs)
    out = tmp_path / "full"
    if how == "newest":  # train(resume_from_checkpoint=True) in a directory whose newest checkpoint is step 3
        out = tmp_path / "again"
        shutil.copytree(tmp_path / "full" / "checkpoint-3", out / "checkpoint-3")
    resumed = RecordingTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(out, **over),
                               train_dataset=dataset(), processing_class=proc)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3") if how == "path" else True)
    tail = [{k: s[k] for k in ("step", "groups")} for s in full.selections[3:]]
    assert [{k: s[k] for k in ("step", "groups")} for s in resumed.selections] == tail
    assert sum(len(s["groups"]) for s in tail) > 0
    assert full.buffer_hashes[-1] == resumed.buffer_hashes[-1] == buffer_hash(resumed.replay)
    assert resumed.replay.buffer.mm_schema and "pixel_values" in resumed.replay.buffer.mm_schema


# ---------------------------------------------------------------------------------------------------------- refusals
def test_images_with_a_text_model_are_refused(tmp_path):
    from hdreplay_lab.sandbox.model import build_tiny_model, load_model

    model, tok = load_model(build_tiny_model(tmp_path / "text", chars=TASK.vocab, hidden=16, layers=1))
    with pytest.raises(ValueError, match="image column .* not a processor"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "o"), train_dataset=dataset(),
                       processing_class=tok)


def test_a_vlm_processor_with_a_text_only_model_is_refused(vlm_dirs, tmp_path):
    from hdreplay_lab.sandbox.model import build_tiny_model, load_model

    model, _ = load_model(build_tiny_model(tmp_path / "text", chars=TASK.vocab, hidden=16, layers=1))
    _, proc = vlm(vlm_dirs)
    with pytest.raises(ValueError, match="without a vision tower"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "o"), train_dataset=dataset(),
                       processing_class=proc)


def test_a_processor_without_an_image_processor_is_refused(vlm_dirs, tmp_path):
    model, proc = vlm(vlm_dirs)
    proc.image_processor = None
    with pytest.raises(ValueError, match="without an image processor"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "o"), train_dataset=dataset(),
                       processing_class=proc)


def test_grow_micro_steps_are_refused_for_a_vlm(vlm_dirs, tmp_path):
    model, proc = vlm(vlm_dirs)
    with pytest.raises(ValueError, match="replay_micro_step='grow' is not supported for vision-language"):
        HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "o", replay_micro_step="grow"),
                       train_dataset=dataset(), processing_class=proc)


def test_a_buffer_of_foreign_images_is_refused_before_it_changes(vlm_dirs, tmp_path):
    """A buffer filled under another image setting (here: float64 pixels) meets this run's processor: the first
    step refuses it naming the key, and the buffer is exactly what it was."""
    first = train(vlm_dirs, tmp_path / "a", max_steps=2, learning_rate=0.0)
    g = first.replay.buffer.get([first.replay.buffer.insertion_ids()[0]])[0]
    foreign = type(g)(**{**{f: getattr(g, f) for f in g.__dataclass_fields__},
                         "mm_inputs": {**g.mm_inputs, "pixel_values": g.mm_inputs["pixel_values"].double()}})
    model, proc = vlm(vlm_dirs)
    tr = HDRGRPOTrainer(model=model, reward_funcs=reward_digit, args=vlm_args(tmp_path / "b"), train_dataset=dataset(),
                        processing_class=proc)
    tr.replay.buffer.append([foreign], ref_headroom=[0.5], step=0)
    tr.replay.last_step = 0
    before = buffer_hash(tr.replay)
    with pytest.raises(ValueError, match="pixel_values.*float64.*resume with the same processor"):
        tr.train()
    assert buffer_hash(tr.replay) == before


def test_rows_with_images_in_the_completion_or_disagreeing_images_are_not_stored(vlm_dirs, tmp_path):
    """Unit checks on a real TRL batch (captured from GRPOTrainer's own generation)."""
    seen = {}

    class Probe(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.setdefault("out", {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
            return out

    base = vlm_args(tmp_path / "p", max_steps=1)
    plain = plain_config(base)
    model, proc = vlm(vlm_dirs)
    Probe(model=model, reward_funcs=reward_digit, args=plain, train_dataset=dataset(), processing_class=proc).train()
    out = seen["out"]
    rows, why = row_inputs(out)
    assert why == [None] * len(rows) and set(rows[0]) == {NUM_IMAGES, "pixel_values", "image_grid_thw",
                                                         "mm_token_type_ids"}
    P = out["prompt_ids"].shape[1]
    assert int(rows[0]["mm_token_type_ids"].sum()) == int((out["prompt_ids"][0] == model.config.image_token_id).sum())
    inputs, reason = group_inputs(rows, why, slice(0, 4))
    assert reason is None and torch.equal(inputs["pixel_values"], rows[0]["pixel_values"])
    bad = dict(out)
    bad["mm_token_type_ids"] = out["mm_token_type_ids"].clone()
    bad["mm_token_type_ids"][1, P] = 1  # a vision token inside row 1's completion
    rows2, why2 = row_inputs(bad)
    assert why2[1] is not None and "completion" in why2[1]
    assert group_inputs(rows2, why2, slice(0, 4))[1] == why2[1]
    rows[2] = {**rows[2], "pixel_values": rows[2]["pixel_values"] + 1}
    assert "not its images" in group_inputs(rows, why, slice(0, 4))[1]
