"""TRL's loss terms that are not sums over rows, counted once per micro-step across its parts.

A chunked micro-step (:mod:`.microstep`) runs TRL 1.16's whole ``_compute_loss`` on each part p (the fresh rows,
then each replay chunk) and weights it by w_p (:func:`.microstep.chunk_scales`), so that the per-token terms --
the clipped policy term, the KL to the reference (beta), the off-policy sequence mask, the vLLM importance-sampling
correction -- add up to TRL's loss on the merged micro-batch exactly.  Two terms of that loss are not sums over
rows; with weight w_p each, the entropy bonus would count once per part under dapo / cispo / vespo (w_p = 1) and
the MoE router loss too.  :func:`correction` adds, per part, what turns TRL's own term into its share:

===================  =================================  ====================================================
term                 TRL, one micro-batch               replay micro-step (sum over parts)
===================  =================================  ====================================================
entropy bonus        - c * H_mean(tokens) / GA          - c * sum_p s_p * H_mean(part p) / GA with s_p = the
                                                        part's share of loss tokens: the merged token mean
                                                        exactly (with top_entropy_quantile < 1 each part's
                                                        mean is over its own high-entropy tokens)
router aux loss      + a * aux(micro-batch) / GA        + a * sum_p j_p * aux(part p) / GA with j_p = the
                                                        part's share of attended tokens (the load-balancing
                                                        loss is a product of two token means: the merged
                                                        value is not a sum over parts; this is the closest
                                                        one-pass-per-part form, counted once)
===================  =================================  ====================================================

c is the coefficient TRL applies in this update (:func:`applied_entropy_coef`); its adaptive controller reads
``accelerator.sync_gradients``, which is False in every part but the micro-step's last (:mod:`.sync`), so it steps
once per update and every part of an update applies the same c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .microstep import loss_mask


@dataclass
class PartTerms:
    """What one part's policy forward produced (captured by the trainer): ``entropies`` (B, C) and ``aux`` (0-d),
    both still attached to the graph."""

    entropies: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    seen: bool = False


def shares(parts: list[dict]) -> tuple[list[float], list[float]]:
    """(loss-token shares s_p, attended-token shares j_p) of the parts of one micro-step; row shares where a
    micro-step has no such token at all."""
    rows = [p["prompt_ids"].shape[0] for p in parts]
    loss_toks = [float(loss_mask(p).sum()) for p in parts]
    attn = [float(p["prompt_mask"].sum() + p["completion_mask"].sum()) for p in parts]

    def norm(xs):
        total = sum(xs)
        return [x / total for x in xs] if total > 0 else [r / sum(rows) for r in rows]

    return norm(loss_toks), norm(attn)


def applied_entropy_coef(trainer) -> float:
    """The entropy coefficient TRL 1.16's ``_compute_loss`` applies in the current update: ``entropy_coef``, or
    with ``use_adaptive_entropy`` 0 until the last update's window entropy is at most ``entropy_target``.  Read
    before a part's loss runs (the controller may step inside the micro-step's last part)."""
    if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
        return 0.0
    return float(trainer.entropy_coef)


def entropy_term(entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None, ga: int):
    """TRL 1.16's entropy_loss of one batch: mean entropy over its (high-entropy) loss tokens / GA."""
    eff = mask if entropy_mask is None else mask * entropy_mask
    return (entropies * eff).sum() / eff.sum().clamp(min=1.0) / ga


def correction(trainer, part: dict, terms: PartTerms, *, weight: float, loss_share: float, token_share: float,
               entropy_coef: float) -> torch.Tensor | float:
    """Added to ``weight`` x TRL's loss on ``part``: its entropy bonus becomes ``loss_share`` of the micro-step's,
    its router loss ``token_share`` (see module doc).  0 when the part ran no TRL loss forward."""
    if not terms.seen:
        return 0.0
    ga = trainer.current_gradient_accumulation_steps
    out = 0.0
    if trainer._entropy_bonus_enabled and entropy_coef != 0.0:  # (the same on every rank: the call below gathers)
        mask = loss_mask(part).to(terms.entropies.dtype)
        high = None if trainer.top_entropy_quantile >= 1.0 else trainer.get_high_entropy_mask(  # TRL's own mask of
            terms.entropies.detach(), mask, 1 - trainer.top_entropy_quantile)  # this part, by TRL's own method
        if weight != loss_share:
            out = out + entropy_coef * (weight - loss_share) * entropy_term(terms.entropies, mask, high, ga)
    if trainer.aux_loss_enabled and terms.aux is not None and weight != token_share:
        out = out + trainer.router_aux_loss_coef * (token_share - weight) * terms.aux / ga
    return out
