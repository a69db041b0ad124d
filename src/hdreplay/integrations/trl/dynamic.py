"""DAPO's dynamic sampling (arXiv 2503.14476; verl ``recipe/dapo``) at TRL's generation seam.

verl's DAPO trainer keeps, from each generation batch, the groups whose rewards are not all equal
(``filter_groups``, metric acc: std > 0) and generates further batches until ``train_batch_size`` groups are kept
or ``max_num_gen_batches`` batches were generated; the kept groups beyond the batch are dropped.  TRL has no such
option; :class:`DynamicSampler` adds it around TRL's own ``_generate_and_score_completions`` (called unchanged for
every round, so generation, rewards and advantages are TRL's):

1. round 1 generates the dataloader's batch of B prompts x n;
2. a group (n consecutive rows) is kept iff its rewards are not all equal (advantages are then per group, as TRL
   computed them -- the same as after filtering, since GRPO's advantages are group-local);
3. rounds 2.. generate B further prompts each, taken from a seeded pass over the training set (repeated n times,
   the layout of TRL's sampler), until B groups are kept or ``max_batches`` rounds ran;
4. the batch is the first B kept groups in generation order.  At the round limit with fewer kept (verl raises),
   the batch is completed with the latest zero-variance groups -- zero advantage, so no policy gradient -- and the
   shortfall is counted.

Counters per step (logged as ``dynamic/*``): rounds, fresh responses generated, groups dropped, groups filled.
Single process only (the filter needs every rank's rewards), replay off (the sandbox's ``dapo_dynamic`` is
on-policy).  Deviations from verl: rounds of B instead of ``gen_prompt_bsz = 3B`` prompts; the extra prompts come
from their own seeded pass over the training set instead of the dataloader's next batches; that pass restarts on
resume.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .batch import check_keys, concat_rows, recount_items, take_rows


class DynamicSampler:
    """Over-generate and drop zero-variance groups until the batch is full.

    Args:
        dataset: the training dataset (``len`` and integer indexing giving TRL input dicts).
        n: responses per group.  max_batches: generation rounds per batch at most (verl ``max_num_gen_batches``).
        seed: seed of the extra-prompt pass.  pad_token_id: the tokenizer's pad id.
    """

    def __init__(self, dataset, *, n: int, max_batches: int, seed: int, pad_token_id: int) -> None:
        self.dataset, self.n, self.max_batches, self.pad_token_id = dataset, n, max_batches, pad_token_id
        self._gen = torch.Generator().manual_seed(seed)
        self._order: list[int] = []
        self.rewards: torch.Tensor | None = None  # (N,) total rewards of the latest round, set by the trainer
        self.last: dict[str, float] = {}

    def _next_prompts(self, groups: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(groups):
            if not self._order:
                self._order = torch.randperm(len(self.dataset), generator=self._gen).tolist()
            row = self.dataset[self._order.pop()]
            out += [row] * self.n
        return out

    def generate(self, inputs: list, generate_once: Callable[[list], dict]) -> dict:
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
            r = self.rewards.detach().float().cpu().view(-1, n)
            mixed = (r.amax(1) - r.amin(1)) > 0
            for g in range(B):
                (kept if bool(mixed[g]) else spare).append(take_rows(out, slice(g * n, (g + 1) * n)))
            if len(kept) >= B or rounds >= self.max_batches:
                break
            batch = self._next_prompts(B)
        short = max(0, B - len(kept))
        parts = kept[:B] + (spare[len(spare) - short:] if short else [])
        result = recount_items(concat_rows(parts, pad_token_id=self.pad_token_id), out["num_items_in_batch"].dtype)
        self.last = {"dynamic/rounds": float(rounds), "dynamic/generated_rows": float(rounds * B * n),
                     "dynamic/dropped_groups": float(rounds * B - B), "dynamic/filled_zero_var": float(short)}
        return result
