"""BAPO / "Buffer Matters" (arXiv 2602.20722; code waunx/BAPO_ICLR @426b509): a uid-keyed store of past groups
with score histories, re-evaluation of historically difficult prompts, replay of "target" groups to fill the batch.

The rules as the released trainer implements them (``OffPolicyManager`` / ``OffPolicyGroupBuffer`` in
``verl/trainer/ppo/ray_trainer.py``, ``RayBAPOTrainer.fit``), with a group's mean reward in accuracy units:

* ingress (after the update, on the step's *unfiltered* fresh groups): a group whose mean lies in
  ``[0, bad_thr]`` (difficult) or in ``target_range`` (high quality) is stored under its own uid (one uid per
  generated group) with its rewards as collection ("alpha") scores; the uid moves to the end of the LRU order;
* re-evaluation, on BAPO's 1-based steps divisible by ``reeval_every`` (``global_steps % off_policy_reeval_freq``;
  hdreplay's 0-based steps 1, 3, 5, ... at 2): up to ``max_reeval`` uids with mean(alpha) <= bad_thr,
  uniformly at random, are regenerated under the current policy; their rewards join the uid's "current" scores
  (capped at ``max_scores``); the new group is *promoted* into the batch iff mean(new) > mean(alpha);
* target replay: uids whose latest score (mean current if any, else mean alpha) lies in ``target_range``, uniformly
  without replacement, as many as fill the batch; replay does not remove them;
* eviction (:func:`evict`) only above ``max_uids`` uids, by category caps.

All ranges are inclusive.  :class:`BapoController` is the controller the TRL integration uses for ``replay_bapo``;
the generation side (fresh filter, re-evaluation rounds, batch fill) is ``integrations/trl/peers/bapo.py``.
Deviation: a dropped fresh group (outside ``train_range``, so never in the trained batch) is stored without its
generation log-probs -- it is re-evaluated, but never replayed (an all-wrong group has zero advantage anyway).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import CheckpointError, ReplayConfigError, ReplayInputError, ReplayProtocolError
from ..sampling import new_rng, rng_from_state, rng_state
from ..selectors import Selection, empty_selection
from ..store.record import GroupRecord
from ..validate import check_int, check_reals, check_sequence, check_step, is_int, is_real
from . import store as kit
from .sampling import uniform_order

FORMAT = "hdreplay.bapo"
_POSITION = re.compile(r".*g\d+")
#: BAPO's cap on the scores kept per uid (``max_scores_per_uid``)
MAX_SCORES = 32
_EPS = 1e-9


@dataclass(frozen=True)
class BapoOptions:
    """BAPO's settings (the released recipe's values; ``max_reeval`` scaled from 32 at B = 32 to the sandbox's 16)."""

    bad_thr: float = 1 / 8
    target_range: tuple[float, float] = (1 / 8, 2 / 8)
    train_range: tuple[float, float] = (1 / 8, 7 / 8)
    reeval_every: int = 2
    max_reeval: int = 16
    max_uids: int = 128
    max_target: int = 8
    stale_steps: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        v = self.bad_thr
        if type(v) not in (int, float) or not 0 <= v <= 1:
            raise ReplayConfigError(f"bapo.bad_thr: a number in [0, 1], got {v!r}", field="bad_thr")
        for name in ("target_range", "train_range"):
            r = getattr(self, name)
            if (not isinstance(r, (list, tuple)) or len(r) != 2 or any(type(x) not in (int, float) for x in r)
                    or not 0 <= r[0] <= r[1] <= 1):
                raise ReplayConfigError(f"bapo.{name}: [low, high] with 0 <= low <= high <= 1, got {r!r}", field=name)
            object.__setattr__(self, name, (float(r[0]), float(r[1])))
        for name, lo in (("reeval_every", 1), ("max_reeval", 0), ("max_uids", 1), ("max_target", 0),
                         ("stale_steps", 0), ("seed", 0)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ReplayConfigError(f"bapo.{name}: an int >= {lo}, got {v!r}", field=name)
        if self.max_target > self.max_uids:
            raise ReplayConfigError(f"bapo.max_target={self.max_target} exceeds max_uids={self.max_uids}",
                                    field="max_target")


def in_range(x: float, r: Sequence[float]) -> bool:
    """``r[0] <= x <= r[1]`` (inclusive, as BAPO's ranges; a float tolerance for i/n means)."""
    return r[0] - _EPS <= x <= r[1] + _EPS


@dataclass
class Entry:
    """One uid: collection rewards (alpha), re-evaluation rewards (current), last step it was stored, the TRL input
    row that regenerates its prompt (JSON-able), and its group with generation log-probs (None: not replayable)."""

    alpha: list[float]
    row: dict
    last_step: int
    current: list[float] = field(default_factory=list)
    record: GroupRecord | None = None

    @property
    def mu_alpha(self) -> float:
        return float(np.mean(self.alpha))

    @property
    def latest(self) -> float:
        return float(np.mean(self.current)) if self.current else self.mu_alpha


def is_difficult(e: Entry, o: BapoOptions) -> bool:
    """A re-evaluation candidate: mean collection reward in [0, bad_thr] (never updated by re-evaluation)."""
    return in_range(e.mu_alpha, (0.0, o.bad_thr))


def is_target(e: Entry, o: BapoOptions) -> bool:
    return in_range(e.latest, o.target_range)


def should_ingress(mean: float, o: BapoOptions) -> bool:
    return in_range(mean, (0.0, o.bad_thr)) or in_range(mean, o.target_range)


def promoted(new_rewards: Sequence[float], e: Entry) -> bool:
    """BAPO's promotion rule: the re-evaluated group beats the stored one on mean reward."""
    return float(np.mean(new_rewards)) > e.mu_alpha


def uniform_pick(items: Sequence, k: int, rng: np.random.Generator) -> list:
    """``min(k, len(items))`` items uniformly at random without replacement (order of the draw)."""
    if k <= 0 or not items:
        return []
    return [items[int(i)] for i in uniform_order(rng, len(items), k)]


def evict(store: dict[str, Entry], o: BapoOptions, step: int) -> list[str]:
    """Remove uids when more than ``max_uids`` are stored (``_check_and_evict``); returns the removed, in order.

    ``store`` iterates oldest first (LRU).  Classes by latest score: target (in ``target_range``, ties with the
    difficult range count as target), difficult (in [0, bad_thr]), other.  1. targets beyond ``max_target``:
    stale ones (last step < step - stale_steps) first, then the oldest; 2. difficult beyond max_uids - max_target,
    oldest first; 3. still above max_uids: other, then difficult, then target, oldest first.
    """
    if len(store) <= o.max_uids:
        return []
    target, bad, other = [], [], []
    for uid, e in store.items():
        (target if is_target(e, o) else bad if in_range(e.latest, (0.0, o.bad_thr)) else other).append(uid)
    out: list[str] = []
    if len(target) > o.max_target:
        excess = len(target) - o.max_target
        stale = [u for u in target if store[u].last_step < step - o.stale_steps][:excess]
        drop = stale + [u for u in target if u not in stale][:excess - len(stale)]
        out += drop
        target = [u for u in target if u not in drop]
    if len(bad) > o.max_uids - o.max_target:
        drop = bad[:len(bad) - (o.max_uids - o.max_target)]
        out += drop
        bad = bad[len(drop):]
    excess = len(target) + len(bad) + len(other) - o.max_uids
    for cls in (other, bad, target):
        if excess <= 0:
            break
        out += cls[:excess]
        excess -= len(cls[:excess])
    for u in out:
        del store[u]
    return out


@dataclass
class Fresh:
    """One fresh group of the step as the sampler saw it: uid, input row, (n,) rewards, position in the trained
    batch (None: dropped by the fresh filter)."""

    uid: str
    row: dict
    rewards: list[float]
    position: int | None


class BapoController(kit.StoredState):
    """BAPO as a replay controller of the TRL integration (select -> stage -> commit, once per optimizer update).

    Per step the sampler (integrations/trl/peers/bapo.py) calls :meth:`reeval_candidates`, :meth:`record_reeval` for
    each re-evaluated uid, then :meth:`plan` with the step's fresh groups and the replay budget; :meth:`select`
    returns up to that many target groups; :meth:`commit` stores the eligible fresh groups and evicts.
    """

    FORMAT = FORMAT

    def __init__(self, options: BapoOptions) -> None:
        self.options = kit.check_options("bapo", options, BapoOptions)
        self.store: dict[str, Entry] = {}
        self.rng = new_rng(options.seed)
        self.last_step: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._budget, self._fresh, self._counters = 0, [], {}
        self._staged: list[GroupRecord] = []
        self._selection: Selection | None = None

    # ---------------------------------------------------------------- the sampler's side
    def reeval_candidates(self, step: int) -> list[tuple[str, dict]]:
        """(uid, input row) of the difficult uids to regenerate at 0-based ``step`` (none unless verl's 1-based step
        number, step + 1, is divisible by reeval_every)."""
        o = self.options
        if (check_step("reeval_candidates: step", step) + 1) % o.reeval_every:
            return []
        cands = [u for u, e in self.store.items() if is_difficult(e, o)]
        return [(u, self.store[u].row) for u in uniform_pick(cands, o.max_reeval, self.rng)]

    def record_reeval(self, uid: str, rewards: Sequence[float]) -> bool:
        """Add a re-evaluation's (n,) rewards to ``uid``'s current scores; True iff the new group is promoted."""
        if not isinstance(uid, str) or uid not in self.store:
            raise ReplayInputError(f"record_reeval: {uid!r} is not a stored uid (reeval_candidates() names them)")
        size = len(rewards) if isinstance(rewards, (list, tuple, np.ndarray, torch.Tensor)) and \
            getattr(rewards, "ndim", 1) == 1 else -1
        rewards = check_reals("record_reeval: rewards", rewards, size).tolist()
        if not rewards:
            raise ReplayInputError("record_reeval: rewards must hold one reward per regenerated response, got none")
        e = self.store[uid]
        up = promoted(rewards, e)
        e.current = (e.current + [float(r) for r in rewards])[-MAX_SCORES:]
        return up

    def pick(self, items: Sequence, k: int) -> list:
        """A seeded uniform subset (the promoted groups that fit the batch)."""
        return uniform_pick(check_sequence("pick: items", items), check_int("pick: k", k), self.rng)

    def plan(self, fresh: Sequence[Fresh], *, budget: int, counters: Mapping[str, float]) -> None:
        fresh = check_sequence("plan: fresh", fresh)
        if not all(isinstance(f, Fresh) for f in fresh):
            raise ReplayInputError("plan: fresh must be a list of Fresh (uid, row, rewards, position)")
        budget = check_int("plan: budget", budget)
        if not isinstance(counters, Mapping) or not all(isinstance(k, str) and is_real(v) for k, v in counters.items()):
            raise ReplayInputError(f"plan: counters must map names to numbers, got {counters!r:.60}")
        self._fresh, self._budget, self._counters = fresh, budget, dict(counters)

    # ---------------------------------------------------------------- the trainer protocol
    def select(self, *, step: int, scorer=None) -> Selection:
        """Up to the planned budget of target groups (with log-probs), uniformly without replacement."""
        o = self.options
        check_step("select: step", step)
        elig = [e.record for e in self.store.values() if e.record is not None and is_target(e, o)]
        groups = uniform_pick(elig, self._budget, self.rng)
        sel = empty_selection(step, "bapo", len(self.store), float("nan"))
        sel = replace(sel, accepted=np.arange(len(groups), dtype=np.int64), groups=groups)
        self._selection = sel
        return sel

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> None:
        step = check_step("stage: step", step)
        groups = kit.check_groups("bapo stage", groups)
        bad = [g.group_id for g in groups if not _POSITION.fullmatch(str(g.group_id))]
        if bad:
            raise ReplayInputError(f"bapo stage: group id {bad[0]!r} does not end in g<position in the batch> (the "
                                   "TRL integration's ids, e.g. 's3.0g5')")
        if self.last_step is not None and step < self.last_step:
            raise ReplayProtocolError(f"stage(step={step}) after step {self.last_step}; steps must not go back")
        self._staged.extend(groups)
        self.last_step = step

    def commit(self, *, num_fresh_groups: int | None = None, counters: Mapping[str, Any] | None = None
               ) -> dict[str, float]:
        kit.check_commit(num_fresh_groups, counters)
        o, step = self.options, self.last_step
        by_pos = {int(str(g.group_id).rsplit("g", 1)[1]): g for g in self._staged}
        stored = 0
        for f in self._fresh:
            if not should_ingress(float(np.mean(f.rewards)), o):
                continue
            self.store.pop(f.uid, None)  # re-adding moves a uid to the end of the LRU order
            rec = by_pos.get(f.position) if f.position is not None else None
            self.store[f.uid] = Entry(alpha=[float(r) for r in f.rewards][-MAX_SCORES:], row=f.row, last_step=step,
                                     record=rec)
            stored += 1
        evicted = evict(self.store, o, step) if step is not None else []
        sel = self._selection
        groups = sel.groups if sel is not None else []
        out = {**self._counters, "replay/replayed_rows": float(sum(g.num_responses for g in groups)),
               "replay/accepted": float(len(groups)), "replay/rescored_rows": 0.0,
               "replay/buffer_size": float(len(self.store)), "bapo/target_groups": float(len(groups)),
               "bapo/stored": float(stored), "bapo/evicted": float(len(evicted)),
               "bapo/difficult_uids": float(sum(is_difficult(e, o) for e in self.store.values())),
               "bapo/target_uids": float(sum(is_target(e, o) for e in self.store.values()))}
        self._reset()
        return out

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        with_rec = [e.record for e in self.store.values() if e.record is not None]
        tensors, records = kit.pack(with_rec, "records")  # images included (the multimodal schema is saved)
        entries = [{"uid": u, "alpha": e.alpha, "current": e.current, "last_step": e.last_step, "row": e.row,
                    "record": e.record is not None} for u, e in self.store.items()]
        return tensors, {"options": asdict(self.options), "entries": entries, "records": records,
                         "last_step": self.last_step, "rng": rng_state(self.rng)}

    def load_state_dict(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`, every field checked first (a refused load changes nothing).  Refused option
        change: ``max_uids`` below the number of stored uids; the others are warned about."""
        where = "bapo state"
        meta = kit.checked_meta(meta, ("options", "entries", "records", "last_step", "rng"), where)
        tensors = kit.only_tensors(tensors, "records", where)
        saved, changes = kit.options_changes(BapoOptions, meta["options"], self.options, where)
        last = kit.step_or_none(meta["last_step"], "last_step", where)
        records = kit.unpack(tensors, meta["records"], "records", where, last_step=last)
        store = _parse_entries(meta["entries"], records, last, saved, where)
        rng = rng_from_state(meta["rng"], where=where)
        if len(store) > self.options.max_uids:
            raise kit.refuse_option(where, "max_uids", saved.max_uids, self.options.max_uids,
                                f"{len(store)} uids are stored")
        self.store, self.rng, self.last_step = store, rng, last
        self._reset()
        kit.warn_changes("bapo", changes)



_ENTRY_KEYS = {"uid", "alpha", "current", "last_step", "row", "record"}


def _parse_entries(entries: Any, records: list[GroupRecord], last: int | None, saved: BapoOptions, where: str
                   ) -> dict[str, Entry]:
    """The uid store of a BAPO state (LRU order kept), every entry checked against ``records`` and ``last``."""
    if not isinstance(entries, list) or not all(isinstance(x, dict) and set(x) == _ENTRY_KEYS for x in entries):
        raise CheckpointError(f"{where}: entries must be a list of objects with keys {sorted(_ENTRY_KEYS)}")
    if sum(x["record"] is True for x in entries) != len(records):
        raise CheckpointError(f"{where}: {len(records)} stored groups but entries mark "
                              f"{sum(x['record'] is True for x in entries)} as having one")
    if entries and last is None:
        raise CheckpointError(f"{where}: uids are stored but last_step is None")
    if len(entries) > saved.max_uids:
        raise CheckpointError(f"{where}: {len(entries)} uids stored, more than the saved max_uids={saved.max_uids}")
    it, store = iter(records), {}
    for i, x in enumerate(entries):
        at = f"{where}: entries[{i}]"
        uid, step = x["uid"], x["last_step"]
        if not isinstance(uid, str) or uid in store:
            raise CheckpointError(f"{at}: uid {uid!r} is not a string, or appears twice")
        if not (is_int(step) and 0 <= step <= last):
            raise CheckpointError(f"{at}: last_step {step!r} is not a step <= the store's last step {last}")
        if not isinstance(x["row"], dict) or not isinstance(x["record"], bool):
            raise CheckpointError(f"{at}: row must be an object and record true or false")
        rec = next(it) if x["record"] else None
        if rec is not None and rec.birth_step > step:
            raise CheckpointError(f"{at}: its group was born at step {rec.birth_step}, after it was stored ({step})")
        store[uid] = Entry(alpha=kit.real_list(x["alpha"], "alpha", at, lo=1, hi=MAX_SCORES), row=x["row"],
                           last_step=int(step), current=kit.real_list(x["current"], "current", at, lo=0, hi=MAX_SCORES),
                           record=rec)
    return store
