"""DAPO's dynamic sampling (arXiv 2503.14476; verl ``recipe/dapo``): the rule, apart from any trainer.

verl's DAPO trainer keeps, from each generation batch, the groups whose rewards are not all equal
(``filter_groups``, metric acc: std > 0) and generates further batches until ``train_batch_size`` groups are kept
or ``max_num_gen_batches`` batches were generated; the kept groups beyond the batch are dropped.  Here, for a batch
of B groups of n:

1. round 1 is the dataloader's batch; a group is kept iff its rewards are not all equal (:meth:`mixed`);
2. rounds 2.. take B further prompts each from a seeded pass over the training set (:meth:`extra_prompts`: dataset
   indices, each prompt to be generated n times), until B groups are kept or ``max_batches`` rounds ran;
3. the batch is the first B kept groups in generation order; at the round limit with fewer kept (verl raises) it is
   completed with the latest zero-variance groups -- zero advantage, so no policy gradient -- and the shortfall is
   counted (:meth:`compose`).

The TRL integration (``integrations/trl/peers/dynamic.py``) runs TRL's own generation for each round and cuts the rows.
Deviations from verl: rounds of B instead of ``gen_prompt_bsz = 3B`` prompts; the extra prompts come from their own
seeded pass over the training set instead of the dataloader's next batches; that pass restarts on resume.

>>> rule = DynamicSampling(10, n=2, max_batches=3, seed=0)
>>> rule.mixed(torch.tensor([1.0, 0.0, 1.0, 1.0])).tolist()  # group 0 mixed, group 1 all equal
[True, False]
>>> rule.compose(kept=["k0"], spare=["z0", "z1"], groups=2)  # one short: the latest zero-variance group fills it
(['k0', 'z1'], 1)
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ReplayConfigError, ReplayInputError


class DynamicSampling:
    """The rule's state: the seeded pass that supplies extra prompts.

    Args:
        size: prompts in the training set.  n: responses per group.  max_batches: generation rounds per batch at
        most (verl ``max_num_gen_batches``).  seed: seed of the extra-prompt pass.
    """

    def __init__(self, size: int, *, n: int, max_batches: int, seed: int) -> None:
        for name, v, lo in (("size", size, 1), ("n", n, 1), ("max_batches", max_batches, 1), ("seed", seed, 0)):
            if type(v) is not int or v < lo:
                raise ReplayConfigError(f"dynamic sampling: {name} must be an int >= {lo}, got {v!r}", field=name)
        self.size, self.n, self.max_batches = size, n, max_batches
        self._gen = torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    def extra_prompts(self, groups: int) -> list[int]:
        """Dataset indices of the next ``groups`` prompts of the seeded pass (a new permutation when one runs out)."""
        out = []
        for _ in range(groups):
            if not self._order:
                self._order = torch.randperm(self.size, generator=self._gen).tolist()
            out.append(self._order.pop())
        return out

    def mixed(self, rewards: torch.Tensor) -> torch.Tensor:
        """(G,) bool: which groups of the (G * n,) rewards (groups of n consecutive rows) are not all equal."""
        if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.numel() % self.n:
            raise ReplayInputError(f"dynamic sampling: rewards must be a (G * n,) tensor with n={self.n}, got "
                                   f"{getattr(rewards, 'shape', type(rewards).__name__)}")
        r = rewards.detach().float().cpu().view(-1, self.n)
        return (r.amax(1) - r.amin(1)) > 0

    def done(self, kept: int, groups: int, rounds: int) -> bool:
        """Stop generating: ``groups`` are kept or ``max_batches`` rounds ran."""
        return kept >= groups or rounds >= self.max_batches

    @staticmethod
    def compose(kept: Sequence, spare: Sequence, groups: int) -> tuple[list, int]:
        """(the batch's groups, the shortfall filled with zero-variance groups): the first ``groups`` kept ones,
        completed by the latest ``spare`` (zero-variance) ones when fewer were kept."""
        short = max(0, groups - len(kept))
        return list(kept[:groups]) + (list(spare[len(spare) - short:]) if short else []), short

    def counters(self, *, rounds: int, groups: int, short: int) -> dict[str, float]:
        """The step's ``dynamic/*`` counters (rounds, fresh responses generated, groups dropped, groups filled)."""
        return {"dynamic/rounds": float(rounds), "dynamic/generated_rows": float(rounds * groups * self.n),
                "dynamic/dropped_groups": float(rounds * groups - groups), "dynamic/filled_zero_var": float(short)}
