"""Between ragged groups and the padded row tensors models consume.

:func:`pad_groups` lays G groups out as R = sum_g n_g rows in the layout causal-LM
trainers use (prompt left-padded, completion right-padded), and
:meth:`PaddedGroups.split_by_group` turns a per-row ``(R, L)`` result (e.g. the
per-token log-probs a scorer computed) back into one flat ``(T_g,)`` tensor per
group, the form :func:`hdreplay.selection.select_replay` expects from a scorer.

:func:`group_scores` computes Drift, runtime Headroom and replay KL of groups
from current log-probs, using the pure functions of :mod:`hdreplay.scores`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from .errors import ReplayInputError
from .scores import DriftNorm, HeadroomWeighting, drift, headroom, replay_kl_per_group
from .types import LOGPROB_POSITIVE_TOLERANCE, GroupRecord, check_logprobs


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
    """Lay ``groups`` out as rows (each group's n responses consecutive, in order)."""
    if not groups:
        raise ReplayInputError("pad_groups needs at least one group")
    prompts, comps, masks, lps, rows_g, lens, keys = [], [], [], [], [], [], sorted(groups[0].extras)
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


def check_scorer_output(groups: Sequence[GroupRecord], logprobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Validate a scorer's output: one finite, <= 0, ``(T_g,)`` tensor per group. Returns float32 CPU tensors."""
    if not isinstance(logprobs, (list, tuple)):
        raise ReplayInputError(
            f"scorer must return a list of per-group (T_g,) tensors, got {type(logprobs).__name__}"
        )
    if len(logprobs) != len(groups):
        raise ReplayInputError(f"scorer returned {len(logprobs)} results for {len(groups)} groups")
    out = []
    for g, lp in zip(groups, logprobs):
        t = torch.as_tensor(lp).detach().to("cpu", torch.float32)
        if t.dim() != 1 or t.numel() != g.num_tokens:
            raise ReplayInputError(
                f"scorer output for group {g.group_id!r} has shape {tuple(t.shape)}; expected ({g.num_tokens},) "
                "= all completion tokens of the group concatenated (use PaddedGroups.split_by_group)"
            )
        out.append(t)
    if out:  # one vectorised check; re-check group by group only to name the culprit
        flat, mask = torch.cat(out), torch.cat([g.loss_mask for g in groups])
        sel = flat[mask]
        if not bool(torch.isfinite(sel).all()) or (sel.numel() and float(sel.max()) > LOGPROB_POSITIVE_TOLERANCE):
            for g, t in zip(groups, out):
                check_logprobs("scorer log-probs", t, g.loss_mask, f"group {g.group_id!r}")
    return out


@dataclass(frozen=True)
class GroupScores:
    """Per-group scores from one current-policy pass: each a (G,) float32 tensor."""

    drift: torch.Tensor
    headroom: torch.Tensor
    replay_kl: torch.Tensor
    num_loss_tokens: torch.Tensor


def _pad(xs: list[torch.Tensor]) -> torch.Tensor:
    return pad_sequence(xs, batch_first=True)


@dataclass(frozen=True)
class _Packed:
    """G groups as padded (G, T_max) rows (one row per group, responses concatenated)."""

    logprobs: torch.Tensor
    mask: torch.Tensor
    token_adv: torch.Tensor
    seg: torch.Tensor
    pos: torch.Tensor

    @classmethod
    def of(cls, groups: Sequence[GroupRecord]) -> "_Packed":
        lengths = torch.tensor([g.num_tokens for g in groups])
        G, T = len(groups), int(lengths.max())
        seg = torch.repeat_interleave(torch.arange(G), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(int(lengths.sum())) - starts[seg]
        resp_len = torch.cat([g.response_lengths for g in groups])
        tok_adv = torch.repeat_interleave(torch.cat([g.advantages for g in groups]), resp_len)

        def grid(flat: torch.Tensor) -> torch.Tensor:
            out = flat.new_zeros((G, T))
            out[seg, pos] = flat
            return out

        return cls(grid(torch.cat([g.logprobs for g in groups])), grid(torch.cat([g.loss_mask for g in groups])),
                   grid(tok_adv), seg, pos)

    def grid(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_zeros(self.mask.shape)
        out[self.seg, self.pos] = flat
        return out


def group_scores(
    groups: Sequence[GroupRecord],
    current_logprobs: Sequence[torch.Tensor],
    *,
    drift_norm: DriftNorm = "l2",
    headroom_weighting: HeadroomWeighting = "sign",
) -> GroupScores:
    """Drift, runtime Headroom and replay KL of ``groups`` under the policy that produced ``current_logprobs``.

    Args:
        groups:           G stored groups.
        current_logprobs: G tensors ``(T_g,)`` (validated by :func:`check_scorer_output`).
    """
    pk = _Packed.of(groups)
    cur = pk.grid(torch.cat(list(current_logprobs)).float())
    return GroupScores(
        drift=drift(logprobs=cur, ref_logprobs=pk.logprobs, mask=pk.mask, norm=drift_norm),
        headroom=headroom(logprobs=cur, advantages=pk.token_adv, mask=pk.mask, weighting=headroom_weighting),
        replay_kl=replay_kl_per_group(logprobs=cur, ref_logprobs=pk.logprobs, mask=pk.mask),
        num_loss_tokens=pk.mask.sum(dim=1),
    )


def reference_headroom(groups: Sequence[GroupRecord], *, weighting: HeadroomWeighting = "sign") -> torch.Tensor:
    """(G,) H_ref(g) = Headroom(g; pi_gen) from the stored generation-time log-probs."""
    if not groups:
        return torch.zeros(0)
    pk = _Packed.of(groups)
    return headroom(logprobs=pk.logprobs, advantages=pk.token_adv, mask=pk.mask, weighting=weighting)
