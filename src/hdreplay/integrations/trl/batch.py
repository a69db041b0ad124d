"""TRL batch dicts <-> hdreplay groups.

A TRL generation batch is a dict of per-row tensors (B rows on this rank) plus the 0-d
``num_items_in_batch``.  This module knows every per-row key TRL 1.16 returns for text
models and how to pad it; an unknown key fails loudly (:func:`check_keys`) rather than
being dropped for replayed rows, which is how TRL's removed replay trainer lost ``tool_mask``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...padding import pad_groups
from ..common import trim_rows
from ...errors import ReplayInputError
from ...record import GroupRecord

#: per-row key -> (padding side, pad value; None = the tokenizer's pad id); side None = (B,) tensor
ROW_KEYS: dict[str, tuple[str | None, Any]] = {
    "prompt_ids": ("left", None),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", None),
    "completion_mask": ("right", 0),
    "old_per_token_logps": ("right", 0.0),
    "ref_per_token_logps": ("right", 0.0),
    "sampling_per_token_logps": ("right", 0.0),
    "tool_mask": ("right", 1),
    "advantages": (None, None),
    "hdr_is_replay": (None, None),
    "hdr_row": (None, None),
}
SCALAR_KEYS = ("num_items_in_batch",)


def check_keys(batch: dict) -> None:
    """Raise naming any key of a TRL batch that replay does not know how to fill."""
    unknown = sorted(k for k in batch if k not in ROW_KEYS and k not in SCALAR_KEYS)
    if unknown:
        raise RuntimeError(
            f"TRL returned batch key(s) {unknown} that HDRGRPOTrainer cannot fill for replayed rows. "
            "hdreplay is tested with trl 1.16 text models; multimodal inputs, vLLM importance sampling and "
            "newer TRL versions are not supported. Known keys: " + ", ".join(sorted(ROW_KEYS) + list(SCALAR_KEYS))
        )


def _pad_to(t: torch.Tensor, width: int, side: str, value) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = t.new_full((t.shape[0], extra), value)
    return torch.cat([pad, t], dim=1) if side == "left" else torch.cat([t, pad], dim=1)


def concat_rows(first: dict, second: dict, *, pad_token_id: int) -> dict:
    """Rows of ``first`` then rows of ``second`` (same per-row keys), padded to common widths."""
    out = {}
    for k in first:
        if k in SCALAR_KEYS:
            continue
        side, val = ROW_KEYS[k]
        a, b = first[k], second[k]
        if side is not None:
            w = max(a.shape[1], b.shape[1])
            val = pad_token_id if val is None else val
            a, b = _pad_to(a, w, side, val), _pad_to(b, w, side, val)
        out[k] = torch.cat([a, b.to(a.device)], dim=0)
    return out


def take_rows(batch: dict, sl: slice) -> dict:
    return {k: (v if k in SCALAR_KEYS else v[sl]) for k, v in batch.items()}


def split_rows(batch: dict, chunks: int) -> list[dict]:
    """Split into ``chunks`` consecutive equal parts; never drops a row."""
    n = batch["prompt_ids"].shape[0]
    if n % chunks:
        raise RuntimeError(f"{n} rows cannot be split into {chunks} equal micro-steps; this is a bug in hdreplay's "
                           "truncation multiple, please report it")
    size = n // chunks
    return [take_rows(batch, slice(i * size, (i + 1) * size)) for i in range(chunks)]


def groups_from_rows(
    rows: dict[str, torch.Tensor],
    rewards: torch.Tensor,
    *,
    num_generations: int,
    step: int,
    id_prefix: str,
) -> tuple[list[GroupRecord], list[str]]:
    """Build the GroupRecords of a *global* (all-rank) batch whose groups are consecutive blocks of rows.

    Args:
        rows: global per-row tensors: prompt_ids/prompt_mask (N, P) left-padded, completion_ids/
            completion_mask (N, C), loss_mask (N, C), gen_logps (N, C), advantages (N,), optional ref_logps (N, C).
        rewards: (N,) total reward per row.
    Returns:
        (groups, problems): groups that are valid records, and a message per group that was skipped.
    """
    N = rows["prompt_ids"].shape[0]
    if N % num_generations or rewards.numel() != N:
        raise RuntimeError(f"{N} rows / {rewards.numel()} rewards do not form groups of {num_generations}")
    cpu = {k: v.detach().cpu() for k, v in rows.items()}
    rewards = rewards.detach().float().cpu()
    groups, problems = [], []
    for k in range(N // num_generations):
        sl = slice(k * num_generations, (k + 1) * num_generations)
        pm = cpu["prompt_mask"][sl].bool()
        prompt = cpu["prompt_ids"][sl][0][pm[0]]
        for i in range(1, num_generations):
            if not torch.equal(cpu["prompt_ids"][sl][i][pm[i]], prompt):
                raise RuntimeError(
                    f"rows {sl.start}..{sl.stop - 1} of the generation batch do not share one prompt; "
                    "GRPO's sampler should yield each prompt num_generations times in a row"
                )
        extras = {"ref_logprobs": cpu["ref_logps"][sl]} if "ref_logps" in cpu else None
        try:
            groups.append(GroupRecord.from_padded(
                group_id=f"{id_prefix}{k}", prompt_ids=prompt, completion_ids=cpu["completion_ids"][sl],
                completion_mask=cpu["completion_mask"][sl], logprobs=cpu["gen_logps"][sl],
                loss_mask=cpu["loss_mask"][sl], advantages=cpu["advantages"][sl], rewards=rewards[sl],
                birth_step=step, extras=extras,
            ))
        except ReplayInputError as e:
            problems.append(str(e))
    return groups, problems


def replay_rows(
    groups: Sequence[GroupRecord],
    sl: slice,
    *,
    pad_token_id: int,
    keys: set[str],
    device,
) -> dict[str, torch.Tensor]:
    """Rows ``sl`` of the accepted groups (responses in group order) as a TRL batch dict.

    Replay rows carry their stored generation log-probs as ``old_per_token_logps`` (the ratio
    denominator), their stored advantages, and their stored loss mask as ``tool_mask``.
    """
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    rows = trim_rows(pg, sl)  # drop the column padding that only rows outside this slice needed
    n = rows.completion_ids.shape[0]
    out = {
        "prompt_ids": rows.prompt_ids,
        "prompt_mask": rows.prompt_mask,
        "completion_ids": rows.completion_ids,
        "completion_mask": rows.completion_mask,
        "advantages": pg.advantages[sl],
        "old_per_token_logps": rows.logprobs,
        "tool_mask": rows.loss_mask,
        "hdr_is_replay": torch.ones(n, dtype=torch.bool),
        "hdr_row": torch.full((n,), -1, dtype=torch.int64),
    }
    if "sampling_per_token_logps" in keys:
        out["sampling_per_token_logps"] = rows.logprobs
    if "ref_per_token_logps" in keys:
        if "ref_logprobs" not in rows.extras:
            raise RuntimeError("replayed groups carry no stored reference log-probs but beta != 0 needs them")
        out["ref_per_token_logps"] = rows.extras["ref_logprobs"]
    return {k: v.to(device) for k, v in out.items()}
