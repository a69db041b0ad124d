"""Tiny VLMs built locally and reloaded with from_pretrained; the geo warm start, evaluation with images, and
plain TRL GRPOTrainer.train() on them (the path HDRGRPOTrainer's multimodal support has to match)."""

import json

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.multimodal

from hdreplay_lab.sandbox.geo import GeoTask  # noqa: E402
from hdreplay_lab.sandbox.model import load_model  # noqa: E402
from hdreplay_lab.sandbox.vlm import build_tiny_vlm, load_vlm, sample_vlm, sft_batch  # noqa: E402

TASK = GeoTask()


@pytest.fixture(scope="module", params=["qwen2vl", "llava"])
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), arch=request.param, chars=TASK.vocab, hidden=32)


def test_tiny_vlm_round_trips_through_from_pretrained(vlm_dir):
    model, proc = load_vlm(vlm_dir)
    arch = json.loads((vlm_dir / "config.json").read_text())["architectures"][0]
    assert type(model).__name__ == arch and arch in ("Qwen2VLForConditionalGeneration", "LlavaForConditionalGeneration")
    assert hasattr(proc, "image_processor") and proc.tokenizer.padding_side == "left"
    # the lab's loader recognises the VLM directory and returns the same classes and weights
    m2, p2 = load_model(vlm_dir)
    assert type(m2) is type(model) and type(p2) is type(proc)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    # each vision placeholder is one token of the character vocabulary
    image_token = getattr(proc, "image_token")
    assert proc.tokenizer(image_token, add_special_tokens=False)["input_ids"] == [model.config.image_token_id]


def test_load_vlm_refuses_text_models_and_empty_dirs(tmp_path):
    from hdreplay_lab.sandbox.model import build_tiny_model

    text = build_tiny_model(tmp_path / "text", chars=TASK.vocab, hidden=16, layers=1)
    with pytest.raises(ValueError, match="processor_config"):
        load_vlm(text)
    with pytest.raises(ValueError, match="no config.json"):
        load_vlm(tmp_path)


def test_sft_batch_puts_the_loss_on_the_target_only(vlm_dir):
    model, proc = load_vlm(vlm_dir)
    probs = TASK.train_problems(3, seed=0)
    targets = ["[12]", "7", "[3]"]
    batch = sft_batch(proc, [p.prompt for p in probs], [p.image() for p in probs], targets)
    ids, labels = batch["input_ids"], batch["labels"]
    for i, t in enumerate(targets):
        kept = labels[i][labels[i] != -100]
        assert proc.tokenizer.decode(kept) == t + proc.tokenizer.eos_token
        assert torch.equal(kept, ids[i, -len(kept):])
    n_img = int((ids == model.config.image_token_id).sum(1)[0])
    assert n_img == {"Qwen2VLForConditionalGeneration": 4, "LlavaForConditionalGeneration": 16}[type(model).__name__]
    loss = model(**batch).loss
    assert torch.isfinite(loss) and loss.item() > 0


def test_the_model_sees_the_image(vlm_dir):
    """Same prompt, different image: the training forward's logits differ (the image reaches the text model)."""
    model, proc = load_vlm(vlm_dir)
    p, q = TASK.train_problems(2, seed=3)
    batch = sft_batch(proc, [p.prompt, p.prompt], [p.image(), q.image()], ["1", "1"])
    batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch).logits
    assert (logits[0, -1] - logits[1, -1]).abs().max() > 1e-4


def test_sample_vlm_is_seeded_and_shaped(vlm_dir):
    model, proc = load_vlm(vlm_dir)
    probs = TASK.train_problems(3, seed=0)
    args = ([p.prompt for p in probs], [p.image() for p in probs])
    a = sample_vlm(model, proc, *args, n=4, max_new_tokens=5, seed=7)
    assert len(a) == 3 and all(len(c) == 4 and all(isinstance(s, str) for s in c) for c in a)
    assert a == sample_vlm(model, proc, *args, n=4, max_new_tokens=5, seed=7)
    assert a != sample_vlm(model, proc, *args, n=4, max_new_tokens=5, seed=8)


def test_geo_warm_start_caches_a_vlm_and_evaluates_with_images(tmp_path):
    from hdreplay_lab.sandbox.evaluate import evaluate
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, warm_start

    task = TASK.with_sizes(4)
    cfg = WarmStartConfig(arch="qwen2vl", hidden=32, layers=1, max_steps=6, eval_every=3, eval_prompts=2, eval_n=2,
                          batch=8, target=2.0)
    logs = []
    out = warm_start(task, tmp_path, cfg, log=logs.append)
    meta = json.loads((out / "warmstart.json").read_text())
    assert meta["steps"] == 6 and len(meta["history"]) == 2 and len(logs) == 2
    model, proc = load_model(out)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert warm_start(task, tmp_path, cfg, log=logs.append) == out and len(logs) == 2  # cached
    ev = evaluate(model, proc, task, n=2, seed=0)
    assert set(ev["benchmarks"]) == {"read", "sum", "perim"}
    assert all(0.0 <= v["mean_at_n"] <= v["best_at_n"] <= 1.0 and v["size"] == 4 for v in ev["benchmarks"].values())


@pytest.fixture(scope="module")
def geo_vlm(tmp_path_factory):
    """A tiny Qwen2-VL warm-started for a few seconds: it writes answers in both formats, mostly wrong ones, so
    GRPO groups have mixed rewards."""
    from hdreplay_lab.sandbox.warmstart import WarmStartConfig, warm_start

    cfg = WarmStartConfig(arch="qwen2vl", hidden=32, layers=1, max_steps=60, eval_every=60, eval_prompts=2, eval_n=1,
                          batch=16, lr=3e-3, target=2.0)
    return warm_start(TASK, tmp_path_factory.mktemp("geo-ws"), cfg, log=lambda *_: None)


def test_plain_trl_grpo_trains_the_tiny_vlm_on_geo(tmp_path, geo_vlm):
    """TRL 1.16's own GRPOTrainer.train() on the geo dataset: VLM path on, images in the scoring batch, weights move."""
    from trl import GRPOConfig, GRPOTrainer

    model, proc = load_vlm(geo_vlm)
    probs = TASK.train_problems(16, seed=0)
    seen = {}

    class Probe(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.setdefault("out", out)
            return out

    args = GRPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=TASK.completion_width(probs), max_steps=2, learning_rate=1e-3, bf16=False,
                      gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no",
                      disable_dropout=True, dataloader_num_workers=0, seed=0, beta=0.0)
    tr = Probe(model=model, processing_class=proc, args=args, train_dataset=TASK.dataset(probs),
               reward_funcs=TASK.reward_func())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr.train()
    assert tr._is_vlm
    out = seen["out"]
    B = out["prompt_ids"].shape[0]
    assert B == 8 and out["num_images"] == [1] * B
    assert out["pixel_values"].shape == (16 * B, 1176) and out["image_grid_thw"].tolist() == [[1, 4, 4]] * B
    assert (out["prompt_ids"] == model.config.image_token_id).sum(1).tolist() == [4] * B
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    logs = [h for h in tr.state.log_history if "reward" in h]
    assert len(logs) == 2 and all(0.0 <= h["reward"] <= 1.0 for h in logs) and logs[0]["reward_std"] > 0
