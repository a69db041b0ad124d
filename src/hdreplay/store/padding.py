"""Between ragged groups and the padded row tensors models consume.

:func:`pad_groups` lays G groups out as R = sum_g n_g rows in the layout causal-LM
trainers use (prompt left-padded, completion right-padded), and
:meth:`PaddedGroups.split_by_group` turns a per-row ``(R, L)`` result (e.g. the
per-token log-probs a scorer computed) back into one flat ``(T_g,)`` tensor per
group, the form :func:`hdreplay.selection.select_replay` expects from a scorer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import ReplayInputError
from ..validate import MAX_TOKEN_ID, check_int, check_sequence
from .record import GroupRecord


@dataclass(frozen=True)
class PaddedGroups:
    """G groups as R rows.

    prompt_ids:      (R, P) int64, left-padded with ``pad_token_id``
    prompt_mask:     (R, P) int64, 1 on real prompt tokens
    completion_ids:  (R, L) int64, right-padded
    completion_mask: (R, L) int64, 1 on real completion tokens
    loss_mask:       (R, L) int64, completion_mask x tool mask (T(g))
    logprobs:        (R, L) float32, stored generation-time log-probs (0 on padding)
    advantages:      (R,)   float32 stored A_i
    rewards:         (R,)   float32
    row_group:       (R,)   int64, index into the ``groups`` list
    extras:          name -> (R, L) float32
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    row_group: torch.Tensor
    extras: dict
    response_lengths: tuple[int, ...]
    group_rows: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    def split_by_group(self, values: torch.Tensor) -> list[torch.Tensor]:
        """(R, L') per-row values (L' >= longest completion) -> list of G flat ``(T_g,)`` tensors."""
        if not isinstance(values, torch.Tensor):
            raise ReplayInputError(f"values: must be a torch.Tensor (R, L'), got {type(values).__name__}")
        if values.dim() != 2 or values.shape[0] != self.num_rows or values.shape[1] < max(self.response_lengths):
            raise ReplayInputError(
                f"expected per-row values of shape ({self.num_rows}, >= {max(self.response_lengths)}), "
                f"got {tuple(values.shape)}"
            )
        rows = [values[r, :n] for r, n in enumerate(self.response_lengths)]
        out, r = [], 0
        for k in self.group_rows:
            out.append(torch.cat(rows[r:r + k]))
            r += k
        return out


def pad_groups(groups: Sequence[GroupRecord], *, pad_token_id: int) -> PaddedGroups:
    """Lay ``groups`` (a non-empty list of GroupRecords with the same extras) out as rows (each group's
    n responses consecutive, in order); ``pad_token_id`` is an int in [0, 2**31)."""
    groups = check_sequence("groups", groups)
    if not groups:
        raise ReplayInputError("pad_groups needs at least one group")
    if not all(isinstance(g, GroupRecord) for g in groups):
        raise ReplayInputError("groups: must hold GroupRecords only")
    pad_token_id = check_int("pad_token_id", pad_token_id, hi=MAX_TOKEN_ID - 1)
    keys = sorted(groups[0].extras)
    for g in groups:
        if sorted(g.extras) != keys:
            raise ReplayInputError(f"group {g.group_id!r} carries extras {sorted(g.extras)} but group "
                                   f"{groups[0].group_id!r} carries {keys}; padded groups must carry the same extras")
    prompts, comps, masks, lps, rows_g, lens = [], [], [], [], [], []
    extras = {k: [] for k in keys}
    for gi, g in enumerate(groups):
        pieces = g.responses()
        prompts.extend([g.prompt_ids.flip(0).long()] * len(pieces))
        comps.extend(p.long() for p in pieces)
        masks.extend(g.split(g.loss_mask.long()))
        lps.extend(g.split(g.logprobs))
        for k in keys:
            extras[k].extend(g.split(g.extras[k]))
        rows_g.extend([gi] * len(pieces))
        lens.extend(int(x) for x in g.response_lengths)
    prompt = pad_sequence(prompts, batch_first=True, padding_value=pad_token_id).flip(1)
    pmask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True).flip(1)
    comp = pad_sequence(comps, batch_first=True, padding_value=pad_token_id)
    cmask = pad_sequence([torch.ones_like(c) for c in comps], batch_first=True)
    return PaddedGroups(
        prompt_ids=prompt,
        prompt_mask=pmask,
        completion_ids=comp,
        completion_mask=cmask,
        loss_mask=pad_sequence(masks, batch_first=True),
        logprobs=pad_sequence(lps, batch_first=True),
        advantages=torch.cat([g.advantages for g in groups]),
        rewards=torch.cat([g.rewards for g in groups]),
        row_group=torch.tensor(rows_g, dtype=torch.int64),
        extras={k: pad_sequence(v, batch_first=True) for k, v in extras.items()},
        response_lengths=tuple(lens),
        group_rows=tuple(g.num_responses for g in groups),
    )
