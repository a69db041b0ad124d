"""The rewards of every fresh group, per step: what the ingress analysis (``hdreplay report``) reads.

``fresh_groups.jsonl`` in the run directory, one line per generation batch::

    {"step": 12, "n": 8, "rewards": [[r_1, ..., r_8], ...]}

``step`` is TRL's ``global_step`` when the batch was generated (the replay step it belongs to), ``rewards`` one list
per group in the batch's order (TRL's sampler yields each prompt n times in a row). The log wraps the task's reward
function, the one place where a generation batch's rewards pass through the lab without changing the trainer. One
process: with several, each rank's reward function sees only its own rows (the sandbox runs one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

FILE = "fresh_groups.jsonl"


class GroupRewardLog:
    """A TRL reward function that returns ``reward_func``'s rewards and appends them, grouped by ``n``, to ``path``.

    Args:
        reward_func: the wrapped TRL reward function (``__name__`` is kept: TRL logs rewards under it).
        path: the JSONL file (created or appended to).
        n: responses per group (``num_generations``).
    """

    def __init__(self, reward_func: Callable, path: str | os.PathLike, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (responses per group) must be an int >= 1, got {n!r}")
        self.reward_func, self.path, self.n = reward_func, Path(path), n
        self.__name__ = getattr(reward_func, "__name__", type(reward_func).__name__)

    def __call__(self, *args, **kwargs):
        rewards = self.reward_func(*args, **kwargs)
        state = kwargs.get("trainer_state")
        vals = [None if r is None else float(r) for r in rewards]
        if len(vals) % self.n:
            raise ValueError(f"{len(vals)} rewards do not form groups of {self.n}; the reward log needs whole groups")
        rec = {"step": int(getattr(state, "global_step", -1)), "n": self.n,
               "rewards": [vals[i:i + self.n] for i in range(0, len(vals), self.n)]}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rewards
