"""POPO (arXiv 2606.01281, "RLVR without Ineffective Samples: Group Prioritized Off-Policy Optimization"; no public
code): a fresh group whose rewards are all equal (zero variance: no GRPO gradient) is swapped for a buffered
effective group, and the swapped-in groups are trained with decoupled importance sampling.

The rules as implemented here.  The stored copy of the paper's page holds only its abstract and introduction; the
method is read from those and from the authors' own summary (QbitAI, 2026-07-05: the rules, the FIFO buffer and the
ablations POPO-stale / POPO-pi_old / POPO-KL).  What neither states is marked *assumption*:

* **quality** -- only effective groups (rewards not all equal) enter the buffer, after the update that trained
  them (:func:`is_effective`); the buffer is a FIFO of ``capacity`` groups;
* **recency / off-policiness** -- the k swapped-in groups are the k most recently stored ones (newest first; the
  FIFO's recency stands for the distance to the current policy), k = the number of ineffective fresh groups of the
  step, at most what the buffer holds (:meth:`PopoController.plan`); a replayed group stays in the buffer
  (*assumption*: the sources say "take the most recent", not whether a group is removed);
* **decoupled importance sampling** -- a replayed token's loss is the PPO clip around the proximal policy
  pi_prox (the policy before this update: its log-probs are computed at selection, through the trainer's scorer)
  times the behaviour correction w = pi_prox / pi_behav, pi_behav the stored generation log-prob, truncated at
  ``is_cap`` (*assumption*: 2.0, verl's default rollout-IS threshold; the sources give no value):
  ``-w min(r A, clip(r, 1 - eps, 1 + eps) A)``, r = pi_theta / pi_prox (:func:`decoupled_weights`).

The selection hands out copies of the chosen groups whose ``logprobs`` are pi_prox (the ratio denominator) and
whose extra ``token_weight`` is w; a trainer multiplies a replayed row's advantage by it per token (TRL:
:func:`hdreplay.integrations.trl.batch.replay_rows`).  The generation side (which fresh groups are swapped out) is
``integrations/trl/peers/popo.py``; the checkpoint goes through the validating store path of :mod:`.store`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError
from ..rescore import WalkCost
from ..scores import check_scorer_output
from ..selectors import Selection, empty_selection
from ..store.record import GroupRecord
from ..validate import check_int, check_step, is_real
from . import store as kit

FORMAT = "hdreplay.popo"
#: the extra of a replayed copy holding the per-token behaviour correction w (read by the trainers)
TOKEN_WEIGHT = "token_weight"


@dataclass(frozen=True)
class PopoOptions:
    """POPO's settings: ``capacity`` effective groups kept (FIFO), ``is_cap`` the truncation of
    w = pi_prox / pi_behav."""

    capacity: int = 64
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if type(self.capacity) is not int or self.capacity < 1:
            raise ReplayConfigError(f"popo.capacity: an int >= 1 (groups), got {self.capacity!r}", field="capacity")
        if not (is_real(self.is_cap) and math.isfinite(self.is_cap) and self.is_cap > 0):
            raise ReplayConfigError(f"popo.is_cap: a finite number > 0, got {self.is_cap!r}", field="is_cap")


def is_effective(group: GroupRecord) -> bool:
    """A group with a learning signal: its rewards are not all equal (non-zero variance)."""
    return bool(group.rewards.max() > group.rewards.min())


def decoupled_weights(prox: torch.Tensor, behav: torch.Tensor, cap: float) -> torch.Tensor:
    """(T,) w = min(pi_prox / pi_behav, cap) from the two policies' (T,) log-probs (no gradient).

    >>> decoupled_weights(torch.tensor([-1.0, -0.5, -0.1]), torch.tensor([-1.0, -1.0, -2.0]), 2.0).tolist()
    [1.0, 1.6487212181091309, 2.0]
    """
    if not (isinstance(prox, torch.Tensor) and isinstance(behav, torch.Tensor) and prox.dim() == 1
            and prox.shape == behav.shape):
        raise ReplayInputError(f"decoupled_weights: prox and behav must be (T,) tensors of one shape, got "
                               f"{getattr(prox, 'shape', type(prox).__name__)} and "
                               f"{getattr(behav, 'shape', type(behav).__name__)}")
    return torch.exp(prox.detach().float() - behav.detach().float()).clamp(max=float(cap))


class PopoController(kit.StoredState):
    """POPO's buffer and selection, with the protocol every trainer calls (:class:`~.protocol.Strategy`: select ->
    stage -> commit once per optimizer update).

    Per step the generation side calls :meth:`plan` with the number of ineffective fresh groups; :meth:`select`
    returns that many of the newest stored groups (at most what is stored), re-scored under the current policy;
    :meth:`commit` stores the step's effective fresh groups and evicts the oldest beyond ``capacity``.

    >>> def group(gid, step, rewards):
    ...     return GroupRecord.from_responses(group_id=gid, prompt_ids=[5], completion_ids=[[1], [2]],
    ...                                       logprobs=[[-0.5], [-1.0]], advantages=[1.0, -1.0], rewards=rewards,
    ...                                       birth_step=step)
    >>> ctl = PopoController(PopoOptions(capacity=2))
    >>> _ = ctl.select(step=0); ctl.stage([group("a", 0, [1, 0]), group("b", 0, [1, 1])], step=0); _ = ctl.commit()
    >>> _ = ctl.select(step=1); ctl.stage([group("c", 1, [0, 1]), group("d", 1, [0, 1])], step=1); _ = ctl.commit()
    >>> [g.group_id for g in ctl.store], ctl.plan(ineffective=3)  # "b" had no signal; "a" was evicted
    (['c', 'd'], 2)
    >>> sel = ctl.select(step=2, scorer=lambda gs: [g.logprobs + 0.25 for g in gs])  # pi_prox = pi_behav x e^0.25
    >>> [g.group_id for g in sel.groups], [round(v, 4) for v in sel.groups[0].extras["token_weight"].tolist()]
    (['d', 'c'], [1.284, 1.284])
    """

    FORMAT = FORMAT

    def __init__(self, options: PopoOptions) -> None:
        self.options = kit.check_options("popo", options, PopoOptions)
        self.store: list[GroupRecord] = []  # effective groups, oldest first
        self.last_step: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._budget, self._ineffective, self._step = 0, 0, None
        self._staged: list[GroupRecord] = []
        self._selection: Selection | None = None

    def __len__(self) -> int:
        return len(self.store)

    # ---------------------------------------------------------------- the generation side
    def plan(self, *, ineffective: int, most: int | None = None) -> int:
        """This step's number of ``ineffective`` fresh groups; returns how many are swapped: min(ineffective, stored,
        ``most``)."""
        self._ineffective = check_int("plan: ineffective", ineffective)
        most = self._ineffective if most is None else check_int("plan: most", most)
        self._budget = min(self._ineffective, len(self.store), most)
        return self._budget

    # ---------------------------------------------------------------- the trainer protocol
    def select(self, *, step: int, scorer=None) -> Selection:
        """The planned number of newest stored groups, as copies carrying pi_prox (``logprobs``) and the truncated
        behaviour correction (extra ``token_weight``); ``scorer`` gives the current policy's log-probs of stored
        groups (see :data:`hdreplay.selection.Scorer`)."""
        step = check_step("select: step", step)
        if self.last_step is not None and step <= self.last_step:
            raise ReplayProtocolError(f"select(step={step}): step {self.last_step} is already committed")
        chosen = self.store[::-1][:self._budget]
        sel = empty_selection(step, "popo", len(self.store), float("nan"))
        if chosen:
            if scorer is None or not callable(scorer):
                raise ReplayInputError("popo select: pass a scorer (the current policy's log-probs of stored groups: "
                                       "the proximal policy of the decoupled loss)")
            prox = check_scorer_output(chosen, scorer(chosen))
            copies = [dataclasses.replace(g, logprobs=p, extras={
                **g.extras, TOKEN_WEIGHT: decoupled_weights(p, g.logprobs, self.options.is_cap)})
                for g, p in zip(chosen, prox)]
            cost = WalkCost(1, [len(chosen)], sum(g.num_responses for g in chosen), sum(g.num_tokens for g in chosen),
                            0, 0, len(chosen))
            sel = dataclasses.replace(sel, accepted=np.arange(len(copies), dtype=np.int64), groups=copies, cost=cost)
        self._selection = sel
        return sel

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> None:
        step = check_step("stage: step", step)
        groups = kit.check_groups("popo stage", groups)
        if self.last_step is not None and step <= self.last_step:
            raise ReplayProtocolError(f"stage(step={step}) after step {self.last_step}; steps must increase")
        if self._selection is not None and step != self._selection.step:
            raise ReplayProtocolError(f"stage(step={step}) while step {self._selection.step} is open; commit() first")
        born = [g.group_id for g in groups if g.birth_step != step]
        if born:
            raise ReplayInputError(f"popo stage: group {born[0]!r} was not born at step {step}; stage fresh groups")
        self._staged.extend(groups)
        self._step = step

    def commit(self, *, num_fresh_groups: int | None = None, counters: Mapping[str, Any] | None = None
               ) -> dict[str, float]:
        """Store the staged effective groups (after this step's selection: never replayed in their own step) and
        evict the oldest beyond ``capacity``; returns the step's metrics."""
        kit.check_commit(num_fresh_groups, counters)
        sel = self._selection
        groups = sel.groups if sel is not None else []
        weights = torch.cat([g.extras[TOKEN_WEIGHT][g.loss_mask] for g in groups]) if groups else torch.zeros(0)
        new = [g.clone() for g in self._staged if is_effective(g)]
        self.store.extend(new)
        evicted = max(0, len(self.store) - self.options.capacity)
        del self.store[:evicted]
        step = sel.step if sel is not None else self._step
        if step is not None:
            self.last_step = step
        ages = [step - g.birth_step for g in groups] if groups else []
        out = {"replay/replayed_rows": float(sum(g.num_responses for g in groups)),
               "replay/accepted": float(len(groups)),
               "replay/rescored_rows": float(sel.rescored_rows if sel is not None else 0),
               "replay/buffer_size": float(len(self.store)), "popo/ineffective": float(self._ineffective),
               "popo/swapped": float(len(groups)), "popo/stored": float(len(new)), "popo/evicted": float(evicted),
               "popo/mean_age": float(np.mean(ages)) if ages else float("nan"),
               "popo/is_weight_mean": float(weights.mean()) if weights.numel() else float("nan"),
               "popo/is_capped": float((weights >= self.options.is_cap).float().mean()) if weights.numel()
               else float("nan")}
        self._reset()
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, records = kit.pack(self.store, "store")
        return tensors, {"options": asdict(self.options), "records": records, "last_step": self.last_step}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, every field checked first (a refused load changes nothing): groups born
        after ``last_step``, out of FIFO (birth) order, without a learning signal, or more than ``capacity``
        (saved with a larger one) are refused; other changed options are warned about."""
        where = "popo state"
        meta = kit.checked_meta(meta, ("options", "records", "last_step"), where)
        tensors = kit.only_tensors(tensors, "store", where)
        saved, changes = kit.options_changes(PopoOptions, meta["options"], self.options, where)
        last = kit.step_or_none(meta["last_step"], "last_step", where)
        store = kit.unpack(tensors, meta["records"], "store", where, last_step=last)
        if store and last is None:
            raise CheckpointError(f"{where}: groups are stored but last_step is None")
        if any(b.birth_step < a.birth_step for a, b in zip(store, store[1:])):
            raise CheckpointError(f"{where}: the stored groups are not in FIFO (birth step) order")
        if bad := [g.group_id for g in store if not is_effective(g)]:
            raise CheckpointError(f"{where}: stored groups {bad[:3]} have rewards that are all equal (POPO stores "
                                  "effective groups only)")
        if len(store) > self.options.capacity:
            raise kit.refuse_option(where, "capacity", saved.capacity, self.options.capacity,
                                f"{len(store)} groups are stored")
        self.store, self.last_step = store, last
        self._reset()
        kit.warn_changes("popo", changes)

