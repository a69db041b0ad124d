"""What one TRL micro-step trains, and how its loss is split into chunks.

Plain TRL trains one micro-batch of ``per_device_train_batch_size`` (pd) rows per micro-step.  With replay a
micro-step holds that same fresh micro-batch (TRL's own shuffle and split) plus a share of this rank's replay
rows, laid out by :func:`replay_chunks` as chunks of at most pd rows.  The trainer runs TRL's loss on each
part (forward + backward one part at a time, so activation memory stays that of pd rows) and weights the
parts by :func:`chunk_scales` so that the micro-step's gradient is exactly that of TRL's loss on the merged
micro-batch (``replay_micro_step="grow"`` runs that merged batch, :func:`merged`, in one pass instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import Generation, concat_rows, spread, take_rows

#: how TRL 1.16 normalises a micro-batch's loss, per loss type (see chunk_scales)
ROW_MEAN = ("grpo", "sapo", "luspo", "dr_grpo")
LOCAL_TOKENS = ("bnpo",)
GLOBAL_TOKENS = ("dapo", "cispo", "vespo")


@dataclass
class MicroStep:
    """``fresh`` is exactly the micro-batch plain TRL would train; ``replay`` are this rank's replay rows for
    the micro-step as chunks of at most pd rows; ``generation`` is where the fresh rows' log-probs are captured
    (None when TRL computed them)."""

    fresh: dict
    replay: list[dict]
    generation: Generation | None

    @property
    def rows(self) -> int:
        return self.fresh["prompt_ids"].shape[0] + sum(c["prompt_ids"].shape[0] for c in self.replay)


def loss_mask(part: dict) -> torch.Tensor:
    m = part["completion_mask"]
    return m * part["tool_mask"] if "tool_mask" in part else m


def chunk_scales(loss_type: str, parts: list[dict]) -> list[float]:
    """Weights w_c with sum_c w_c * TRL_loss(part_c) == TRL_loss(concat(parts)) for TRL 1.16's normalisers:
    row means (grpo, sapo, luspo, dr_grpo): w_c = rows share; bnpo (this rank's loss tokens): w_c = token
    share; dapo, cispo, vespo (the generation's global ``num_items_in_batch``): w_c = 1."""
    if len(parts) == 1 or loss_type in GLOBAL_TOKENS:
        return [1.0] * len(parts)
    if loss_type in LOCAL_TOKENS:
        toks = [float(loss_mask(p).sum()) for p in parts]
        if sum(toks) > 0:
            return [t / sum(toks) for t in toks]
    rows = [p["prompt_ids"].shape[0] for p in parts]
    return [r / sum(rows) for r in rows]


def separate_term_scales(parts: list[dict], coef: float) -> list[float]:
    """Weights giving TRL's row-mean loss on the fresh part (parts[0]) plus ``coef`` x the row mean over the replay
    chunks (RePO: ``loss = on_loss + off_policy_loss_coef * off_loss``, each term aggregated on its own rows)."""
    rows = [p["prompt_ids"].shape[0] for p in parts[1:]]
    return [1.0, *(coef * r / sum(rows) for r in rows)]


def trim(rows: dict) -> dict:
    """Drop the column padding no row of ``rows`` needs (prompt left-padded, completion right-padded)."""
    p = int(rows["prompt_mask"].sum(1).max())
    c = int(rows["completion_mask"].sum(1).max())
    out = {}
    for k, v in rows.items():
        if k.startswith("prompt"):
            out[k] = v[:, v.shape[1] - p:]
        elif (isinstance(v, torch.Tensor) and v.dim() == 2
                and not (k == "importance_sampling_ratio" and v.shape[1] == 1)):
            out[k] = v[:, :c]
        else:
            out[k] = v
    return out


def replay_chunks(rows: dict, *, spg: int, max_rows: int, num_items) -> list[list[dict]]:
    """This rank's replay rows (a TRL batch dict of R rows) spread as evenly as possible over ``spg``
    micro-steps, each share cut into chunks of at most ``max_rows`` rows trimmed to their own widths."""
    R = rows["prompt_ids"].shape[0]
    out, start = [], 0
    for count in spread(R, spg):
        chunks = []
        for s in range(start, start + count, max_rows):
            chunk = trim(take_rows(rows, slice(s, min(s + max_rows, start + count))))
            chunk["num_items_in_batch"] = num_items
            chunks.append(chunk)
        out.append(chunks)
        start += count
    return out


def merged(micro: MicroStep, *, pad_token_id: int) -> dict:
    """The micro-step as one TRL batch (``replay_micro_step="grow"``).  When TRL computed no
    ``old_per_token_logps`` the fresh rows get a placeholder the trainer fills with their own log-probs
    (``hdr_fill_old``), so their ratio is exactly 1 as in plain TRL."""
    fresh = dict(micro.fresh)
    like = micro.replay[0]
    fresh.setdefault("tool_mask", torch.ones_like(fresh["completion_mask"]))
    fill = "old_per_token_logps" not in fresh
    if fill:
        fresh["old_per_token_logps"] = torch.zeros_like(fresh["completion_mask"],
                                                        dtype=like["old_per_token_logps"].dtype)
    out = concat_rows([fresh, *micro.replay], pad_token_id=pad_token_id)
    out["hdr_fill_old"] = fill
    return out
