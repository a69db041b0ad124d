"""Pure scoring functions: Headroom, Policy Drift, replay KL.

Every function takes *padded* tensors with one row per group (or per response):
``(G, T)`` where T is the longest row, and a ``mask: (G, T)`` that is 1 exactly
on the positions in T(g) (loss-mask tokens).  Padding and tool tokens are
excluded by the mask.  Rows are reduced independently; a row whose mask is
all zero raises (T(g) may not be empty).

Definitions (paper, Method + Appendix A.3):
    h_ij        = 1 - pi(a|s) if A_i > 0;  pi(a|s) if A_i < 0;  0 if A_i = 0
    Headroom(g) = mean_{(i,j) in T(g)} h_ij                          ("sign", default)
                = sum |A_i| h_ij / sum |A_i|   over T(g)             ("advantage")
    Drift(g)    = mean_{T(g)} (log pi_theta - log pi_gen)^2           ("l2", default)
                = mean_{T(g)} |log pi_theta - log pi_gen|             ("l1")
    replay KL   = mean_{T(g)} k3,  k3 = exp(D) - 1 - D,  D = log pi_theta - log pi_gen

The k3 estimator is unbiased for KL(pi_gen || pi_theta) because the stored tokens
were sampled from pi_gen; for small drift it equals Drift/2 to second order.
The "advantage" weighting normalises by the |A_i| mass so it stays in [0, 1]
(the paper's Z_adv ~ H+/2 + H-/2); a group whose advantages are all 0 scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from .errors import ReplayInputError
from .record import LOGPROB_POSITIVE_TOLERANCE, GroupRecord, check_logprobs

HeadroomWeighting = Literal["sign", "advantage"]
DriftNorm = Literal["l2", "l1"]
HEADROOM_WEIGHTINGS = ("sign", "advantage")
DRIFT_NORMS = ("l2", "l1")


def _check(name: str, t: torch.Tensor, ref_shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ReplayInputError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != ref_shape:
        raise ReplayInputError(f"`{name}` has shape {tuple(t.shape)}, expected {ref_shape} (G, T)")


def _mask_and_count(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logprobs.dim() != 2:
        raise ReplayInputError(f"`logprobs` must be (G, T), got shape {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise ReplayInputError(f"`logprobs` must be floating point, got {logprobs.dtype}")
    _check("mask", mask, tuple(logprobs.shape))
    m = mask.to(torch.bool)
    count = m.sum(dim=1)
    if bool((count == 0).any()):
        rows = (count == 0).nonzero().flatten().tolist()
        raise ReplayInputError(f"rows {rows} have an all-zero mask; T(g) must be non-empty")
    return m, count


def token_headroom(
    *, logprobs: torch.Tensor, advantages: torch.Tensor, weighting: HeadroomWeighting = "sign"
) -> torch.Tensor:
    """Token-level headroom h_ij (same shape as ``logprobs``), weighted by |A| for "advantage"."""
    if weighting not in HEADROOM_WEIGHTINGS:
        raise ReplayInputError(f"unknown headroom weighting {weighting!r}; valid: {list(HEADROOM_WEIGHTINGS)}")
    p = logprobs.float().exp()
    a = advantages.float()
    h = torch.where(a > 0, 1.0 - p, torch.where(a < 0, p, torch.zeros_like(p)))
    return h * a.abs() if weighting == "advantage" else h


def headroom(
    *,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weighting: HeadroomWeighting = "sign",
) -> torch.Tensor:
    """Group Headroom.

    Args:
        logprobs:   (G, T) token log-probs under the policy being evaluated.
        advantages: (G, T) the response advantage A_i broadcast to its tokens.
        mask:       (G, T) 1 on T(g).
        weighting:  "sign" (paper default) or "advantage".
    Returns:
        (G,) float32 Headroom in [0, 1].
    """
    m, count = _mask_and_count(logprobs, mask)
    _check("advantages", advantages, tuple(logprobs.shape))
    h = token_headroom(logprobs=logprobs, advantages=advantages, weighting=weighting)
    h = torch.where(m, h, torch.zeros_like(h))
    if weighting == "sign":
        return h.sum(dim=1) / count
    w = torch.where(m, advantages.float().abs(), torch.zeros_like(h)).sum(dim=1)
    return torch.where(w > 0, h.sum(dim=1) / w.clamp_min(1e-30), torch.zeros_like(w))


def drift(
    *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, norm: DriftNorm = "l2"
) -> torch.Tensor:
    """Policy Drift between current ``logprobs`` and stored generation-time ``ref_logprobs``.

    Args:
        logprobs:     (G, T) current-policy token log-probs.
        ref_logprobs: (G, T) generation-time token log-probs (log pi_gen).
        mask:         (G, T) 1 on T(g).
        norm:         "l2" (mean squared difference, paper default) or "l1" (mean absolute).
    Returns:
        (G,) float32 Drift >= 0.
    """
    if norm not in DRIFT_NORMS:
        raise ReplayInputError(f"unknown drift norm {norm!r}; valid: {list(DRIFT_NORMS)}")
    m, count = _mask_and_count(logprobs, mask)
    _check("ref_logprobs", ref_logprobs, tuple(logprobs.shape))
    d = logprobs.float() - ref_logprobs.float()
    d = torch.where(m, d, torch.zeros_like(d))
    d = d.square() if norm == "l2" else d.abs()
    return d.sum(dim=1) / count


def replay_kl_per_group(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-group mean k3 estimate of KL(pi_gen || pi_theta) over T(g).

    Args:
        logprobs: (G, T) current; ref_logprobs: (G, T) generation-time; mask: (G, T).
    Returns:
        (G,) float32, >= 0.
    """
    m, count = _mask_and_count(logprobs, mask)
    _check("ref_logprobs", ref_logprobs, tuple(logprobs.shape))
    d = logprobs.float() - ref_logprobs.float()
    k3 = torch.expm1(d) - d
    return torch.where(m, k3, torch.zeros_like(k3)).sum(dim=1) / count


def replay_kl(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean k3 estimate over all masked tokens of the batch (the paper's replay KL).

    Args: as :func:`replay_kl_per_group`.  Returns: () float32.
    """
    m, count = _mask_and_count(logprobs, mask)
    _check("ref_logprobs", ref_logprobs, tuple(logprobs.shape))
    d = logprobs.float() - ref_logprobs.float()
    k3 = torch.expm1(d) - d
    return torch.where(m, k3, torch.zeros_like(k3)).sum() / count.sum()


# ---------------------------------------------------------------- per-group scoring of stored groups
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
