"""A hand recomputation of TRL 1.16's GRPO loss on the merged micro-batch [fresh ; replay chunks].

Written from TRL's documented formulas (``GRPOTrainer._compute_loss``), not by calling it: the per-token term of
every loss type (clipped ratio, cispo, sapo, vespo's gamma weights), the KL to the reference (beta, optionally
bias-corrected), the off-policy sequence mask, the vLLM importance-sampling correction, the high-entropy token
mask, each loss type's normaliser over the merged rows, the entropy bonus and the router loss.  Only two per-row
helpers are TRL's own static methods (``get_gamma_weights``, ``get_off_policy_mask``): they are pure functions of
one row, so they cannot hide how the micro-step is composed.

What hdreplay defines per part (docs/trl.md, "How replay enters the loss"): the entropy quantile of
``top_entropy_quantile`` is taken per part (the fresh part is plain TRL's micro-batch), and the router loss is the
attended-token-weighted mean of the parts' values.  Everything else is the merged batch's.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer


def loss_mask(part: dict) -> torch.Tensor:
    m = part["completion_mask"]
    return (m * part["tool_mask"] if "tool_mask" in part else m).float()


def high_entropy_mask(entropies, mask, quantile: float) -> torch.Tensor:
    """Tokens of one part whose entropy is at least the part's (1 - quantile) quantile (one process)."""
    thr = torch.quantile(entropies[mask.bool()].float(), 1 - quantile)
    return ((entropies * mask) >= thr) & mask.bool()


def per_token_loss(tr, part: dict, logps: torch.Tensor, emask) -> torch.Tensor:
    a = tr.args
    mask = loss_mask(part)
    adv = part["advantages"]
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = part.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if tr.importance_sampling_level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    r = torch.exp(liw)
    if tr.loss_type == "cispo":
        ptl = -torch.clamp(r, max=tr.epsilon_high).detach() * adv * logps
    elif tr.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        r2 = torch.clamp(r, 1 - tr.epsilon_low, 1 + tr.epsilon_high)
        r1 = r if a.delta is None else torch.clamp(r, max=a.delta)
        ptl = -torch.min(r1 * adv, r2 * adv)
    elif tr.loss_type == "sapo":
        t = torch.where(adv > 0, a.sapo_temperature_pos, a.sapo_temperature_neg)
        ptl = -torch.sigmoid(t * (r - 1)) * 4 / t * adv
    elif tr.loss_type == "vespo":
        phi = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, part.get("importance_sampling_ratio"),
                                            a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg)
        ptl = -phi * adv * logps
    else:
        raise ValueError(tr.loss_type)
    if tr.off_policy_mask_threshold is not None:
        ptl = ptl * GRPOTrainer.get_off_policy_mask(adv, logps, part.get("sampling_per_token_logps", old), mask,
                                                    tr.off_policy_mask_threshold)
    if emask is not None:
        ptl = ptl * emask
    if tr.use_vllm and tr.vllm_importance_sampling_correction and tr.loss_type != "vespo":
        ptl = ptl * part["importance_sampling_ratio"]
    if tr.beta != 0.0:
        ref = part["ref_per_token_logps"]
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if a.use_bias_correction_kl:
            kl = kl * r
        ptl = ptl + tr.beta * kl
    return ptl


def merged_loss(tr, parts: list[dict], forwards: list[tuple], *, entropy_coef: float) -> torch.Tensor:
    """TRL's micro-step loss on the merged rows of ``parts``; ``forwards[p]`` = (log-probs, entropies, router loss)
    of part p from a forward with gradients; ``entropy_coef`` = the coefficient applied in this update."""
    ga, W, spg = tr.current_gradient_accumulation_steps, tr.accelerator.num_processes, tr.args.steps_per_generation
    q = tr.top_entropy_quantile
    sums, counts, bonus_num, bonus_parts, auxes, attn = [], [], 0.0, [], [], []
    for part, (logps, ent, aux) in zip(parts, forwards):
        mask = loss_mask(part)
        emask = high_entropy_mask(ent, mask, q) if q < 1.0 else None
        ptl = per_token_loss(tr, part, logps, emask)
        sums.append((ptl * mask).sum(-1))
        counts.append(mask.sum(-1))
        eff = mask if emask is None else mask * emask
        bonus_num = bonus_num + (ent * eff).sum()
        bonus_parts.append(((ent * eff).sum() / eff.sum().clamp(min=1.0), mask.sum()))
        auxes.append(aux)
        attn.append(float(part["prompt_mask"].sum() + part["completion_mask"].sum()))
    S, N = torch.cat(sums), torch.cat(counts)
    t = tr.loss_type
    if t in ("grpo", "sapo"):
        loss = (S / N.clamp(min=1.0)).mean() / ga
    elif t == "bnpo":
        loss = S.sum() / N.sum().clamp(min=1.0) / ga
    elif t == "dr_grpo":
        loss = S.sum() / (S.shape[0] * tr.max_completion_length) / ga
    elif t in ("dapo", "cispo", "vespo"):
        loss = S.sum() / (parts[0]["num_items_in_batch"].clamp(min=1.0) / W * ga / spg)
    elif t == "luspo":
        loss = S.mean() / ga
    else:
        raise ValueError(t)
    if tr._entropy_bonus_enabled:
        if q < 1.0:  # each part's mean over its own high-entropy tokens, weighted by its loss tokens
            total = sum(float(n) for _, n in bonus_parts)
            h = sum(m * float(n) / total for m, n in bonus_parts)
        else:  # the merged token mean
            h = bonus_num / N.sum().clamp(min=1.0)
        loss = loss - entropy_coef * h / ga
    if tr.aux_loss_enabled:
        loss = loss + tr.router_aux_loss_coef * sum(a * j / sum(attn) for a, j in zip(auxes, attn)) / ga
    return loss
