"""POPO's group swap at TRL's generation seam (the rules: :mod:`hdreplay.baselines.popo`).

:class:`PopoSampler` wraps TRL's own ``_generate_and_score_completions`` (called once, unchanged): of the dataloader's
B groups, those whose rewards are all equal (zero variance: no GRPO gradient) are the ineffective ones; as many of
them as the controller can swap (:meth:`~hdreplay.baselines.popo.PopoController.plan`: at most what it stores,
and at most B - 1 so that a fresh row remains) leave the trained batch, first ones first.  The trainer's replay path
then selects that many of the newest stored groups -- re-scored under the current policy, which gives the proximal
log-probs -- and appends their rows like every selector's replay rows, with ``old_per_token_logps`` = pi_prox and
the advantages multiplied per token by the truncated decoupled weight pi_prox / pi_behav
(:func:`.batch.replay_rows`).  TRL's clipped objective is positively homogeneous in the advantage, so this is
``-w min(r A, clip(r) A)`` exactly for the clip losses, cispo and sapo; one process, text only, micro_step chunk,
one generation per optimizer update (:func:`check_popo`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ....baselines.popo import PopoController
from ..batch import check_keys, concat_rows, recount_items, take_rows

#: TRL loss types whose per-token term is positively homogeneous in the advantage (a weight on A weights the term)
POPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


def check_popo(args, *, processes: int, vlm: bool, loss_type: str) -> None:
    """Refuse a ``replay_popo`` run the swap cannot honour (ValueError naming the setting and the fix)."""
    bad = []
    if processes > 1:
        bad.append(f"{processes} processes (the swap needs every rank's rewards: launch one)")
    if vlm:
        bad.append("a vision-language model (text only)")
    if args.replay_micro_step != "chunk":
        bad.append("replay_micro_step='grow' (replayed rows carry per-token advantages: use 'chunk')")
    if loss_type not in POPO_LOSS_TYPES:
        bad.append(f"loss_type={loss_type!r} (the decoupled weight scales the advantage: use one of "
                   f"{', '.join(POPO_LOSS_TYPES)})")
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        bad.append("one batch per optimizer update needs num_iterations=1 and steps_per_generation = "
                   f"gradient_accumulation_steps (got {args.num_iterations}, {args.steps_per_generation}, "
                   f"{args.gradient_accumulation_steps})")
    elif args.num_generations % args.steps_per_generation:
        bad.append(f"num_generations={args.num_generations} not a multiple of steps_per_generation="
                   f"{args.steps_per_generation} (the batch's rows split evenly)")
    if bad:
        raise ValueError("replay_popo (POPO's group swap) cannot run with " + "; ".join(bad))


class PopoSampler:
    """Drop the swapped ineffective groups of one step's batch and plan the swap (see the module).

    Args:
        controller: the run's :class:`PopoController`.  n: responses per group.  pad_token_id: the tokenizer's.
    """

    def __init__(self, controller: PopoController, *, n: int, pad_token_id: int) -> None:
        self.controller, self.n, self.pad_token_id = controller, n, pad_token_id
        self.rewards: torch.Tensor | None = None  # (N,) total rewards of the round, set by the trainer
        self.batch_rewards: torch.Tensor | None = None  # (rows,) rewards of the returned batch
        self.metrics: dict[str, float] = {}

    def generate(self, inputs: list, generate_once: Callable[[list], dict], *, step: int) -> dict:
        """The batch for ``inputs`` (B prompts x n rows, TRL's layout) without the groups the replay will replace."""
        n = self.n
        if len(inputs) % n:
            raise RuntimeError(f"popo: {len(inputs)} input rows do not form groups of {n}")
        B = len(inputs) // n
        self.rewards = None
        out = generate_once(inputs)
        check_keys(out)
        if self.rewards is None or self.rewards.numel() != len(inputs):
            raise RuntimeError("popo: the rewards of this generation were not captured")
        r = self.rewards.detach().float().cpu().view(B, n)
        ineffective = [g for g in range(B) if float(r[g].max()) == float(r[g].min())]
        swap = set(ineffective[:self.controller.plan(ineffective=len(ineffective), most=B - 1)])
        keep = [g for g in range(B) if g not in swap]
        self.batch_rewards = r[keep].reshape(-1)
        if not swap:
            return out
        parts = [take_rows(out, slice(g * n, (g + 1) * n)) for g in keep]
        return recount_items(concat_rows(parts, pad_token_id=self.pad_token_id), out["num_items_in_batch"].dtype)
