"""The group-aware proxy around TRL async GRPO's rollout queue (rank 0).

TRL's ``RolloutQueueDataset`` (rank 0 only) pulls single ``RolloutSample``s from ``trainer.rollout_queue`` and drops
each one whose ``model_version`` is more than ``max_staleness`` behind -- one sample at a time, so a version bump
in the middle of a group can train half of it.  :class:`GroupRoutingQueue` takes that queue's place: it collects
a group's n samples, routes the whole group by the staleness rule (:func:`hdreplay.staleness.route`, with TRL's
own staleness: the current version minus the sample's) and hands TRL

* the group's samples, if it is fresh (within ``max_staleness``): unchanged, so TRL trains it as it would;
* nothing, if it is diverted (held for the buffer) or dropped (beyond the bound, zero-variance);
* first, before any fresh sample, the samples of groups the scan admitted (``enqueue_replay``), re-stamped with
  the current version.

It never re-scores (that runs on every rank after the weight sync, see :mod:`.async_trainer`: a sharded forward
inside this rank-0 iterator would deadlock).  It records, per group, where its samples landed (the global step:
TRL's ``FixedCountBatcher`` turns every ``samples_per_step`` samples into one step).

Supply: TRL's dataset polls forever on an empty queue.  Here every ``warn_after_s`` without a sample logs a warning
with the numbers, and after ``timeout_s`` a :class:`RolloutSupplyError` is raised (None: keep waiting, visibly).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ....staleness import route
from .rows import check_sampler_logprobs, group_from_samples, samples_from_group

logger = logging.getLogger("hdreplay.async")


class RolloutSupplyError(RuntimeError):
    """The rollout worker supplied no sample for longer than the configured timeout."""


@dataclass
class Routed:
    """One routed group as rank 0 saw it (broadcast to every rank at the step's end)."""

    group: Any  # GroupRecord
    route: str  # fresh | divert | drop
    staleness: int
    version: int  # the version at routing
    step: int  # the controller's step at routing (``version - 1 - version_shift``)
    steps: list = field(default_factory=list)  # global steps its samples landed in (fresh only)


class GroupRoutingQueue:
    """Stands in for ``trainer.rollout_queue`` (``get(timeout)`` / ``qsize()``, what TRL's dataset calls).

    Args:
        inner: the rollout worker's queue.
        n: samples per group (``num_generations``).
        fresh_bound: TRL's ``max_staleness``.
        version_fn: the trainer's current ``model_version``.
        mixed_fn: GroupRecord -> bool, the controller's ingress rule.
        samples_per_step: samples one optimizer step consumes (per_device_train_batch_size x GA x processes).
        max_divert_age: staleness beyond which a mixed group is dropped too (None: no limit).

    ``version_shift``: TRL's version minus the update count plus one (0 in a run started from scratch; a resumed
    run's versions count on from where TRL restarts them), so a group's ``birth_step`` and the controller's step are
    ``version - 1 - version_shift``.  Resume (:mod:`.async_resume`): the samples TRL already pulled for the coming
    step (``sent``; its dataloader prefetch, lost with the process) are handed out again first (``resend``).
    """

    def __init__(self, inner, *, n: int, fresh_bound: int, version_fn: Callable[[], int],
                 mixed_fn: Callable[[Any], bool], samples_per_step: int, max_divert_age: int | None = None,
                 warn_after_s: float = 60.0, timeout_s: float | None = None) -> None:
        self.inner, self.n, self.fresh_bound = inner, n, fresh_bound
        self.version_fn, self.mixed_fn, self.samples_per_step = version_fn, mixed_fn, samples_per_step
        self.max_divert_age, self.warn_after_s, self.timeout_s = max_divert_age, warn_after_s, timeout_s
        self._out: collections.deque = collections.deque()  # (sample, kind, group_id)
        self._replay: collections.deque = collections.deque()  # (sample, "replay", group_id, selection number)
        self._resend: collections.deque = collections.deque()  # (sample, kind, group_id): pulled before a resume
        self.sent: list = []  # (index, sample, kind, group_id) handed to TRL and not trained in a finished step
        self.selections = 0  # enqueue_replay calls so far
        self.version_shift = 0
        self._partial: dict[Any, list] = {}
        #: a resumed run's id offset (None: decided by the first sample after the resume, see :meth:`resumed`)
        self._gid_offset: int | None = 0
        self._gid_floor = 0  # 1 + the largest integer group id the interrupted run knew
        self._template = None
        self.emitted = 0
        self.routed: list[Routed] = []  # since the last drain
        self.landed: dict[Any, list] = {}  # group_id -> [(kind, global step)] since the last drain
        self.kind_of: dict[Any, tuple[str, int]] = {}  # group_id -> (kind, birth step) of the last emission
        self._last_sample = time.monotonic()
        self._warned_at = 0.0

    # ------------------------------------------------------------------ what TRL's dataset calls
    def qsize(self) -> int:
        return self.inner.qsize() + len(self._out) + len(self._replay) + len(self._resend)

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self._resend or self._replay or self._out):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._check_supply()
                raise queue.Empty
            try:
                sample = self.inner.get(timeout=left)
            except queue.Empty:
                self._check_supply()
                raise
            self._last_sample = time.monotonic()
            self._add(sample)
        if self._resend:  # pulled before the resume: its landing was recorded then
            sample, kind, gid = self._resend.popleft()
            sample.model_version = int(self.version_fn())  # TRL re-checks staleness; its loss never reads it
        else:
            sample, kind, gid = (self._replay or self._out).popleft()[:3]
            self.landed.setdefault(gid, []).append((kind, self.emitted // self.samples_per_step + 1))
        self.sent.append((self.emitted, sample, kind, gid))
        self.emitted += 1
        return sample

    # ------------------------------------------------------------------ routing
    def resumed(self, known_ids) -> None:
        """A resume: ``known_ids`` are the group ids the restored state holds outside this queue (buffer, staleness
        rule, selections); the queue adds its own (restored routing).
        TRL's own rollout worker restarts its group ids at 0 in the resumed process, which would collide with them
        (a duplicate in the buffer, two groups merged in a partial group or a label); a worker whose stream resumes
        (one that continues its ids) must not be renumbered.  The first sample decides: an integer id below every
        known one's successor, and not of a restored partial group, means the stream restarted, so from then on
        every integer id is moved past the known ones, and the restored partial groups, whose other samples died
        with the old worker, are dropped."""
        mine = {*self.kind_of, *self._partial, *(x[2] for x in self._out), *(x[2] for x in self._replay),
                *(x[2] for x in self._resend)}
        ints = [g for g in {*known_ids, *mine} if isinstance(g, int) and not isinstance(g, bool)]
        self._gid_floor = 1 + max(ints, default=-1)
        self._gid_offset = None

    def _add(self, sample) -> None:
        gid = sample.group_id
        is_int = isinstance(gid, int) and not isinstance(gid, bool)
        if self._gid_offset is None:
            restarted = is_int and gid < self._gid_floor and gid not in self._partial
            self._gid_offset = self._gid_floor if restarted else 0
            if restarted:
                self._partial.clear()
        if self._gid_offset and is_int:
            sample.group_id = gid + self._gid_offset
        self._template = self._template or sample
        part = self._partial.setdefault(sample.group_id, [])
        part.append(sample)
        if len(part) > self.n:
            raise RuntimeError(f"group {sample.group_id}: more than num_generations={self.n} samples; the HDR async "
                               "proxy routes whole groups of n samples (multi-turn forks are not supported)")
        if len(part) == self.n:
            self._route(self._partial.pop(sample.group_id))

    def _route(self, samples: list) -> None:
        check_sampler_logprobs(samples)
        versions = {int(s.model_version) for s in samples}
        if len(versions) != 1:
            raise RuntimeError(f"group {samples[0].group_id}: samples of versions {sorted(versions)}; a group must be "
                               "dispatched with one policy version")
        now = int(self.version_fn())
        k = now - versions.pop()
        group = group_from_samples(samples, birth_step=now - k - 1 - self.version_shift)
        r = route(staleness=k, fresh_bound=self.fresh_bound, mixed=bool(self.mixed_fn(group)),
                  max_divert_age=self.max_divert_age)
        self.routed.append(Routed(group, r, k, now, now - 1 - self.version_shift))
        if r == "fresh":
            self._out.extend((s, "fresh", s.group_id) for s in samples)
            self.kind_of[group.group_id] = ("fresh", group.birth_step)

    def enqueue_replay(self, groups) -> None:
        """Emit these groups' samples next, before any fresh sample (stamped with the current version)."""
        v = int(self.version_fn())
        self.selections += 1
        for g in groups:
            self._replay.extend((s, "replay", g.group_id, self.selections)
                                for s in samples_from_group(g, template=self._template, version=v))
            self.kind_of[g.group_id] = ("replay", g.birth_step)

    def drain(self, step: int) -> tuple[list[Routed], dict]:
        """The groups routed and the samples landed since the last call (and forget them); ``step``: the optimizer
        steps finished (samples handed out for them leave :attr:`sent`)."""
        routed, landed = self.routed, self.landed
        self.routed, self.landed = [], {}
        self.sent = [x for x in self.sent if x[0] >= step * self.samples_per_step]
        return routed, landed

    @property
    def pending_replay_samples(self) -> int:
        return len(self._replay)

    def _check_supply(self) -> None:
        waited = time.monotonic() - self._last_sample
        left = self.samples_per_step - self.emitted % self.samples_per_step
        msg = (f"hdreplay async: no rollout sample for {waited:.0f} s; the current step still needs {left} of its "
               f"{self.samples_per_step} samples ({len(self._partial)} groups incomplete, {self.inner.qsize()} samples "
               f"queued). The rollout worker supplies too little, or diverting stale groups leaves too few fresh ones: "
               f"raise the worker's concurrency (max_inflight_tasks) or lower replay_k_rep / the step size")
        if self.timeout_s is not None and waited >= self.timeout_s:
            raise RolloutSupplyError(msg + f" (replay_supply_timeout_s={self.timeout_s:g})")
        if waited >= self.warn_after_s and time.monotonic() - self._warned_at >= self.warn_after_s:
            self._warned_at = time.monotonic()
            logger.warning(msg)
