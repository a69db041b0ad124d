"""Tiny vision-language models built locally and loaded back through ``from_pretrained``.

Two real transformers VLM classes, random-init, with a locally built processor (the character-level
tokenizer of :mod:`.model` plus the vision special tokens, and a ``*Pil`` image processor):

``qwen2vl``  ``Qwen2VLForConditionalGeneration``: 3-D multimodal rotary positions (mrope). A 56x56
             image is 16 patches of 14x14 merged 2x2 into 4 image tokens.
``llava``    ``LlavaForConditionalGeneration`` (CLIP vision tower + Qwen2 text): 1-D rotary positions;
             a 56x56 image is 16 image tokens.

Chat format (no newlines, the vocabulary has none)::

    user:<|vision_start|><|image_pad|><|vision_end|>ab=?<eos>assistant:[7]<eos>

The processor expands the single ``<|image_pad|>`` (LLaVA: ``<image>``) to the image's token count.
transformers 5.x builds ``Qwen2VLProcessor`` only with torchvision (it type-checks the video processor,
even an absent one), which cannot be installed next to the CPU torch here, so ``TinyQwen2VLProcessor``
is that processor without a video processor. ``AutoProcessor`` does not know the subclass by name and
silently falls back to the bare tokenizer, so load with :func:`load_vlm`, which picks the class from
``processor_config.json``; pass the processor explicitly as ``processing_class`` to TRL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import Qwen2VLProcessor

from .chartok import DEFAULT_CHARS, EOS, build_tokenizer, quiet_hf_progress

IMAGE_SIZE = 56  # pixels per side of the sandbox images
QWEN_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LLAVA_SPECIALS = ("<image>",)
ARCHS = ("qwen2vl", "llava")


def chat_template(image_part: str) -> str:
    """A Jinja chat template: ``role:content<eos>`` per message; each image part becomes ``image_part``."""
    return (
        "{% for message in messages %}{{ message['role'] }}:"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image_part +
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + EOS + "{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor (images only; see the module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _qwen2vl(tok, hidden: int, layers: int, heads: int, kv_heads: int, vision_depth: int):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIALS}
    side = IMAGE_SIZE * IMAGE_SIZE
    improc = Qwen2VLImageProcessorPil(min_pixels=side, max_pixels=side, patch_size=14, temporal_patch_size=2,
                                      merge_size=2)
    proc = TinyQwen2VLProcessor(image_processor=improc, tokenizer=tok,
                                chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    head_dim = hidden // heads
    if head_dim % 4:
        raise ValueError(f"qwen2vl needs hidden/heads divisible by 4 (mrope sections), got {hidden}/{heads}")
    q = head_dim // 4  # mrope_section (temporal, height, width) must sum to head_dim / 2
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, layer_types=None,
                         rope_scaling={"type": "default", "rope_type": "default",
                                       "mrope_section": [head_dim // 2 - 2 * q, q, q]}),
        vision_config=dict(depth=vision_depth, embed_dim=hidden, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    return Qwen2VLForConditionalGeneration(cfg), proc


def _llava(tok, hidden: int, layers: int, heads: int, kv_heads: int, vision_depth: int):
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    improc = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    n_img = (IMAGE_SIZE // 14) ** 2
    proc = LlavaProcessor(image_processor=improc, tokenizer=tok, patch_size=14,
                          vision_feature_select_strategy="default", chat_template=chat_template("<image>"),
                          image_token="<image>", num_additional_image_tokens=1)
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=vision_depth,
                                       num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=14,
                                       projection_dim=hidden),
        text_config=Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id, bos_token_id=None),
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_seq_length=n_img,
        vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True)
    return LlavaForConditionalGeneration(cfg), proc


def build_tiny_vlm(directory: str | os.PathLike, *, arch: str = "qwen2vl", chars: str = DEFAULT_CHARS,
                   hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, vision_depth: int = 1,
                   seed: int = 0) -> Path:
    """Build a random-init tiny VLM + processor and save both under ``directory`` (``save_pretrained``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown VLM arch {arch!r}; valid: {list(ARCHS)}")
    directory = Path(directory)
    tok = build_tokenizer(chars, specials=QWEN_SPECIALS if arch == "qwen2vl" else LLAVA_SPECIALS)
    torch.manual_seed(seed)
    model, proc = (_qwen2vl if arch == "qwen2vl" else _llava)(tok, hidden, layers, heads, kv_heads, vision_depth)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    with quiet_hf_progress():
        model.save_pretrained(directory)
    proc.save_pretrained(directory)
    return directory


def is_vlm_dir(path: str | os.PathLike) -> bool:
    """True iff ``path`` holds a saved processor with an image processor (a VLM checkpoint)."""
    path = Path(path)
    return (path / "processor_config.json").is_file() or (path / "preprocessor_config.json").is_file()


def load_vlm(path: str | os.PathLike, *, dtype=torch.float32):
    """(model, processor) from a directory made by :func:`build_tiny_vlm` or any local VLM checkpoint."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; --model must be a local VLM checkpoint directory")
    if not is_vlm_dir(path):
        raise ValueError(f"{path}: no processor_config.json / preprocessor_config.json; a VLM checkpoint needs its "
                         "processor saved next to it (processor.save_pretrained)")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    if archs and not any(a.endswith("ForConditionalGeneration") for a in archs):
        raise ValueError(f"{path}: architectures {archs} is not a vision-language model "
                         "(expected *ForConditionalGeneration)")
    with quiet_hf_progress():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
    pcfg = path / "processor_config.json"
    name = json.loads(pcfg.read_text()).get("processor_class") if pcfg.is_file() else None
    cls = TinyQwen2VLProcessor if name == TinyQwen2VLProcessor.__name__ else AutoProcessor
    proc = cls.from_pretrained(path, local_files_only=True)
    if not hasattr(proc, "image_processor"):
        raise ValueError(f"{path}: the saved processor {type(proc).__name__} has no image processor")
    proc.tokenizer.padding_side = "left"
    return model, proc


def image_messages(prompt: list[dict], n_images: int = 1) -> list[dict]:
    """A conversational prompt with image parts inserted, exactly as TRL's GRPOTrainer builds it."""
    from trl.data_utils import prepare_multimodal_messages

    return prepare_multimodal_messages(prompt, images=[None] * n_images)


def _encode(proc, texts: list[str], images: list) -> dict:
    if proc.tokenizer.padding_side != "left":
        raise ValueError("the VLM processor's tokenizer must pad on the left (generation and TRL assume it)")
    return dict(proc(text=texts, images=[[im] for im in images], return_tensors="pt", padding=True))


def sft_batch(proc, prompts: list[list[dict]], images: list, targets: list[str]) -> dict:
    """Teacher-forcing inputs for ``model(**batch)``: prompt + image + target + EOS, loss on target and EOS.

    prompts: B conversational prompts (strings as content); images: B PIL images; targets: B strings.
    Returns the processor's tensors (``input_ids (B, L)``, ``pixel_values``, ...) plus ``labels (B, L)``.
    """
    texts = proc.apply_chat_template([image_messages(p) for p in prompts], add_generation_prompt=True, tokenize=False)
    eos = proc.tokenizer.eos_token
    batch = _encode(proc, [t + y + eos for t, y in zip(texts, targets)], images)
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    for i, y in enumerate(targets):  # left padding: each row ends with its target and EOS
        k = len(proc.tokenizer(y + eos, add_special_tokens=False)["input_ids"])
        labels[i, -k:] = ids[i, -k:]
    batch["labels"] = labels
    return batch


@torch.no_grad()
def sample_vlm(model, proc, prompts: list[list[dict]], images: list, *, n: int, max_new_tokens: int,
               temperature: float = 1.0, batch_rows: int = 256, seed: int = 0) -> list[list[str]]:
    """n sampled completions per (prompt, image), with TRL's sampling settings (image token suppressed)."""
    was_training = model.training
    model.eval()
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    texts = proc.apply_chat_template([image_messages(p) for p in prompts], add_generation_prompt=True,
                                     tokenize=False)
    rows = [(t, im) for t, im in zip(texts, images) for _ in range(n)]
    out: list[str] = []
    try:
        for s in range(0, len(rows), batch_rows):
            chunk = rows[s:s + batch_rows]
            enc = _encode(proc, [t for t, _ in chunk], [im for _, im in chunk])
            ids = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=proc.tokenizer.pad_token_id,
                                 eos_token_id=proc.tokenizer.eos_token_id,
                                 suppress_tokens=[model.config.image_token_id])
            out.extend(proc.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    finally:
        torch.set_rng_state(state)
        model.train(was_training)
    return [out[i * n:(i + 1) * n] for i in range(len(prompts))]
