"""Padding invariance of the log-prob forward.

A stored group is re-scored (and trained) inside batches padded differently from the one it was
generated in; its Drift under unchanged weights must stay 0.  ``generate`` derives position ids
from the attention mask (cumsum - 1), but TRL's log-prob forward passes none, so the model uses
``arange`` and every left-pad shifts the positions.  Rotary models are invariant to that constant
shift; absolute-position models (GPT-2, OPT, ...) are not.

:func:`install_position_ids` adds a forward pre-hook that supplies the generation-style position
ids whenever a full-sequence forward arrives without them (generation always passes its own), so
the training/scoring forward sees exactly the positions generation saw.  :func:`padding_drift`
measures what is left: the max |d logp| of one sequence under different left paddings, through
the trainer's own log-prob function.
"""

from __future__ import annotations

import inspect

import torch


def _accepts_position_ids(model: torch.nn.Module) -> bool:
    base = getattr(model, "base_model", model)
    for m in (model, base):
        try:
            if "position_ids" in inspect.signature(type(m).forward).parameters:
                return True
        except (TypeError, ValueError):  # pragma: no cover
            continue
    return False


def _hook(module, args, kwargs):
    if kwargs.get("position_ids") is not None:
        return None
    mask = kwargs.get("attention_mask")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if mask is None or ids is None or mask.dim() != 2 or ids.shape[-1] != mask.shape[-1]:
        return None  # not a full-sequence forward (e.g. a cached decoding step): leave it alone
    pos = mask.long().cumsum(-1) - 1
    kwargs = dict(kwargs)
    kwargs["position_ids"] = pos.masked_fill(mask == 0, 0)
    return args, kwargs


def uses_mrope(model: torch.nn.Module) -> bool:
    """True for multimodal rotary models (Qwen2-VL family): their forward derives 3-D positions from the
    attention mask, image grids and token types itself, and generation-style 1-D positions would be wrong
    for every image token and all text after an image (they must not get the hook)."""
    base = getattr(model, "model", None)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return hasattr(base, "get_rope_index") or "mrope_section" in rope


def install_position_ids(model: torch.nn.Module):
    """Register the generation-style position-id pre-hook on ``model``; returns the handle or None
    when the model's forward takes no ``position_ids`` or uses multimodal rotary positions (:func:`uses_mrope`)."""
    if not _accepts_position_ids(model) or uses_mrope(model):
        return None
    return model.register_forward_pre_hook(_hook, with_kwargs=True)


@torch.no_grad()
def padding_drift(logp_fn, *, vocab_size: int, pad_token_id: int, device, prompt_len: int = 5,
                  completion_len: int = 6, pads: tuple[int, ...] = (0, 3, 11)) -> float:
    """Max |d logp| of one (prompt, completion) scored under several left-pad amounts.

    Args:
        logp_fn: ``(input_ids (B, S), attention_mask (B, S), logits_to_keep) -> (B, logits_to_keep)``.
    """
    g = torch.Generator().manual_seed(1234)
    hi = max(2, vocab_size)
    prompt = torch.randint(0, hi, (prompt_len,), generator=g)
    comp = torch.randint(0, hi, (completion_len,), generator=g)
    outs = []
    for p in pads:  # the same sequence behind p left pads, as a replayed row re-padded into a new batch
        ids = torch.cat([torch.full((p,), pad_token_id), prompt, comp]).unsqueeze(0)
        m = torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(prompt_len + completion_len, dtype=torch.long)])
        outs.append(logp_fn(ids.to(device), m.unsqueeze(0).to(device), completion_len).float().cpu())
    allrows = torch.cat(outs)
    return float((allrows - allrows[0]).abs().max())


def active_dropout(model: torch.nn.Module) -> list[str]:
    """Modules that apply dropout in training mode: nn.Dropout with p > 0, and attention modules with a
    float ``attention_dropout`` > 0 (Llama/Qwen-style attention applies it functionally)."""
    live = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            live.append(f"{name or type(m).__name__} (p={m.p})")
        p = getattr(m, "attention_dropout", None)
        if isinstance(p, float) and p > 0:
            live.append(f"{name}.attention_dropout={p}")
    return live
