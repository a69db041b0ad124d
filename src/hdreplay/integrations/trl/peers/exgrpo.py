"""ExGRPO's mixed-policy groups at TRL's generation seam (the rules: :mod:`hdreplay.baselines.exgrpo`).

:class:`ExperienceMixer` wraps TRL's own ``_generate_and_score_completions`` (called once, unchanged):

1. before generation, the last ``n_exp`` prompt blocks of the dataloader's batch (n rows each, TRL's layout) are
   replaced by the experience prompts the controller planned (their stored dataset rows; ExGRPO keeps the batch at
   B prompts and drops that many dataloader prompts);
2. TRL generates and scores n responses for every prompt;
3. for each experience prompt, the stored trajectories are re-scored under the current policy (one no-grad forward
   with entropies, counted as re-scored rows) and the one of lowest mean entropy overwrites the first row of its
   block (ids, loss mask, reward = its stored reward, generation log-probs = its stored pi_gen); that group's
   advantages are recomputed with TRL's own formula (``scale_rewards`` "group" or "none");
4. the batch carries ``hdr_off`` (N,) marking the injected rows and ``hdr_off_logps`` (N, C) their stored log-probs;
   the trainer trains those rows with :func:`shaped_loss` as a chunk of their own (on-policy rows: TRL's loss).

Deviations from the released code: TRL generates n responses for an experience prompt and one is overwritten (ExGRPO
generates n - 1), so the wasted response is counted as generated; the entropy is the mean over the trajectory's
response tokens at the sampling temperature (the code's mask selects pad positions).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ....baselines.exgrpo import ExgrpoController, mean_entropies, shaped_token_loss
from ....baselines.repo import key_of
from ..batch import ROW_KEYS, _pad_to, take_rows

#: per-row keys the mixer knows how to fill for an injected row
_FILLED = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
           "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask"}


def group_advantages(rewards: torch.Tensor, n: int, scale_rewards: str) -> torch.Tensor:
    """(N,) TRL 1.16's group advantages of (N,) rewards (``scale_rewards`` "group": (r - mean) / (std + 1e-4),
    unbiased std; "none": r - mean)."""
    r = rewards.float().view(-1, n)
    adv = r - r.mean(1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (r.std(1, keepdim=True) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"exgrpo: scale_rewards={scale_rewards!r} is not supported; use 'group' or 'none'")
    return adv.view(-1)


class ExperienceMixer:
    """Substitute experience prompts, generate, inject one stored trajectory per experience group (see the module).

    Args:
        controller: the run's :class:`ExgrpoController`.  n: responses per group.  pad_token_id: the tokenizer's.
        entropies: ``(input_ids, attention_mask, logits_to_keep) -> (R, C)`` token entropies under the current
            policy (TRL's forward, no grad).
        scale_rewards: TRL's setting ("group" or "none").
    """

    def __init__(self, controller: ExgrpoController, *, n: int, pad_token_id: int,
                 entropies: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], scale_rewards: str) -> None:
        group_advantages(torch.zeros(n), n, scale_rewards)  # refuses an unsupported scale_rewards
        self.ctl, self.n, self.pad, self._entropies, self.scale = controller, n, pad_token_id, entropies, scale_rewards
        self.rewards: torch.Tensor | None = None  # (N,) rewards TRL computed in the round, set by the trainer
        self.batch_rewards: torch.Tensor | None = None  # (N,) rewards of the returned rows (injected ones included)
        self.metrics: dict[str, float] = {}

    def generate(self, inputs: list, generate_once: Callable[[list], dict], *, step: int) -> dict:
        """TRL's batch for ``inputs`` with the experience groups mixed in; the (N,) rewards of its rows are left in
        ``batch_rewards`` (``rewards``: what TRL computed in ``generate_once``, captured by the trainer)."""
        n = self.n
        if len(inputs) % n:
            raise RuntimeError(f"exgrpo: {len(inputs)} input rows do not form groups of {n}")
        B = len(inputs) // n
        keys = self.ctl.plan(B)
        first = B - len(keys)
        inputs = list(inputs)
        for j, key in enumerate(keys):
            inputs[(first + j) * n:(first + j + 1) * n] = [self.ctl.rows[key]] * n
        self.rewards = None
        out = generate_once(inputs)
        if self.rewards is None:
            raise RuntimeError("exgrpo: the rewards of this generation were not captured")
        r = self.batch_rewards = self.rewards.detach().clone()
        pids, pmask = out["prompt_ids"].cpu(), out["prompt_mask"].cpu()
        got = [key_of(pids[g * n][pmask[g * n].bool()]) for g in range(B)]
        for g in range(first):
            self.ctl.remember(got[g], inputs[g * n])
        N, dev = B * n, out["completion_ids"].device
        out["hdr_off"] = torch.zeros(N, dtype=torch.bool, device=dev)
        out["hdr_off_logps"] = torch.zeros(out["completion_ids"].shape, device=dev)
        if not keys:
            return out
        if got[first:] != keys:
            raise RuntimeError("exgrpo: a substituted prompt did not tokenize to its stored key (is the processing "
                               "class deterministic?)")
        unknown = sorted(k for k in out if k in ROW_KEYS and k not in _FILLED and not k.startswith("hdr_"))
        if unknown:
            raise RuntimeError(f"exgrpo cannot inject a stored row into batch key(s) {unknown}")
        picks, rescored = [], 0
        for key in keys:
            cands = self.ctl.candidates(key)
            rescored += len(cands)
            picks.append(cands[self.ctl.pick(self._candidate_entropies(cands).tolist())])
        width = max(out["completion_ids"].shape[1], *(p.completion_ids.numel() for p in picks))
        for k, v in list(out.items()):
            side = ROW_KEYS.get(k, (None, None))[0] if k != "hdr_off_logps" else "right"
            if side == "right" and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] > 1:
                fill = self.pad if k == "completion_ids" else (1 if k == "tool_mask" else 0)
                out[k] = _pad_to(v, width, "right", fill)
        for j, rec in enumerate(picks):
            row, L = (first + j) * n, rec.completion_ids.numel()
            out["completion_ids"][row] = self.pad
            out["completion_ids"][row, :L] = rec.completion_ids.to(dev)
            out["completion_mask"][row] = 0
            out["completion_mask"][row, :L] = rec.loss_mask.to(out["completion_mask"].dtype).to(dev)
            out["hdr_off_logps"][row] = 0.0
            out["hdr_off_logps"][row, :L] = rec.logprobs.float().to(dev)
            for k in ("old_per_token_logps", "sampling_per_token_logps"):
                if k in out:
                    out[k][row] = 0.0
                    out[k][row, :L] = rec.logprobs.to(out[k].dtype).to(dev)
            if "importance_sampling_ratio" in out:
                out["importance_sampling_ratio"][row] = 1.0
            if "tool_mask" in out:
                out["tool_mask"][row] = 1
            out["hdr_off"][row] = True
            r[row] = rec.rewards[0].to(r.dtype)
        adv = group_advantages(r[first * n:], n, self.scale)  # the mixed groups only: the rest are TRL's own
        out["advantages"][first * n:] = adv.to(out["advantages"].dtype).to(dev)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        out["num_items_in_batch"] = mask.sum().to(out["num_items_in_batch"].dtype)
        self.ctl.note_injected(len(picks), rescored)
        return out

    def _candidate_entropies(self, cands) -> torch.Tensor:
        """(m,) mean token entropy of each stored trajectory of one prompt under the current policy."""
        P = cands[0].prompt_ids.numel()
        C = max(c.completion_ids.numel() for c in cands)
        ids = torch.full((len(cands), P + C), self.pad, dtype=torch.long)
        att = torch.zeros(len(cands), P + C, dtype=torch.long)
        lmask = torch.zeros(len(cands), C)
        for i, c in enumerate(cands):
            L = c.completion_ids.numel()
            ids[i, :P], ids[i, P:P + L] = c.prompt_ids, c.completion_ids
            att[i, :P + L] = 1
            lmask[i, :L] = c.loss_mask.float()
        ent = self._entropies(ids, att, C).float().cpu()
        return mean_entropies(ent, lmask)


def shaped_loss(per_token_logps: torch.Tensor, part: dict[str, Any], *, gamma: float, loss_type: str,
                max_completion_length: int, grad_accum: int, processes: int, spg: int) -> torch.Tensor:
    """ExGRPO's off-policy term on ``part`` (injected rows), aggregated as TRL 1.16 aggregates ``loss_type`` so that
    :func:`.microstep.chunk_scales` combines it with the on-policy rows' TRL loss exactly."""
    mask = part["completion_mask"] * part["tool_mask"] if "tool_mask" in part else part["completion_mask"]
    mask = mask.to(per_token_logps.dtype)
    tok = shaped_token_loss(per_token_logps, part["hdr_shaped_logps"], part["advantages"], gamma) * mask
    if loss_type == "grpo":
        return (tok.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / grad_accum
    if loss_type == "bnpo":
        return tok.sum() / mask.sum().clamp(min=1.0) / grad_accum
    if loss_type == "dr_grpo":
        return tok.sum() / (tok.size(0) * max_completion_length) / grad_accum
    if loss_type == "dapo":
        return tok.sum() / (part["num_items_in_batch"].clamp(min=1.0) / processes * grad_accum / spg)
    raise ValueError(f"exgrpo: loss_type={loss_type!r} is not supported; use grpo, bnpo, dr_grpo or dapo")


#: loss types :func:`shaped_loss` aggregates as TRL does
SHAPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def split_off(part: dict) -> tuple[dict, dict | None]:
    """A fresh micro-batch as (its on-policy rows, its injected rows with ``hdr_shaped_logps`` or None); the
    ``hdr_off*`` keys are removed from both."""
    part = dict(part)
    off, off_logps = part.pop("hdr_off", None), part.pop("hdr_off_logps", None)
    if off is None or not bool(off.any()):
        return part, None
    on_rows, off_rows = (~off).nonzero().flatten(), off.nonzero().flatten()
    on, shaped = take_rows(part, on_rows), take_rows(part, off_rows)
    shaped["hdr_shaped_logps"] = off_logps[off_rows]  # (keeps hdr_row: only a fresh part's forward is captured)
    return on, shaped


def token_entropies(trainer, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
    """(R, C) token entropies of rows under ``trainer``'s current policy (TRL's forward, no grad; ExGRPO's pick)."""
    from trl.models.utils import disable_gradient_checkpointing

    dev = trainer.accelerator.device
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        _, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids.to(dev), attention_mask.to(dev), logits_to_keep,
            batch_size=trainer._score_batch_size, compute_entropy=True)
    return ent


def shaped_part_loss(trainer, model, part: dict, *, gamma: float) -> torch.Tensor:
    """:func:`shaped_loss` of an injected-rows part, its current log-probs from TRL's forward (with grad)."""
    ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
    mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, part["completion_ids"].shape[1])
    a = trainer.args
    return shaped_loss(logps, part, gamma=gamma, loss_type=trainer.loss_type,
                       max_completion_length=a.max_completion_length, processes=trainer.accelerator.num_processes,
                       grad_accum=trainer.current_gradient_accumulation_steps, spg=a.steps_per_generation)


def check_exgrpo(trainer, args) -> None:
    """Refuse ``replay_exgrpo`` settings its injected rows cannot honour (each message names the setting and the
    fix)."""
    bad = []
    if trainer.accelerator.num_processes > 1:
        bad.append(f"{trainer.accelerator.num_processes} processes (launch one)")
    if trainer._is_vlm:
        bad.append("a vision-language model (text only)")
    if trainer.loss_type not in SHAPED_LOSS_TYPES:
        bad.append(f"loss_type={trainer.loss_type!r} (use one of {', '.join(SHAPED_LOSS_TYPES)})")
    if args.replay_micro_step != "chunk":
        bad.append("replay_micro_step='grow' (use 'chunk')")
    if trainer.beta != 0.0:
        bad.append(f"beta={trainer.beta} (use 0: stored rows carry no reference log-probs)")
    if trainer._entropy_bonus_enabled or trainer.top_entropy_quantile < 1.0 or trainer.off_policy_mask_threshold:
        bad.append("an entropy bonus, top_entropy_quantile < 1 or off_policy_mask_threshold (the shaped term has none)")
    if trainer.scale_rewards not in ("group", "none"):
        bad.append(f"scale_rewards={trainer.scale_rewards!r} (use 'group' or 'none')")
    if getattr(trainer, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        bad.append("multi_objective_aggregation other than 'sum_then_normalize'")
    if bad:
        raise ValueError("replay_exgrpo (ExGRPO's mixed-policy groups) cannot run with " + "; ".join(bad))
