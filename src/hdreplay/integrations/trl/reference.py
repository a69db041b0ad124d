"""Reference log-probs of replayed rows when TRL syncs its reference model (``sync_ref_model=True``).

A group stores the reference log-probs of its birth step.  TRL's SyncRefModelCallback mixes the policy
into the reference model every ``ref_model_sync_steps`` steps, so a group born before the latest sync
carries log-probs of a reference that no longer exists: those rows are re-scored under the current
reference before their loss (the fresh rows get theirs from TRL as usual)."""

from __future__ import annotations

from typing import Callable

import torch

from . import mm
from .microstep import loss_mask


def stale_rows(births: torch.Tensor, *, step: int, sync_every: int) -> torch.Tensor:
    """(r,) bool: rows born (``births``, (r,) int) in an earlier sync period than ``step``."""
    return (step // sync_every) > (births // sync_every)


def refresh_reference(rows: dict, births: torch.Tensor, *, step: int, sync_every: int,
                      ref_logps: Callable[..., torch.Tensor]) -> int:
    """Overwrite ``rows["ref_per_token_logps"]`` ((r, C), TRL's replay-row layout) of the stale rows in place with
    ``ref_logps(input_ids, attention_mask, C, **images)`` -> (k, C); returns how many rows were refreshed."""
    stale = stale_rows(births, step=step, sync_every=sync_every)
    if not bool(stale.any()):
        return 0
    idx = stale.nonzero().squeeze(1).to(rows["prompt_ids"].device)
    ids = torch.cat([rows["prompt_ids"][idx], rows["completion_ids"][idx]], 1)
    mask = torch.cat([rows["prompt_mask"][idx], rows["completion_mask"][idx]], 1)
    C = rows["completion_ids"].shape[1]
    images = mm.batch_inputs([rows["hdr_mm"][int(j)] for j in idx], rows["prompt_mask"][idx].cpu(), C) \
        if "hdr_mm" in rows else {}
    ref = ref_logps(ids, mask, C, **images)
    rows["ref_per_token_logps"][idx] = (ref * loss_mask(rows)[idx]).to(rows["ref_per_token_logps"].dtype)
    return int(stale.sum())
