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
from .store.record import LOGPROB_POSITIVE_TOLERANCE, GroupRecord, check_logprobs

HeadroomWeighting = Literal["sign", "advantage"]
DriftNorm = Literal["l2", "l1"]
HEADROOM_WEIGHTINGS = ("sign", "advantage")
DRIFT_NORMS = ("l2", "l1")


def _tensor(name: str, t, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ReplayInputError(f"`{name}` must be a torch.Tensor, got {type(t).__name__} "
                               "(convert NumPy arrays with torch.from_numpy)")
    if t.is_complex():
        raise ReplayInputError(f"`{name}` must be real, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ReplayInputError(f"`{name}` has shape {tuple(t.shape)}, expected {shape} (G, T)")
    return t


def _choice(name: str, value, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ReplayInputError(f"unknown {name} {value!r}; valid: {list(choices)}")


def _logprobs(name: str, t, shape: tuple[int, ...] | None, mask: torch.Tensor | None) -> torch.Tensor:
    """A floating (G, T) tensor of log-probs, finite and <= 0 wherever ``mask`` (all if None) is set."""
    t = _tensor(name, t, shape)
    if t.dim() != 2:
        raise ReplayInputError(f"`{name}` must be (G, T), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ReplayInputError(f"`{name}` must be floating point, got {t.dtype}")
    check_logprobs(name, t, torch.ones_like(t, dtype=torch.bool) if mask is None else mask, "scores")
    return t


def _finite(name: str, t, shape: tuple[int, ...], mask: torch.Tensor | None) -> torch.Tensor:
    t = _tensor(name, t, shape)
    sel = t if mask is None else t[mask]
    if t.dtype == torch.bool or not bool(torch.isfinite(sel.float()).all()):
        raise ReplayInputError(f"`{name}` must hold finite numbers at the masked positions")
    return t


def _mask_and_count(logprobs, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``logprobs: (G, T)`` and ``mask: (G, T)`` (bool or exactly 0/1, every row non-empty)."""
    lp = _tensor("logprobs", logprobs)
    if lp.dim() != 2:
        raise ReplayInputError(f"`logprobs` must be (G, T), got shape {tuple(lp.shape)}")
    mask = _tensor("mask", mask, tuple(lp.shape))
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ReplayInputError("`mask` must be bool or hold only 0/1")
    m = mask.to(torch.bool)
    count = m.sum(dim=1)
    if bool((count == 0).any()):
        rows = (count == 0).nonzero().flatten().tolist()
        raise ReplayInputError(f"rows {rows} have an all-zero mask; T(g) must be non-empty")
    _logprobs("logprobs", lp, None, m)
    return m, count


def _token_headroom(logprobs: torch.Tensor, advantages: torch.Tensor, weighting: str) -> torch.Tensor:
    p = logprobs.float().clamp(max=0.0).exp()  # round-off above 0 (within tolerance) counts as p = 1
    a = advantages.float()
    h = torch.where(a > 0, 1.0 - p, torch.where(a < 0, p, torch.zeros_like(p)))
    return h * a.abs() if weighting == "advantage" else h


def token_headroom(
    *, logprobs: torch.Tensor, advantages: torch.Tensor, weighting: HeadroomWeighting = "sign"
) -> torch.Tensor:
    """Token-level headroom h_ij (same shape as ``logprobs``: (G, T)), weighted by |A| for "advantage".

    ``logprobs`` must be finite and <= 0 everywhere, ``advantages`` finite (same shape)."""
    _choice("headroom weighting", weighting, HEADROOM_WEIGHTINGS)
    lp = _logprobs("logprobs", logprobs, None, None)
    adv = _finite("advantages", advantages, tuple(lp.shape), None)
    return _token_headroom(lp, adv, weighting)


def _headroom(lp: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, count: torch.Tensor, weighting: str):
    h = torch.where(m, _token_headroom(lp, adv, weighting), torch.zeros(lp.shape))
    if weighting == "sign":
        return h.sum(dim=1) / count
    w = torch.where(m, adv.float().abs(), torch.zeros(lp.shape)).sum(dim=1)
    return torch.where(w > 0, h.sum(dim=1) / w.clamp_min(1e-30), torch.zeros_like(w))


def headroom(
    *,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weighting: HeadroomWeighting = "sign",
) -> torch.Tensor:
    """Group Headroom.

    Args:
        logprobs:   (G, T) token log-probs under the policy being evaluated (finite, <= 0 on the mask).
        advantages: (G, T) the response advantage A_i broadcast to its tokens (finite on the mask).
        mask:       (G, T) 1 on T(g) (bool or 0/1; every row needs one).
        weighting:  "sign" (paper default) or "advantage".
    Returns:
        (G,) float32 Headroom in [0, 1].

    >>> import torch
    >>> probs = torch.tensor([[0.9, 0.5], [0.2, 0.4]])  # pi(a|s) of two groups' tokens
    >>> adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])  # a winning and a losing response
    >>> headroom(logprobs=probs.log(), advantages=adv, mask=torch.ones(2, 2))  # mean(1 - p), mean(p)
    tensor([0.3000, 0.3000])
    """
    _choice("headroom weighting", weighting, HEADROOM_WEIGHTINGS)
    m, count = _mask_and_count(logprobs, mask)
    adv = _finite("advantages", advantages, tuple(logprobs.shape), m)
    return _headroom(logprobs, adv, m, count, weighting)


def _delta(lp: torch.Tensor, ref: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    d = lp.float() - ref.float()
    return torch.where(m, d, torch.zeros_like(d))


def _drift_terms(lp: torch.Tensor, ref: torch.Tensor, m: torch.Tensor, norm: str) -> torch.Tensor:
    """The Drift terms in float64 (0 off the mask): a mean of float32 terms could underflow to 0 (one token moved by
    1e-22 squares to a subnormal), and Drift <= tau must be decided as the paper's arithmetic decides it."""
    d = lp.double() - ref.double()
    d = torch.where(m, d, torch.zeros_like(d))
    return d.square() if norm == "l2" else d.abs()


def _drift(lp, ref, m, count, norm: str) -> torch.Tensor:
    return _drift_terms(lp, ref, m, norm).sum(dim=1) / count


def _kl_per_group(lp, ref, m, count) -> torch.Tensor:
    d = _delta(lp, ref, m)
    return (torch.expm1(d) - d).sum(dim=1) / count


def _pair(logprobs, ref_logprobs, mask) -> tuple[torch.Tensor, torch.Tensor]:
    m, count = _mask_and_count(logprobs, mask)
    _logprobs("ref_logprobs", ref_logprobs, tuple(logprobs.shape), m)
    return m, count


def drift(
    *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, norm: DriftNorm = "l2"
) -> torch.Tensor:
    """Policy Drift between current ``logprobs`` and stored generation-time ``ref_logprobs``.

    Args:
        logprobs:     (G, T) current-policy token log-probs (finite, <= 0 on the mask).
        ref_logprobs: (G, T) generation-time token log-probs (log pi_gen; finite, <= 0 on the mask).
        mask:         (G, T) 1 on T(g) (bool or 0/1; every row needs one).
        norm:         "l2" (mean squared difference, paper default) or "l1" (mean absolute).
    Returns:
        (G,) float64 Drift >= 0 (computed in float64 from the given log-probs).

    >>> import torch
    >>> gen = torch.tensor([[-1.0, -2.0, 0.0]])
    >>> now = torch.tensor([[-1.5, -1.5, -9.0]])
    >>> mask = torch.tensor([[1, 1, 0]])  # the third position is padding: not in T(g)
    >>> drift(logprobs=now, ref_logprobs=gen, mask=mask), drift(logprobs=now, ref_logprobs=gen, mask=mask, norm="l1")
    (tensor([0.2500], dtype=torch.float64), tensor([0.5000], dtype=torch.float64))
    """
    _choice("drift norm", norm, DRIFT_NORMS)
    m, count = _pair(logprobs, ref_logprobs, mask)
    return _drift(logprobs, ref_logprobs, m, count, norm)


def replay_kl_per_group(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-group mean k3 estimate of KL(pi_gen || pi_theta) over T(g).

    Args:
        logprobs: (G, T) current; ref_logprobs: (G, T) generation-time; mask: (G, T) (as :func:`drift`).
    Returns:
        (G,) float32, >= 0.
    """
    m, count = _pair(logprobs, ref_logprobs, mask)
    return _kl_per_group(logprobs, ref_logprobs, m, count)


def replay_kl(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean k3 estimate over all masked tokens of the batch (the paper's replay KL).

    Args: as :func:`replay_kl_per_group`.  Returns: () float32.
    """
    m, count = _pair(logprobs, ref_logprobs, mask)
    d = _delta(logprobs, ref_logprobs, m)
    return (torch.expm1(d) - d).sum() / count.sum()


# ---------------------------------------------------------------- per-group scoring of stored groups
def check_scorer_output(groups: Sequence[GroupRecord], logprobs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Validate a scorer's output: one finite, <= 0, ``(T_g,)`` tensor per group. Returns float32 CPU tensors."""
    groups = _groups(groups)
    if not isinstance(logprobs, (list, tuple)):
        raise ReplayInputError(
            f"scorer must return a list of per-group (T_g,) tensors, got {type(logprobs).__name__}"
        )
    if len(logprobs) != len(groups):
        raise ReplayInputError(f"scorer returned {len(logprobs)} results for {len(groups)} groups")
    out = []
    for g, lp in zip(groups, logprobs):
        if not isinstance(lp, torch.Tensor) or not lp.is_floating_point():
            raise ReplayInputError(f"scorer output for group {g.group_id!r} must be a floating torch.Tensor, got "
                                   f"{type(lp).__name__}{'' if not isinstance(lp, torch.Tensor) else ' ' + str(lp.dtype)}")  # noqa: E501
        t = lp.detach().to("cpu", torch.float32)
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
    """Per-group scores from one current-policy pass: (G,) tensors (Drift float64, the others float32)."""

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


def _groups(groups) -> list[GroupRecord]:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, GroupRecord) for g in groups):
        raise ReplayInputError(f"groups: must be a list of GroupRecords, got {type(groups).__name__}")
    return list(groups)


def group_scores(
    groups: Sequence[GroupRecord],
    current_logprobs: Sequence[torch.Tensor],
    *,
    drift_norm: DriftNorm = "l2",
    headroom_weighting: HeadroomWeighting = "sign",
) -> GroupScores:
    """Drift, runtime Headroom and replay KL of ``groups`` under the policy that produced ``current_logprobs``.

    Args:
        groups:           G stored groups (G may be 0: empty scores).
        current_logprobs: G tensors ``(T_g,)`` (checked by :func:`check_scorer_output`).
    """
    _choice("drift norm", drift_norm, DRIFT_NORMS)
    _choice("headroom weighting", headroom_weighting, HEADROOM_WEIGHTINGS)
    return score_groups(groups, check_scorer_output(groups, current_logprobs), drift_norm=drift_norm,
                        headroom_weighting=headroom_weighting)


def score_groups(groups: Sequence[GroupRecord], current_logprobs: Sequence[torch.Tensor], *, drift_norm: str,
                 headroom_weighting: str) -> GroupScores:
    """:func:`group_scores` on inputs already checked (by :func:`check_scorer_output`): the selection's path."""
    if not groups:
        z = torch.zeros(0)
        return GroupScores(z, z, z, torch.zeros(0, dtype=torch.int64))
    pk = _Packed.of(groups)
    cur = pk.grid(torch.cat(list(current_logprobs)).float())
    count = pk.mask.sum(dim=1)
    return GroupScores(
        drift=_drift(cur, pk.logprobs, pk.mask, count, drift_norm),
        headroom=_headroom(cur, pk.token_adv, pk.mask, count, headroom_weighting),
        replay_kl=_kl_per_group(cur, pk.logprobs, pk.mask, count),
        num_loss_tokens=count,
    )


def reference_headroom(groups: Sequence[GroupRecord], *, weighting: HeadroomWeighting = "sign") -> torch.Tensor:
    """(G,) H_ref(g) = Headroom(g; pi_gen) from the stored generation-time log-probs."""
    groups = _groups(groups)
    _choice("headroom weighting", weighting, HEADROOM_WEIGHTINGS)
    if not groups:
        return torch.zeros(0)
    pk = _Packed.of(groups)
    return _headroom(pk.logprobs, pk.token_adv, pk.mask, pk.mask.sum(dim=1), weighting)


# ---------------------------------------------------------------- exact early rejection (hdreplay.rescore)
#: float64 unit round-off (2**-53): the early-rejection bound allows for any order of the full scan's float64 sum
_U64 = 2.0 ** -53


def drift_term_sums(groups: Sequence[GroupRecord], current_logprobs: Sequence[torch.Tensor], *,
                    drift_norm: str) -> list[float]:
    """Per group, the float64 sum over its loss tokens of the Drift terms (what :func:`drift` averages).  Inputs as
    :func:`score_groups` (checked); used on response slices of stored groups, whose sums add up to a lower bound of
    the group's total (every term is >= 0)."""
    if not groups:
        return []
    terms = _drift_terms(torch.cat(list(current_logprobs)), torch.cat([g.logprobs for g in groups]),
                         torch.cat([g.loss_mask for g in groups]), drift_norm)
    return [float(t.sum()) for t in terms.split([g.num_tokens for g in groups])]


def score_group(group: GroupRecord, current: torch.Tensor, *, drift_norm: str,
                headroom_weighting: str) -> tuple[float, float, float]:
    """(Drift, runtime Headroom, replay KL) of one stored group from its checked ``(T,)`` current log-probs: the
    numbers :func:`score_groups` gives for ``[group]`` alone (one row, no padding), without packing."""
    m = group.loss_mask[None]
    count = m.sum(dim=1)
    lp, ref = current.float()[None], group.logprobs[None]
    return (float(_drift(lp, ref, m, count, drift_norm)[0]),
            float(_headroom(lp, group.token_advantages()[None], m, count, headroom_weighting)[0]),
            float(_kl_per_group(lp, ref, m, count)[0]))


def drift_rejects(partial_sum: float, num_loss_tokens: int, tau: float) -> bool:
    """Whether the gate rejects a group (Drift > tau) whatever its tokens not yet scored hold.

    ``partial_sum``: float64 sum of the Drift terms of some of the group's loss tokens (:func:`drift_term_sums`);
    ``num_loss_tokens``: |T(g)| of the WHOLE group (the mean's denominator).  Every term is >= 0, so Drift >=
    ``partial_sum / |T(g)|``.  The slack 2 (N + 2) u, u = 2**-53, covers any summation order of the full float64
    sum and the division, so it returns True only if the full scan's Drift, however summed, exceeds tau: early
    rejection never rejects a group the full scan accepts.
    """
    n = int(num_loss_tokens)
    slack = 2.0 * (n + 2) * _U64
    return slack < 0.5 and partial_sum * (1.0 - slack) > tau * n
