"""Re-scoring with one prompt pass per group.

A group's n responses share one prompt.  :func:`shared_prompt_logps` runs the backbone once over each
group's prompt (all but its last token) with the KV cache on, repeats the cache for the group's n rows,
and runs ``[last prompt token ; completion]`` against it through the model's own (TRL fused) LM head,
so the n rows cost P + n (1 + C) token positions instead of n (P + C).

The result equals TRL's full-sequence forward up to float round-off: positions are the
generation-style ones (``cumsum(mask) - 1``, what :mod:`.positions` gives the full forward), the same
temperature and head are applied, and the tests compare the two (max |d logp| ~1e-6 in fp32).
:func:`can_share_prompt` says when a model allows it; otherwise the trainer re-scores full rows.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from typing import Callable, Sequence

import torch

from ...store.padding import pad_groups
from ...store.record import GroupRecord

#: share the prompt pass only when it runs at most this fraction of the full forward's token positions.  A token of
#: the shared path costs more than one of the full forward (two calls per batch, the KV cache copied per row):
#: measured on CPU (benchmarks/trl_rescore.py) 1.2-2.3x, so it pays below a ratio of 0.43-0.86 depending on rows
#: per call; on one H200 (docs/results/README.md, GPU check) 3-5x per row at a ratio of 0.71, where it did not pay.
#: 0.3 keeps it where prompts dominate by far (a ratio 0.3 costs at most ~1.2x at 4x per token)
SHARE_BELOW_TOKEN_RATIO = 0.3


def can_share_prompt(model: torch.nn.Module) -> bool:
    """True for a plain HF causal LM whose backbone takes ``past_key_values`` and ``position_ids``."""
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(model, "get_output_embeddings"):
        return False
    try:
        params = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return {"past_key_values", "position_ids", "use_cache"} <= set(params)


def rescore_batches(groups: Sequence[GroupRecord], max_rows: int) -> list[list[GroupRecord]]:
    """The forward calls :func:`shared_prompt_logps` makes: consecutive groups, at most ``max_rows`` rows each (a
    group larger than that alone)."""
    out, cur, rows = [], [], 0
    for g in groups:
        if cur and rows + g.num_responses > max_rows:
            out.append(cur)
            cur, rows = [], 0
        cur.append(g)
        rows += g.num_responses
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def shared_prompt_logps(model: torch.nn.Module, groups: Sequence[GroupRecord], *, pad_token_id: int, device,
                        max_rows: int, autocast: Callable[[], AbstractContextManager],
                        min_batches: int = 0) -> torch.Tensor:
    """Current-policy log-probs of the groups' completions, one prompt pass per group.

    Args:
        model: the unwrapped causal LM with TRL's fused LM head (``model(..., labels=, fused_lm_head=True)``).
        groups: G groups; their rows are laid out as :func:`hdreplay.pad_groups` does.
        max_rows: rows (responses) per forward call.
        autocast: the trainer's autocast context factory.
        min_batches: run at least this many forward calls (the extra ones repeat the first batch, results
            discarded), so that every rank of a sharded re-score makes the same calls.
    Returns:
        (R, C) log-probs, rows and columns as ``pad_groups(groups).completion_ids`` (0 on padding).
    """
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    out = torch.zeros(pg.completion_ids.shape, dtype=torch.float32)
    r0 = 0
    batches = rescore_batches(groups, max_rows)
    for batch in batches:
        part = _score_batch(model, batch, pad_token_id=pad_token_id, device=device, autocast=autocast)
        out[r0:r0 + part.shape[0], :part.shape[1]] = part.float().cpu()
        r0 += part.shape[0]
    for _ in range(min_batches - len(batches)):
        _score_batch(model, batches[0], pad_token_id=pad_token_id, device=device, autocast=autocast)
    return out


def _score_batch(model, groups, *, pad_token_id, device, autocast) -> torch.Tensor:
    G = len(groups)
    lens = torch.tensor([g.prompt_ids.numel() for g in groups])
    P = int(lens.max())
    prompt = torch.full((G, P), pad_token_id, dtype=torch.long)
    pmask = torch.zeros((G, P), dtype=torch.long)
    for i, g in enumerate(groups):
        prompt[i, P - g.prompt_ids.numel():] = g.prompt_ids.long()
        pmask[i, P - g.prompt_ids.numel():] = 1
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    rows_of = torch.repeat_interleave(torch.arange(G), torch.tensor([g.num_responses for g in groups]))
    R, C = pg.completion_ids.shape
    prompt, pmask, lens, rows_of = prompt.to(device), pmask.to(device), lens.to(device), rows_of.to(device)
    head = torch.cat([prompt[rows_of, -1:], pg.completion_ids.to(device)], 1)  # (R, 1 + C)
    head_mask = torch.cat([torch.ones((R, 1), dtype=torch.long, device=device), pg.completion_mask.to(device)], 1)
    head_pos = (lens[rows_of] - 1).unsqueeze(1) + torch.arange(1 + C, device=device).unsqueeze(0)
    labels = head.masked_fill(head_mask == 0, -100)
    with autocast():
        cache = None
        if P > 1:
            pre, pre_mask = prompt[:, :-1], pmask[:, :-1]
            pre_pos = (pre_mask.cumsum(1) - 1).clamp(min=0)
            cache = model.base_model(input_ids=pre, attention_mask=pre_mask, position_ids=pre_pos,
                                     use_cache=True).past_key_values
            cache.reorder_cache(rows_of)
            mask = torch.cat([pre_mask[rows_of], head_mask], 1)
        else:
            mask = head_mask
        res = model(input_ids=head, attention_mask=mask, position_ids=head_pos, past_key_values=cache,
                    labels=labels, fused_lm_head=True)
    return res.log_probs[:, -C:]


def rescore_token_counts(groups: Sequence[GroupRecord]) -> tuple[int, int]:
    """(shared, full) token positions one batched re-score of ``groups`` runs (padded widths)."""
    pg = pad_groups(groups, pad_token_id=0)
    R, C = pg.completion_ids.shape
    P = pg.prompt_ids.shape[1]
    return len(groups) * (P - 1) + R * (1 + C), R * (P + C)


def share_pays(groups: Sequence[GroupRecord]) -> bool:
    """Whether one prompt pass per group saves enough token positions to beat one full forward."""
    shared, full = rescore_token_counts(groups)
    return shared <= SHARE_BELOW_TOKEN_RATIO * full
