"""Vision-language batches of TRL 1.16 <-> a group's stored multimodal inputs.

``GRPOTrainer`` (a ``ProcessorMixin`` as ``processing_class``) adds to its generation batch of B rows:

    pixel_values, image_grid_thw, image_sizes   flat over the images (or patches) of all rows: TRL's
                                                ``split_pixel_values_by_grid`` turns them into one entry per row
    num_images                                  a Python list, one count per row
    mm_token_type_ids / token_type_ids          (B, P+C) per token: the prompt part from the processor, zeros
                                                over the completion

A group stores ONE row's entries (its n rows share the prompt; :attr:`GroupRecord.mm_inputs`): the split-view
entries as they are, ``num_images`` as ``hdr.num_images (1,)``, per-token fields as the prompt's ``(P,)`` part.
:func:`batch_inputs` turns per-row entries back into TRL's flat layout for any rows (replay chunks, re-scoring),
which is what ``unsplit_pixel_values_by_grid`` does for fresh rows.

Supported layouts: grid models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and one-row-per-image models (LLaVA,
LLaVA-NeXT).  Refused with the reason: per-row padded images (Idefics3, SmolVLM: ``pixel_attention_mask``),
Gemma's ``image_position_ids``, tiled inputs (LFM2-VL, InternVL); images inside completions (tool images).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Sequence

import torch
from transformers import ProcessorMixin
from trl.trainer.utils import split_pixel_values_by_grid

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")  # one entry per row in TRL's split view
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")  # (B, P+C): stored as the prompt's (P,) part
BATCH_KEYS = (*IMAGE_KEYS, *TOKEN_KEYS, "num_images")
UNSUPPORTED = {"pixel_attention_mask": "per-row padded images (Idefics3 / SmolVLM)",
               "image_position_ids": "Gemma's image_position_ids", "spatial_shapes": "tiled images (LFM2-VL)",
               "num_tiles": "tiled images (InternVL / LFM2-VL)"}
NUM_IMAGES = "hdr.num_images"


def is_vlm(processing_class) -> bool:
    """TRL's own test (GRPOTrainer sets ``_is_vlm`` the same way)."""
    return isinstance(processing_class, ProcessorMixin)


def check_processor(processing_class) -> None:
    """Refuse a processor TRL would treat as a VLM's that has no image processor (e.g. an audio processor)."""
    if is_vlm(processing_class) and getattr(processing_class, "image_processor", None) is None:
        raise ValueError(f"processing_class is a {type(processing_class).__name__} without an image processor; "
                         "HDRGRPOTrainer replays vision-language models (pass their image processor's processor) "
                         "or text models (pass the tokenizer)")


def check_model(processing_class, model) -> None:
    """Refuse a vision-language processor with a model object that has no vision tower (``config.vision_config``),
    before ``GRPOTrainer.__init__`` fails on it with an AttributeError (a model given as a path is checked by TRL)."""
    if not is_vlm(processing_class) or isinstance(model, str):
        return
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        raise ValueError(f"processing_class is a {type(processing_class).__name__} (images) but model is a "
                         f"{type(model).__name__} without a vision tower (no config.vision_config): a text-only model "
                         "cannot take the images. Pass the vision-language model its processor belongs to, or the "
                         "text model with its tokenizer.")


def check_setup(processing_class, train_dataset, *, replay: str, micro_step: str) -> bool:
    """Refuse what cannot work before training; returns whether the model is a VLM (TRL's test).

    A processor without an image processor; an image column with a text model's tokenizer (the model would
    train without seeing the images); ``replay_micro_step="grow"`` with a VLM (the merged micro-batch would have
    to re-lay out TRL's flat image tensors)."""
    check_processor(processing_class)
    vlm = is_vlm(processing_class)
    cols = set(getattr(train_dataset, "column_names", None) or [])
    if not vlm and cols & {"image", "images"}:
        raise ValueError(f"the training dataset has an image column ({sorted(cols & {'image', 'images'})}) but "
                         f"processing_class is a {type(processing_class).__name__}, not a processor: a text model "
                         "would train without seeing the images. Pass the vision-language model with its processor "
                         "(e.g. AutoProcessor.from_pretrained), or drop the image column.")
    if vlm and replay != "none" and micro_step == "grow":
        raise ValueError("replay_micro_step='grow' is not supported for vision-language models (the merged "
                         "micro-batch would have to re-lay out TRL's flat image tensors); use 'chunk' (the default)")
    return vlm


def row_padding_drift(logps, out: dict, i: int, inputs: dict, *, pad_token_id: int) -> float:
    """Max |d logp| of fresh row ``i`` of a TRL batch scored behind 0, 3 and 11 left pads, its image included
    (``logps(ids, mask, C, **mm)``: the trainer's log-prob forward)."""
    pm, cm = out["prompt_mask"][i].bool(), out["completion_mask"][i]
    prompt, comp = out["prompt_ids"][i][pm], out["completion_ids"][i]
    C, dev = comp.numel(), comp.device
    results = []
    for extra in (0, 3, 11):
        ids = torch.cat([torch.full((extra,), pad_token_id, dtype=comp.dtype, device=dev), prompt, comp])[None]
        mask = torch.cat([torch.zeros(extra, dtype=cm.dtype, device=dev),
                          torch.ones(len(prompt), dtype=cm.dtype, device=dev), cm])[None]
        results.append(logps(ids, mask, C, **batch_inputs([inputs], mask[:, :-C].cpu(), C)).float()[0])
    keep = cm.bool()
    return float(max((lp[keep] - results[0][keep]).abs().max() for lp in results))


def check_keys(out: dict) -> None:
    bad = sorted(k for k in out if k in UNSUPPORTED)
    if bad:
        raise RuntimeError(f"TRL's batch has {bad}: {'; '.join(UNSUPPORTED[k] for k in bad)} -- hdreplay replays "
                           "grid (Qwen2-VL family) and one-row-per-image (LLaVA) vision inputs only")


def row_inputs(out: dict) -> tuple[list[dict[str, torch.Tensor]], list[str | None]]:
    """Per local row of a TRL generation batch: its multimodal entries (CPU), and why it cannot be stored
    (None when it can).  Empty dicts for a text batch."""
    B, P = out["prompt_ids"].shape[0], out["prompt_ids"].shape[1]
    if "num_images" not in out:
        return [{} for _ in range(B)], [None] * B
    check_keys(out)
    split = split_pixel_values_by_grid(out)
    if isinstance(split.get("pixel_values"), torch.Tensor):
        raise RuntimeError(f"pixel_values of shape {tuple(out['pixel_values'].shape)} is neither one row per image nor "
                           "grid patches (a per-row padded layout): hdreplay cannot replay it")
    pm = out["prompt_mask"].bool()
    rows, why = [], []
    for i in range(B):
        d = {NUM_IMAGES: torch.tensor([int(out["num_images"][i] or 0)], dtype=torch.int64)}
        d.update({k: split[k][i].detach().cpu() for k in IMAGE_KEYS if k in split})
        reason = None
        for k in TOKEN_KEYS:
            if k in out:
                if bool(out[k][i, P:].any()):
                    reason = f"`{k}` marks vision tokens in row {i}'s completion (images in completions: not replayed)"
                d[k] = out[k][i, :P][pm[i]].detach().cpu()
        rows.append(d)
        why.append(reason)
    return rows, why


def group_inputs(rows: Sequence[dict], why: Sequence[str | None], sl: slice) -> tuple[dict, str | None]:
    """The stored inputs of the group of rows ``sl`` (global rows), or ({}, reason)."""
    reason = next((w for w in why[sl] if w is not None), None)
    if reason is not None:
        return {}, reason
    first = rows[sl.start]
    for r in range(sl.start + 1, sl.stop):
        other = rows[r]
        if other.keys() != first.keys() or not all(torch.equal(other[k], first[k]) for k in first):
            return {}, (f"rows {sl.start}..{sl.stop - 1} share a prompt but not its images (random processor "
                        "augmentation?); the group's responses must be conditioned on one input")
    return dict(first), None


def batch_inputs(rows: Sequence[dict], prompt_mask: torch.Tensor, completion_width: int) -> dict:
    """TRL's multimodal batch keys for rows with stored entries ``rows`` (R), prompts left-padded as
    ``prompt_mask (R, P)``, completions of width C: what ``_compute_loss`` and ``_get_per_token_logps_and_entropies``
    read.  Empty when no row has an image (TRL runs such a batch as text)."""
    if not rows or NUM_IMAGES not in rows[0]:
        return {}
    num = [int(d[NUM_IMAGES]) for d in rows]
    if sum(num) == 0:
        return {}
    out: dict = {"num_images": num}
    for k in IMAGE_KEYS:
        if k in rows[0]:
            out[k] = torch.cat([d[k] for d in rows])
    R, P = prompt_mask.shape
    pm = prompt_mask.bool().cpu()
    for k in TOKEN_KEYS:
        if k in rows[0]:
            t = torch.zeros(R, P + completion_width, dtype=rows[0][k].dtype)
            for i, d in enumerate(rows):
                t[i, :P][pm[i]] = d[k]
            out[k] = t
    return out


def to_device(inputs: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def reload_converted_weights(model, checkpoint: str) -> bool:
    """Load ``checkpoint``'s weights into ``model`` through ``from_pretrained`` when the Trainer's resume could not.

    transformers 5.x saves models with a checkpoint conversion mapping (Qwen2-VL, LLaVA, ...) under their original
    key names, and ``Trainer._load_from_checkpoint`` loads the raw state dict without converting it back: the keys
    do not match, the weights are silently left as they were, and a resumed run continues from the initial model
    (huggingface/transformers#43701).  Returns whether the weights were reloaded."""
    path = os.path.join(checkpoint, "model.safetensors")
    index = path + ".index.json"
    if os.path.isfile(index):
        saved = set(json.load(open(index))["weight_map"])
    elif os.path.isfile(path):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            saved = set(f.keys())
    else:
        return False
    if not (set(model.state_dict()) - saved - {"lm_head.weight"}):
        return False  # the Trainer's own load matched every key
    warnings.warn(f"hdreplay: {checkpoint} stores {type(model).__name__} under its original key names, which "
                  "transformers' Trainer resume does not convert (huggingface/transformers#43701); reloading the "
                  "weights through from_pretrained", stacklevel=3)
    loaded = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype, local_files_only=True)
    model.load_state_dict(loaded.state_dict())
    return True


def check_images(trainer, out: dict, gen) -> None:
    """First step of a VLM run: the buffer (e.g. resumed) must hold images this processor produces, and re-padding a
    real row (with its image) must not change its log-probs (``trainer``'s padding check, on that row)."""
    from ...store.multimodal import schema_difference, schema_of

    have = trainer._mm_schema()
    i = next((j for j, w in enumerate(gen.mm_why) if w is None), None)
    ok = None if i is None else gen.mm_rows[i]
    if have is not None and ok is not None and (why := schema_difference(schema_of(ok), have)) is not None:
        raise ValueError(f"the replay buffer holds multimodal inputs this run's processor does not produce: {why}. "
                         "It was filled under another processor or image setting (resumed from another run?); "
                         "resume with the same processor, or start with an empty buffer")
    if trainer.replay_padding_drift is None and ok is not None:
        trainer.replay_padding_drift = row_padding_drift(trainer._logps, out, i, ok,
                                                         pad_token_id=trainer._tokenizer.pad_token_id)
        trainer._check_padding_invariance(trainer.replay_padding_drift)
