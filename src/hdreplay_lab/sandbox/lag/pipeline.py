"""The modelled generation pipeline of the policy-lag sandbox.

Generation runs ahead of training in ``slots`` parallel slots, one group per slot.  A group is dispatched with
the policy version current at that moment and arrives after a modelled duration

    d = (gen_fixed_ms + gen_ms_per_token * L_max) * exp(jitter_sigma * z),    z ~ N(0, 1)

where L_max is its longest completion: a group waits for its slowest response, so long completions arrive late
and the lognormal factor gives the long tail real serving has (queueing, preemption, stragglers).  A freed slot
dispatches the next group at once, unless the budget of generated groups is spent or the AReaL-style throttle
holds it: with ``throttle = eta``, a group may be dispatched at version u only while fewer than
``(u + eta + 1) * b`` groups have been dispatched (generation never runs more than eta steps ahead).  A training
step takes ``train_fixed_ms + train_ms_per_group * groups + rescore_ms_per_group * re-scored groups``; the
modelled wall-clock of a run is when its last step ends.  The lags (versions behind at arrival) are what this
pipeline produces, not drawn separately: every run records their histogram.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PipelineConfig:
    """Modelled costs (milliseconds) and the pipeline's width."""

    slots: int = 16
    gen_fixed_ms: float = 300.0
    gen_ms_per_token: float = 150.0
    jitter_sigma: float = 0.6
    train_fixed_ms: float = 100.0
    train_ms_per_group: float = 25.0
    rescore_ms_per_group: float = 8.0

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"--slots must be an integer >= 1, got {self.slots!r}")
        for name in ("gen_fixed_ms", "gen_ms_per_token", "jitter_sigma", "train_fixed_ms", "train_ms_per_group",
                     "rescore_ms_per_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")

    def duration_ms(self, longest_tokens: int, rng: np.random.Generator) -> float:
        base = self.gen_fixed_ms + self.gen_ms_per_token * longest_tokens
        return float(base * math.exp(self.jitter_sigma * rng.standard_normal()))

    def step_ms(self, groups: int, rescored: int) -> float:
        return self.train_fixed_ms + self.train_ms_per_group * groups + self.rescore_ms_per_group * rescored


class Pipeline:
    """In-flight groups ordered by arrival time, the free slots and the dispatch budget."""

    def __init__(self, cfg: PipelineConfig, *, budget: int, rng: np.random.Generator,
                 throttle: int | None = None, groups_per_step: int = 1) -> None:
        self.cfg, self.budget, self.rng = cfg, budget, rng
        self.throttle, self.b = throttle, groups_per_step
        self.free = cfg.slots
        self.dispatched = 0
        self._heap: list = []

    def can_dispatch(self, version: int) -> bool:
        if self.free == 0 or self.dispatched >= self.budget:
            return False
        return self.throttle is None or self.dispatched < (version + self.throttle + 1) * self.b

    def dispatch(self, t: float, group, longest_tokens: int) -> None:
        heapq.heappush(self._heap, (t + self.cfg.duration_ms(longest_tokens, self.rng), self.dispatched, group))
        self.dispatched += 1
        self.free -= 1

    @property
    def inflight(self) -> int:
        return len(self._heap)

    @property
    def exhausted(self) -> bool:
        """Nothing in flight and nothing more will be dispatched."""
        return not self._heap and self.dispatched >= self.budget

    def next_time(self) -> float:
        return self._heap[0][0]

    def pop(self):
        """(arrival time, group) of the next arrival; its slot is freed."""
        t, _, group = heapq.heappop(self._heap)
        self.free += 1
        return t, group
