"""RePO (arXiv 2506.09340; code SihengLi99/RePO @119fef6): per-prompt stores of past responses, retrieval for the
prompts of the current batch, split advantage normalisation, a separate off-policy loss term.

The rules as the released trainer implements them (``src/replay_grpo_trainer.py``):

* every fresh response enters its prompt's FIFO of ``max_cache`` responses after the step's retrieval, so a
  response is never replayed in the step it was born;
* a prompt of the current batch is augmented only when its store holds ``min_cache`` responses; then
  ``k = min(|store|, num_replays)`` are retrieved:

  ``recent``        the newest k (``recent_k``);
  ``highest``       the k highest rewards, ties to the older (Python's stable sort, ``highest_k``);
  ``max_variance``  the k-subset of largest population variance of rewards, ties to the larger sum, then to the
                    first subset in lexicographic order (``max_variance_k``: a loop over all C(m, k) subsets; for
                    0/1 rewards :func:`max_variance_subset` gives the same subset in closed form);

* the retrieved rows' advantages are normalised among themselves (``adv_norm_mode=split``):
  (r - mean) / (std + 1e-4) with the unbiased std, as the fresh rows within their group;
* loss = on-policy term + ``off_coef`` x off-policy term, each aggregated on its own rows (TRL's ``grpo``:
  the mean over rows of each row's token mean); the off-policy ratio's denominator is the stored pi_gen.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import CheckpointError, ReplayConfigError, ReplayInputError
from ..selectors import Selection, empty_selection
from ..store.record import GroupRecord
from ..validate import check_int, check_reals, check_step, check_str
from . import store as kit
from .rollouts import split_rollouts

FORMAT = "hdreplay.repo"
RETRIEVALS = ("recent", "highest", "max_variance")
#: RePO's normaliser epsilon (the same as TRL's)
ADV_EPS = 1e-4


@dataclass(frozen=True)
class RepoOptions:
    """RePO's settings (the released run's values: ``train_replay_grpo.slurm``)."""

    retrieval: str = "highest"
    num_replays: int = 8
    min_cache: int = 16
    max_cache: int = 16
    off_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.retrieval not in RETRIEVALS:
            raise ReplayConfigError(f"repo.retrieval: one of {list(RETRIEVALS)}, got {self.retrieval!r}",
                                    field="retrieval")
        for name in ("num_replays", "min_cache", "max_cache"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ReplayConfigError(f"repo.{name}: an int >= 1, got {v!r}", field=name)
        if self.min_cache > self.max_cache:
            raise ReplayConfigError(f"repo.min_cache={self.min_cache} exceeds max_cache={self.max_cache}: no prompt "
                                    "would ever be replayed", field="min_cache")
        if type(self.off_coef) not in (int, float) or not math.isfinite(self.off_coef) or self.off_coef < 0:
            raise ReplayConfigError(f"repo.off_coef: a finite number >= 0, got {self.off_coef!r}", field="off_coef")


def brute_force_max_variance(rewards: Sequence[float], k: int) -> tuple[int, ...]:
    """RePO's loop: the first k-subset (lexicographic) of largest population variance, ties to the larger sum."""
    r = [float(x) for x in rewards]
    best, best_var, best_sum = None, -math.inf, -math.inf
    for sub in itertools.combinations(range(len(r)), k):
        v = [r[j] for j in sub]
        m = sum(v) / k
        var, s = sum((x - m) ** 2 for x in v) / k, sum(v)
        if var > best_var or (var == best_var and s > best_sum):
            best, best_var, best_sum = sub, var, s
    return best


def _rewards(name: str, rewards: Any) -> np.ndarray:
    """(m,) finite float64 rewards (a list / tuple of numbers, a 1-D array or tensor); ReplayInputError otherwise."""
    if isinstance(rewards, torch.Tensor):
        rewards = rewards.detach().cpu().numpy()
    n = len(rewards) if isinstance(rewards, (list, tuple, np.ndarray)) and np.ndim(rewards) == 1 else -1
    return check_reals(name, rewards, n)


def max_variance_subset(rewards: Sequence[float], k: int) -> tuple[int, ...]:
    """The subset :func:`brute_force_max_variance` returns; closed form for 0/1 rewards (j ones with j(k-j) largest,
    then the larger j; the lexicographically first such subset takes the earliest indices of each kind), the loop
    otherwise."""
    r = _rewards("max_variance_subset: rewards", rewards)
    k = check_int("max_variance_subset: k", k, lo=1, hi=max(1, len(r)))
    if not np.isin(r, (0.0, 1.0)).all():
        return brute_force_max_variance(r.tolist(), k)
    ones, zeros = int(r.sum()), int((r == 0).sum())
    feasible = [j for j in range(k + 1) if j <= ones and k - j <= zeros]
    j = max(feasible, key=lambda x: (x * (k - x), x))
    need = {1.0: j, 0.0: k - j}
    out = []
    for i, x in enumerate(r.tolist()):
        if need[x] > 0:
            out.append(i)
            need[x] -= 1
    return tuple(out)


def retrieve(rewards: Sequence[float], rule: str, k: int) -> list[int]:
    """Positions (oldest first = 0) of the k stored responses ``rule`` replays."""
    rewards = _rewards("retrieve: rewards", rewards).tolist()
    rule = check_str("retrieve: rule", rule, RETRIEVALS, err=ReplayConfigError)
    m = len(rewards)
    k = min(check_int("retrieve: k", k), m)
    if k == 0:
        return []
    if rule == "recent":
        return list(range(m - k, m))
    if rule == "highest":
        return sorted(range(m), key=lambda i: -float(rewards[i]))[:k]
    if rule == "max_variance":
        return list(max_variance_subset(rewards, k))
    raise ReplayConfigError(f"unknown retrieval {rule!r}; valid: {list(RETRIEVALS)}", field="retrieval")


def split_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(R,) advantages of replayed rows normalised among themselves: (r - mean) / (std + 1e-4), unbiased std."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.numel() == 0 or \
            not bool(torch.isfinite(rewards.float()).all()):
        raise ReplayInputError(f"split_advantages: rewards must be a non-empty 1-D tensor of finite values, got "
                               f"{rewards!r:.60}")
    r = rewards.float()
    std = r.std() if r.numel() > 1 else torch.zeros(())
    return (r - r.mean()) / (std + ADV_EPS)


class RepoStore:
    """Per-prompt FIFOs of single responses (records with n = 1, stored pi_gen, reward)."""

    def __init__(self, options: RepoOptions) -> None:
        self.options = kit.check_options("repo", options, RepoOptions)
        self.cache: dict[str, list[GroupRecord]] = {}

    def retrieve(self, key: str) -> list[GroupRecord]:
        """The responses replayed for prompt ``key`` this step (empty below ``min_cache``), as stored records."""
        if not isinstance(key, str):
            raise ReplayInputError(f"retrieve: key must be a prompt key (str), got {type(key).__name__}")
        buf = self.cache.get(key, [])
        if len(buf) < self.options.min_cache:
            return []
        rewards = [float(r.rewards[0]) for r in buf]
        return [buf[i] for i in retrieve(rewards, self.options.retrieval, self.options.num_replays)]

    def add(self, key: str, responses: Sequence[GroupRecord]) -> None:
        """Append a step's responses of prompt ``key`` (after its retrieval); keep the newest ``max_cache``."""
        if not isinstance(key, str):
            raise ReplayInputError(f"add: key must be a prompt key (str), got {type(key).__name__}")
        responses = kit.check_groups("add", responses, n=1)
        buf = self.cache.setdefault(key, [])
        buf.extend(responses)
        del buf[:max(0, len(buf) - self.options.max_cache)]

    def __len__(self) -> int:
        return sum(len(v) for v in self.cache.values())

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        keys = [k for k, v in self.cache.items() for _ in v]
        tensors, meta = kit.pack([r for v in self.cache.values() for r in v], "cache")
        return tensors, {"options": asdict(self.options), "keys": keys, "records": meta}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated first (a refused load changes nothing); saved options that differ
        from this store's are refused when the stored responses cannot hold under them, else warned about."""
        cache, changes = parse_store(tensors, meta, self.options, where="repo state")
        self.cache = cache
        kit.warn_changes("repo", changes)


def parse_store(tensors: Any, meta: Any, options: RepoOptions, *, where: str, last_step: int | None = None,
                by_prompt: bool = False) -> tuple[dict[str, list[GroupRecord]], list[str]]:
    """(the per-prompt stores, option changes) of a RePO state; CheckpointError naming the field if malformed."""
    meta = kit.checked_meta(meta, ("options", "keys", "records"), where)
    tensors = kit.only_tensors(tensors, "cache", where)
    _, changes = kit.options_changes(RepoOptions, meta["options"], options, where)
    records = kit.unpack(tensors, meta["records"], "cache", where, single=True, last_step=last_step)
    keys = kit.keys_of(meta["keys"], records, where, (lambda r: key_of(r.prompt_ids)) if by_prompt else None)
    cache = kit.keyed(records, keys)
    most = max((len(v) for v in cache.values()), default=0)
    if most > options.max_cache:
        raise CheckpointError(f"{where}: a prompt stores {most} responses, more than max_cache={options.max_cache}: "
                              "saved with a larger max_cache; resume with the saved max_cache or start a new run")
    return cache, changes


def key_of(prompt_ids: torch.Tensor) -> str:
    """The store key of a prompt: its (unpadded) token ids."""
    return ",".join(str(int(t)) for t in prompt_ids.flatten().tolist())


class RepoController(kit.StoredState):
    """RePO as a replay controller of the TRL integration (the same protocol as
    :class:`~hdreplay.controller.ReplayController`: select -> stage -> commit, once per optimizer update).

    The selection is prompt-conditioned: :meth:`observe_batch` gives it the current batch's prompts first; each
    prompt whose store holds ``min_cache`` responses gets one replay record of its k retrieved responses with split
    advantages (:func:`split_advantages`).  Stage/commit add every fresh response to its prompt's store after the
    update.  The integration trains replay rows as a separate loss term (``off_coef``, :attr:`separate_term`).
    """

    FORMAT = FORMAT

    separate_term = True

    def __init__(self, options: RepoOptions) -> None:
        self.options = kit.check_options("repo", options, RepoOptions)
        self.store = RepoStore(options)
        self.last_step: int | None = None
        self._prompts: list[str] = []
        self._staged: list[GroupRecord] = []
        self._selection: Selection | None = None
        self._fresh = 0
        self._step: int | None = None

    def observe_batch(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """(N, P) left-padded prompts of the current fresh batch, rows in TRL's order (n per prompt)."""
        if not (isinstance(prompt_ids, torch.Tensor) and isinstance(prompt_mask, torch.Tensor)
                and prompt_ids.dim() == 2 and prompt_ids.shape == prompt_mask.shape):
            raise ReplayInputError(f"observe_batch: prompt_ids and prompt_mask must be tensors of one (N, P) "
                                   f"shape, got "
                                   f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)} and "
                                   f"{getattr(prompt_mask, 'shape', type(prompt_mask).__name__)}")
        keys = [key_of(prompt_ids[i][prompt_mask[i].bool()]) for i in range(prompt_ids.shape[0])]
        self._prompts = list(dict.fromkeys(keys))  # distinct, first-seen order

    def select(self, *, step: int, scorer=None) -> Selection:
        step = check_step("select: step", step)
        groups = []
        for key in self._prompts:
            got = self.store.retrieve(key)
            if not got:
                continue
            rewards = torch.cat([r.rewards for r in got]).float()
            groups.append(GroupRecord.from_responses(
                group_id=f"repo{step}.{len(groups)}", prompt_ids=got[0].prompt_ids,
                completion_ids=[r.completion_ids for r in got], logprobs=[r.logprobs for r in got],
                loss_masks=[r.loss_mask for r in got], advantages=split_advantages(rewards), rewards=rewards,
                birth_step=min(r.birth_step for r in got)))
        sel = empty_selection(step, "repo", len(self.store), float("nan"))
        sel = replace(sel, accepted=np.arange(len(groups), dtype=np.int64), groups=groups)
        self._selection = sel
        return sel

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> None:
        step = check_step("stage: step", step)
        groups = kit.check_groups("repo stage", groups)
        self._staged.extend(groups)
        self._fresh += len(groups)
        self._step = step

    def commit(self, *, num_fresh_groups: int | None = None, counters: Mapping[str, Any] | None = None
               ) -> dict[str, float]:
        kit.check_commit(num_fresh_groups, counters)
        sel = self._selection
        for g in self._staged:  # after the step's retrieval: never replayed in the step it was born
            self.store.add(key_of(g.prompt_ids), split_rollouts(g, keep_zero_advantage=True))
        replayed = sum(g.num_responses for g in sel.groups) if sel is not None else 0
        out = {"replay/replayed_rows": float(replayed),
               "replay/accepted": float(len(sel.groups) if sel is not None else 0),
               "replay/rescored_rows": 0.0, "replay/buffer_size": float(len(self.store)),
               "replay/repo_prompts": float(len(self.store.cache))}
        self.last_step = sel.step if sel is not None else self._step if self._staged else self.last_step
        self._staged, self._selection, self._prompts, self._fresh = [], None, [], 0
        return out

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = self.store.state_dict()
        return tensors, {**meta, "last_step": self.last_step}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: every field checked (responses born after ``last_step``, keys that are not
        their prompt's, more than max_cache per prompt are refused) before anything changes."""
        where = "repo state"
        last = kit.step_or_none(kit.checked_meta(meta, ("last_step",), where)["last_step"], "last_step", where)
        cache, changes = parse_store(tensors, meta, self.options, where=where, last_step=last, by_prompt=True)
        if cache and last is None:
            raise CheckpointError(f"{where}: responses are stored but last_step is None")
        store = RepoStore(self.options)
        store.cache = cache
        self.store, self.last_step = store, last
        kit.warn_changes("repo", changes)

