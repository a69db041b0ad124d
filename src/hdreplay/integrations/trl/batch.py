"""TRL batch dicts <-> hdreplay groups.

A TRL generation batch is a dict of per-row tensors (B rows on this rank) plus the 0-d
``num_items_in_batch``.  This module knows every per-row key TRL 1.16 returns for text models
(vLLM keys included) and how a replayed row fills it; an unknown key fails loudly
(:func:`check_keys`) rather than being dropped for replayed rows, which is how TRL's removed replay
trainer lost ``tool_mask``.

Stored per group besides the core record (``GroupRecord.extras``, one value per completion token):

=================  ========================================  ===========================================
extra              from TRL key                              replayed as
=================  ========================================  ===========================================
ref_logprobs       ref_per_token_logps (beta != 0)           ref_per_token_logps (or recomputed under a
                                                             synced reference model, see the trainer)
is_ratio           importance_sampling_ratio (vLLM, IS on)   importance_sampling_ratio, (R, 1) in
                                                             sequence modes (the birth-time sampler
                                                             correction pi_gen / pi_vLLM, fixed at birth)
sampling_logprobs  sampling_per_token_logps (vLLM)           sampling_per_token_logps (NaN stored as the
                                                             generation log-prob)
=================  ========================================  ===========================================

A replayed copy may carry ``token_weight`` (never stored: a selection adds it, POPO's decoupled weight
pi_prox / pi_behav, :data:`hdreplay.baselines.popo.TOKEN_WEIGHT`): the row's advantage is multiplied by it per
token, so its ``advantages`` are (R, C) (TRL 1.16 accepts per-token advantages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ...baselines.popo import TOKEN_WEIGHT
from ...errors import ReplayInputError
from ...selection import Selection
from ...store.ingest import Ingest, Rows
from ...store.ingest import groups_from_rows as ingest_groups
from ...store.multimodal import Schema
from ...store.padding import pad_groups
from ...store.record import GroupRecord
from ..common import trim_rows
from . import mm

#: per-row key -> (padding side, pad value; None = the tokenizer's pad id); side None = (B,) or (B, 1)
ROW_KEYS: dict[str, tuple[str | None, Any]] = {
    "prompt_ids": ("left", None),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", None),
    "completion_mask": ("right", 0),
    "old_per_token_logps": ("right", 0.0),
    "ref_per_token_logps": ("right", 0.0),
    "sampling_per_token_logps": ("right", 0.0),
    "importance_sampling_ratio": ("right", 0.0),  # (B, C) token modes; (B, 1) sequence modes: not padded
    "tool_mask": ("right", 1),
    "advantages": (None, None),
    "hdr_row": (None, None),
    "hdr_off": (None, None),  # ExGRPO: (B,) which rows are injected stored trajectories
    "hdr_off_logps": ("right", 0.0),  # ExGRPO: their stored generation log-probs
}
SCALAR_KEYS = ("num_items_in_batch",)
#: stored extra -> the TRL key a replayed row carries it as
EXTRA_KEYS = {"ref_logprobs": "ref_per_token_logps", "is_ratio": "importance_sampling_ratio",
              "sampling_logprobs": "sampling_per_token_logps"}


def check_keys(batch: dict) -> None:
    """Raise naming any key of a TRL batch that replay does not know how to fill."""
    mm.check_keys(batch)
    unknown = sorted(k for k in batch if k not in ROW_KEYS and k not in SCALAR_KEYS and k not in mm.BATCH_KEYS)
    if unknown:
        raise RuntimeError(
            f"TRL returned batch key(s) {unknown} that HDRGRPOTrainer cannot fill for replayed rows. "
            "hdreplay is tested with trl 1.16 (text and grid / one-row-per-image vision models); newer TRL versions "
            "are not supported. Known keys: " + ", ".join(sorted(ROW_KEYS) + list(SCALAR_KEYS) + list(mm.BATCH_KEYS))
        )


def _pad_to(t: torch.Tensor, width: int, side: str, value) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = t.new_full((t.shape[0], extra), value)
    return torch.cat([pad, t], dim=1) if side == "left" else torch.cat([t, pad], dim=1)


def concat_rows(parts: Sequence[dict], *, pad_token_id: int) -> dict:
    """Rows of every part in order (same per-row keys), padded to common widths; scalars from the first."""
    out = {}
    for k, v0 in parts[0].items():
        if k in SCALAR_KEYS:
            out[k] = v0
            continue
        side, val = ROW_KEYS[k]
        ts = [p[k] for p in parts]
        if side is not None and not (k == "importance_sampling_ratio" and v0.shape[1] == 1):
            w = max(t.shape[1] for t in ts)
            val = pad_token_id if val is None else val
            ts = [_pad_to(t, w, side, val) for t in ts]
        out[k] = torch.cat([t.to(v0.device) for t in ts], dim=0)
    return out


def real_completion_mask(completion_ids: torch.Tensor, completion_mask: torch.Tensor, *, pad_token_id: int,
                         masked_truncated: bool) -> torch.Tensor:
    """(B, C) mask of the tokens each row really generated.

    With ``mask_truncated_completions`` TRL zeroes the completion mask of a truncated row (one whose last
    token is neither EOS nor pad); its real length runs to its last non-pad token.
    """
    if not masked_truncated:
        return completion_mask
    empty = completion_mask.sum(1) == 0
    if not bool(empty.any()):
        return completion_mask
    C = completion_ids.shape[1]
    pos = torch.arange(C, device=completion_ids.device).expand_as(completion_ids)
    last = torch.where(completion_ids != pad_token_id, pos, -1).amax(1)  # (B,)
    real = (pos <= last.unsqueeze(1)).to(completion_mask.dtype)
    return torch.where(empty.unsqueeze(1), real, completion_mask)


def ingress_rows(out: dict, *, pad_token_id: int, masked_truncated: bool) -> dict[str, torch.Tensor]:
    """The per-row tensors a generation batch contributes to ingress (this rank's rows, TRL's order).

    Returns prompt_ids / prompt_mask (B, P), completion_ids / completion_mask (B, C) (real lengths, truncated
    rows included), loss_mask (B, C) (0 for truncated rows and tool tokens), advantages (B,), and the extras of
    the module table as (B, C) float tensors.
    """
    cm = out["completion_mask"]
    rows = {"prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"],
            "completion_ids": out["completion_ids"],
            "completion_mask": real_completion_mask(out["completion_ids"], cm, pad_token_id=pad_token_id,
                                                    masked_truncated=masked_truncated),
            "loss_mask": cm * out["tool_mask"] if "tool_mask" in out else cm, "advantages": out["advantages"]}
    for extra, key in EXTRA_KEYS.items():
        if key in out:
            v = out[key].float()
            rows[extra] = v.expand(-1, cm.shape[1]) if v.shape[1] == 1 else v
    return rows


def generation_groups(rows: dict[str, torch.Tensor], rewards: torch.Tensor, *, num_generations: int, step: int,
                      id_prefix: str, mm_rows: Sequence[dict] | None = None,
                      mm_why: Sequence[str | None] | None = None, schema: Schema | None = None) -> Ingest:
    """The groups of a *global* (all-rank) generation batch, whose groups are consecutive blocks of rows
    (:func:`hdreplay.store.ingest.groups_from_rows` builds and checks them; ids ``"<id_prefix><k>"``).

    Args:
        rows: global per-row tensors: prompt_ids/prompt_mask (N, P) left-padded, completion_ids/
            completion_mask (N, C), loss_mask (N, C), gen_logps (N, C), advantages (N,), optional extras (N, C).
        rewards: (N,) total reward per row.
        mm_rows, mm_why: per global row, its multimodal entries and why it cannot be stored (:func:`.mm.row_inputs`);
            None for a text model.
        schema: the buffer's multimodal schema (None = the first stored group's).
    """
    hook = None
    if mm_rows is not None:
        hook = lambda idx: mm.group_inputs(mm_rows, mm_why, slice(idx[0], idx[-1] + 1))  # noqa: E731
    batch = Rows(prompt_ids=rows["prompt_ids"], prompt_mask=rows["prompt_mask"], completion_ids=rows["completion_ids"],
                 completion_mask=rows["completion_mask"], loss_mask=rows["loss_mask"], logprobs=rows["gen_logps"],
                 advantages=rows["advantages"], rewards=rewards,
                 extras={k: rows[k].float() for k in EXTRA_KEYS if k in rows})
    return ingest_groups(batch, step=step, group_size=num_generations, group_id=lambda k: f"{id_prefix}{k}",
                            mm_inputs=hook, schema=schema, size_name="num_generations")


def groups_from_rows(rows: dict[str, torch.Tensor], rewards: torch.Tensor, *, num_generations: int, step: int,
                     id_prefix: str, mm_rows: Sequence[dict] | None = None,
                     mm_why: Sequence[str | None] | None = None) -> tuple[list[GroupRecord], int, list[str]]:
    """Deprecated (use :func:`generation_groups`): ``(groups, number of empty groups, problems)``."""
    got = generation_groups(rows, rewards, num_generations=num_generations, step=step, id_prefix=id_prefix,
                            mm_rows=mm_rows, mm_why=mm_why)
    return got.groups, len(got.empty), got.problems


def replay_rows(groups: Sequence[GroupRecord], sl: slice, *, pad_token_id: int,
                loss_weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """Rows ``sl`` of the accepted groups (responses in group order) as a TRL batch dict (CPU).

    Replay rows carry their stored generation log-probs as ``old_per_token_logps`` (the ratio
    denominator), their stored advantages, their stored loss mask as ``tool_mask``, every stored
    extra under its TRL key (module table), and, for vision-language groups, ``hdr_mm``: a list with each
    row's stored multimodal entries (the rows of a group share one dict), turned into TRL's keys per chunk
    by :func:`.mm.batch_inputs`.  ``loss_weights`` (one per group, > 0; the selection's PER importance
    weights) multiply the rows' advantages: TRL's clipped policy-gradient term -min(r A, clip(r) A) is
    positively homogeneous in A, so this weights each row's policy term exactly (a KL term, beta != 0, is
    not weighted).  A ``token_weight`` extra (see the module) multiplies them per token instead: (R, C) advantages.
    """
    pg = pad_groups(groups, pad_token_id=pad_token_id)
    rows = trim_rows(pg, sl)  # drop the column padding that only rows outside this slice needed
    adv = pg.advantages
    if loss_weights is not None:
        w = torch.tensor(np.asarray(loss_weights, dtype=np.float64))
        if w.shape != (len(groups),) or not bool((w > 0).all()):
            raise ReplayInputError(f"loss_weights: one weight > 0 per group ({len(groups)}), got {w.tolist()!r:.80}")
        adv = adv * torch.repeat_interleave(w, torch.tensor([g.num_responses for g in groups])).to(adv.dtype)
    adv = adv[sl]
    if TOKEN_WEIGHT in rows.extras:
        adv = adv.unsqueeze(1) * rows.extras[TOKEN_WEIGHT].to(adv.dtype)
    out = {
        "prompt_ids": rows.prompt_ids,
        "prompt_mask": rows.prompt_mask,
        "completion_ids": rows.completion_ids,
        "completion_mask": rows.completion_mask,
        "advantages": adv,
        "old_per_token_logps": rows.logprobs,
        "tool_mask": rows.loss_mask,
        "hdr_row": -1 - pg.row_group[sl],  # replay rows: -1 - (the row's group in ``groups``); fresh rows >= 0
    }
    for extra, key in EXTRA_KEYS.items():
        if extra in rows.extras:
            out[key] = rows.extras[extra]
    if groups[0].mm_inputs:
        out["hdr_mm"] = [groups[int(g)].mm_inputs for g in pg.row_group[sl].tolist()]
    return out


def spread(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts as evenly as possible (earlier parts get the extra ones)."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def take_rows(batch: dict, sl: slice) -> dict:
    return {k: (v if k in SCALAR_KEYS else v[sl]) for k, v in batch.items()}


def recount_items(batch: dict, dtype: torch.dtype) -> dict:
    """Set ``num_items_in_batch`` of a batch re-assembled from rows: its loss tokens (completion x tool mask)."""
    mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
    batch["num_items_in_batch"] = mask.sum().to(dtype)
    return batch


def gather_objects(accelerator, items: list | None) -> list | None:
    """Per-row Python objects of every rank, rank-major like :func:`gather_rows` (None stays None)."""
    if items is None or accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(list(items))


def gather_rows(accelerator, rows: dict, *, pad_token_id: int) -> dict:
    """``rows`` of every rank, rank-major; (N, L) tensors padded to the longest L first (prompts on the left)."""
    if accelerator.num_processes == 1:
        return rows
    out = {}
    for k, v in rows.items():
        if v.dim() == 2:
            v = accelerator.pad_across_processes(v, dim=1, pad_index=pad_token_id if k.endswith("ids") else 0,
                                                 pad_first=k.startswith("prompt"))
        out[k] = accelerator.gather(v)
    return out


# ---------------------------------------------------------------- the open replay step (its rows until commit)
# One replay step of HDRGRPOTrainer is one optimizer update: opened at the update's first generation, each
# generation batch adds a Generation (this rank's rows, the global rewards, the generation-time log-probs), the
# first one's selection lays out the replay rows, and at commit (on_step_end) the generations' rows are gathered
# and read into groups by generation_groups above.  (Here rather than in a file of its own: a fresh group's way
# from TRL's hook into the buffer is trainer.py -> batch.py -> ingest.py -> controller.py -> buffer.py.)


@dataclass
class Generation:
    """One generation batch of this rank, as ingress needs it at commit.

    rows:      :func:`.batch.ingress_rows` of the batch (B local rows, TRL's order).
    mm_rows, mm_why: vision-language batches: each local row's multimodal entries and why it cannot be
               stored (:func:`.mm.row_inputs`); None for text.
    rewards:   (N,) total reward of every row of the batch on all ranks (N = B * W), set by TRL's
               reward computation.
    gen_logps: (B, C) generation-time log-probs when TRL computed them (``old_per_token_logps``);
               None until captured otherwise.
    captured:  (B,) which rows' log-probs were captured from their training forward (capture mode).
    """

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    mm_rows: list | None = None
    mm_why: list | None = None
    rewards: torch.Tensor | None = None
    gen_logps: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    _capture: torch.Tensor | None = None

    @property
    def needs_capture(self) -> bool:
        return self.captured is not None

    def start_capture(self, rows: int, width: int, device) -> None:
        self._capture = torch.zeros(rows, width, device=device)
        self.captured = torch.zeros(rows, dtype=torch.bool, device=device)

    def capture(self, row_index: torch.Tensor, logps: torch.Tensor) -> None:
        """Record the log-probs of rows ``row_index`` (local indices) from a forward under the birth weights."""
        c = min(logps.shape[1], self._capture.shape[1])
        self._capture[row_index, :c] = logps[:, :c].detach().float()
        self.captured[row_index] = True

    def logps(self) -> torch.Tensor:
        """(B, C) generation-time log-probs (raises if a row was never captured)."""
        if self.gen_logps is not None:
            return self.gen_logps.float()
        if not bool(self.captured.all()):
            raise RuntimeError("HDRGRPOTrainer: some fresh rows were never trained before the optimizer update that "
                               "closes their replay step; their generation log-probs are unknown (this is a bug in "
                               "hdreplay, please report it with your GA / steps_per_generation / num_iterations)")
        return self._capture

    def ingress_rows(self) -> dict[str, torch.Tensor]:
        rows = dict(self.rows)
        rows["gen_logps"] = lp = self.logps()
        if "sampling_logprobs" in rows:  # vLLM could not score some tokens (NaN): store the trainer's value
            s = rows["sampling_logprobs"]
            rows["sampling_logprobs"] = torch.where(torch.isnan(s), lp.to(s.dtype), s)
        return rows


@dataclass
class ReplayStep:
    """The open replay step (one optimizer update).

    index:        controller step = optimizer updates completed when the step opened (TRL's global_step);
                  every group generated in the step is born at ``index``.
    generations:  the generation batches of the update, in order.
    selection:    the controller's selection (made at the first generation).
    replay_rows:  this rank's replay rows (R / W).  replay_tokens: loss tokens of all replayed groups (every
                  rank), added to TRL's ``num_items_in_batch``.
    replay_part:  this rank's replay rows as one TRL batch dict until the trainer cuts it into chunks.
    ref_refreshed: replay rows whose reference log-probs were recomputed after a reference-model sync.
    """

    index: int
    generations: list[Generation] = field(default_factory=list)
    selection: Selection | None = None
    replay_rows: int = 0
    replay_tokens: int = 0
    replay_part: dict | None = None
    ref_refreshed: int = 0

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    def open_generation(self) -> Generation:
        g = Generation()
        self.generations.append(g)
        return g
