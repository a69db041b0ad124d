"""TRL reward functions of the sandbox tasks: one named per task, scoring completions against the dataset's answers."""

from __future__ import annotations

from typing import Any, Callable


def score_reward(name: str, score: Callable[[Any, str], float]) -> Callable[..., list[float]]:
    """A TRL reward function named ``<name>_reward`` (TRL's metric name) that scores each completion against the
    dataset's ``answer`` column with ``score(completion, answer) -> float``."""

    def reward(completions, answer, **kw):
        return [score(c, a) for c, a in zip(completions, answer)]

    reward.__name__ = f"{name}_reward"
    return reward
