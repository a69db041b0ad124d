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

from typing import Literal

import torch

from .errors import ReplayInputError

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
