"""DAPO's dynamic sampling at TRL's generation seam (the rule: :mod:`hdreplay.baselines.dapo`).

:class:`DynamicSampler` wraps TRL's own ``_generate_and_score_completions`` (called unchanged for every round, so
generation, rewards and advantages are TRL's): round 1 generates the dataloader's batch of B prompts x n, rounds
2.. generate B further prompts each (the rule's seeded pass over the training set, repeated n times: the layout of
TRL's sampler) until B groups with mixed rewards are kept; advantages are per group, as TRL computed them (the same
as after filtering, since GRPO's advantages are group-local).  Counters per step (logged as ``dynamic/*``): rounds,
fresh responses generated, groups dropped, groups filled.  Single process only (the filter needs every rank's
rewards), replay off (the sandbox's ``dapo_dynamic`` is on-policy).
"""

from __future__ import annotations

from typing import Callable

import torch

from ....baselines.dapo import DynamicSampling
from ..batch import check_keys, concat_rows, recount_items, take_rows


class DynamicSampler:
    """Over-generate and drop zero-variance groups until the batch is full (a generation wrapper of
    :class:`~.strategies.StrategySeam`).

    Args:
        dataset: the training dataset (``len`` and integer indexing giving TRL input dicts).
        n: responses per group.  max_batches: generation rounds per batch at most (verl ``max_num_gen_batches``).
        seed: seed of the extra-prompt pass.  pad_token_id: the tokenizer's pad id.
    """

    def __init__(self, dataset, *, n: int, max_batches: int, seed: int, pad_token_id: int) -> None:
        self.dataset, self.n, self.pad_token_id = dataset, n, pad_token_id
        self.rule = DynamicSampling(len(dataset), n=n, max_batches=max_batches, seed=seed)
        self.rewards: torch.Tensor | None = None  # (N,) total rewards of the latest round, set by the trainer
        self.batch_rewards: torch.Tensor | None = None  # (rows,) rewards of the returned batch
        self.metrics: dict[str, float] = {}

    def generate(self, inputs: list, generate_once: Callable[[list], dict], *, step: int) -> dict:
        """The batch TRL would return for ``inputs``, made of groups with mixed rewards (see the module)."""
        n = self.n
        if len(inputs) % n:
            raise RuntimeError(f"dynamic sampling: {len(inputs)} input rows do not form groups of {n}")
        B = len(inputs) // n
        kept, spare, rounds, batch = [], [], 0, inputs
        while True:
            rounds += 1
            self.rewards = None
            out = generate_once(batch)
            check_keys(out)
            if self.rewards is None or self.rewards.numel() != len(batch):
                raise RuntimeError("dynamic sampling: the rewards of this generation round were not captured")
            r = self.rewards.detach().float().cpu()
            mixed = self.rule.mixed(r)
            for g in range(B):
                part = (take_rows(out, slice(g * n, (g + 1) * n)), r[g * n:(g + 1) * n])
                (kept if bool(mixed[g]) else spare).append(part)
            if self.rule.done(len(kept), B, rounds):
                break
            batch = [self.dataset[i] for i in self.rule.extra_prompts(B) for _ in range(n)]
        parts, short = self.rule.compose(kept, spare, B)
        result = recount_items(concat_rows([p for p, _ in parts], pad_token_id=self.pad_token_id),
                               out["num_items_in_batch"].dtype)
        self.batch_rewards = torch.cat([r for _, r in parts])
        self.metrics = self.rule.counters(rounds=rounds, groups=B, short=short)
        return result
