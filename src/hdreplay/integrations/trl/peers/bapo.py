"""BAPO's batch construction (arXiv 2602.20722; ``RayBAPOTrainer.fit`` of waunx/BAPO_ICLR) at TRL's generation seam.

:class:`BapoSampler` wraps TRL's own ``_generate_and_score_completions`` (called unchanged for every round, so
generation, rewards and advantages are TRL's) and builds the batch of B groups as BAPO does:

1. the dataloader's B prompts x n are generated; a group is kept iff its mean reward lies in ``train_range``
   (if none is, BAPO's fallback: the whole unfiltered batch is trained); every fresh group -- kept or dropped --
   goes to the controller for ingress after the update;
2. every ``reeval_every`` steps (BAPO's 1-based step numbers divisible by it: steps 1, 3, 5, ... here), up to
   ``max_reeval`` difficult stored prompts (their stored input rows x n) are regenerated through the same call
   under the current policy; their rewards update the stored scores;
   the promoted groups (:func:`~hdreplay.baselines.bapo.promoted`) join the batch as fresh on-policy rows, a
   seeded subset of whole groups when more are promoted than the batch has room for (BAPO takes a row subset);
3. the controller's replay budget is set to B - kept - promoted groups; the trainer's replay path then appends
   that many stored target groups (:meth:`~hdreplay.baselines.bapo.BapoController.select`) with their stored
   generation log-probs, like every other selector's replay rows.

Counters (logged with the step's ``replay/*``): ``dynamic/generated_rows`` (every generated response, re-evaluation
included: the sandbox's fresh-response cost), ``bapo/reeval_prompts``, ``bapo/promoted``, ``bapo/promoted_kept``,
``bapo/dropped_fresh``, ``bapo/fallback``, ``bapo/replay_budget``.  One process, text only, one generation per
optimizer update (:func:`check_bapo`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ....baselines.bapo import BapoController, Fresh, in_range
from ..batch import check_keys, concat_rows, recount_items, take_rows


def check_bapo(args, *, processes: int, vlm: bool) -> None:
    """Refuse a ``replay_bapo`` run the sampler cannot honour (ValueError naming the setting and the fix)."""
    if processes > 1:
        raise ValueError(f"replay_bapo runs on one process only (the batch filter and re-evaluation need every rank's "
                         f"rewards); got {processes} processes: launch one process or unset replay_bapo")
    if vlm:
        raise ValueError("replay_bapo is text only (its prompt store regenerates prompts from JSON rows); got a "
                         "vision-language model: unset replay_bapo")
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        raise ValueError("replay_bapo builds one batch per optimizer update: set num_iterations=1 and "
                         "steps_per_generation = gradient_accumulation_steps (got "
                         f"{args.num_iterations}, {args.steps_per_generation}, {args.gradient_accumulation_steps})")
    if args.num_generations % args.steps_per_generation:
        raise ValueError(f"replay_bapo: num_generations={args.num_generations} must be a multiple of "
                         f"steps_per_generation={args.steps_per_generation} (the batch's rows split evenly)")


class BapoSampler:
    """Filter, re-evaluate, and plan the replay fill of one step's batch (see the module).

    Args:
        controller: the run's :class:`BapoController`.  n: responses per group.  pad_token_id: the tokenizer's.
    """

    def __init__(self, controller: BapoController, *, n: int, pad_token_id: int) -> None:
        self.controller, self.n, self.pad_token_id = controller, n, pad_token_id
        self.rewards: torch.Tensor | None = None  # (N,) total rewards of the latest round, set by the trainer
        self.batch_rewards: torch.Tensor | None = None  # (rows,) rewards of the returned batch
        self.metrics: dict[str, float] = {}  # (its counters reach the log through the controller's commit)

    def _round(self, rows: list, generate_once: Callable[[list], dict]) -> tuple[dict, torch.Tensor]:
        self.rewards = None
        out = generate_once(rows)
        check_keys(out)
        if self.rewards is None or self.rewards.numel() != len(rows):
            raise RuntimeError("bapo: the rewards of this generation round were not captured")
        return out, self.rewards.detach().float().cpu().view(-1, self.n)

    def _group(self, out: dict, g: int) -> dict:
        return take_rows(out, slice(g * self.n, (g + 1) * self.n))

    def generate(self, inputs: list, generate_once: Callable[[list], dict], *, step: int) -> dict:
        """The batch for ``inputs`` (B prompts x n rows, TRL's layout): kept fresh groups, then promoted groups."""
        n, ctl, o = self.n, self.controller, self.controller.options
        if len(inputs) % n:
            raise RuntimeError(f"bapo: {len(inputs)} input rows do not form groups of {n}")
        B = len(inputs) // n
        out, r = self._round(inputs, generate_once)
        keep = [g for g in range(B) if in_range(float(r[g].mean()), o.train_range)]
        fallback = not keep
        if fallback:  # BAPO: "No samples in range filter, returning original batch"
            keep = list(range(B))
        pos = {g: i for i, g in enumerate(keep)}
        fresh = [Fresh(f"s{step}.{g}", inputs[g * n], r[g].tolist(), pos.get(g)) for g in range(B)]
        parts, rewards = [self._group(out, g) for g in keep], [r[g] for g in keep]
        cands = ctl.reeval_candidates(step)
        up = []
        if cands:
            out2, r2 = self._round([row for _, row in cands for _ in range(n)], generate_once)
            up = [j for j, (uid, _) in enumerate(cands) if ctl.record_reeval(uid, r2[j].tolist())]
            room = B - len(keep)
            take = up if len(up) <= room else sorted(ctl.pick(up, room))
            parts += [self._group(out2, j) for j in take]
            rewards += [r2[j] for j in take]
        else:
            take = []
        budget = B - len(keep) - len(take)
        ctl.plan(fresh, budget=budget, counters={
            "dynamic/generated_rows": float((B + len(cands)) * n), "bapo/reeval_prompts": float(len(cands)),
            "bapo/promoted": float(len(up)), "bapo/promoted_kept": float(len(take)),
            "bapo/dropped_fresh": float(B - len(keep)), "bapo/fallback": float(fallback),
            "bapo/replay_budget": float(budget)})
        self.batch_rewards = torch.cat(rewards)
        return recount_items(concat_rows(parts, pad_token_id=self.pad_token_id), out["num_items_in_batch"].dtype)
