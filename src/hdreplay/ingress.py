"""Ingress rules: which fresh groups may enter the replay buffer.

A rule is any callable ``(group: GroupRecord) -> bool``; :meth:`ReplayController.stage
<hdreplay.controller.ReplayController.stage>` applies the configured one (``ReplayConfig.ingress``) to the
groups :func:`hdreplay.store.ingest.groups_from_rows` built.  Three are built in, by name:

* ``"mixed"``, :class:`MixedOutcome` (paper default, binary rewards): admit iff the rewards are
  not all equal, so the group carries a non-zero GRPO advantage.
* ``"answer"``, :class:`AnswerBased` (multi-reward, paper Appendix C): a_i = 1[r_i >= threshold];
  admit iff 1 <= S(g) = sum_i a_i <= n - 1, so format-only reward variance
  (e.g. 0.0 vs 0.1) does not consume replay capacity.
* ``"all"``, :class:`Everything`: every group, zero-variance ones included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import torch

from .errors import ReplayConfigError, ReplayInputError
from .store.record import GroupRecord

IngressRule = Callable[[GroupRecord], bool]


def _rewards(group: GroupRecord) -> torch.Tensor:
    if not isinstance(group, GroupRecord):
        raise ReplayInputError(f"group: must be a GroupRecord, got {type(group).__name__}")
    return group.rewards


#: the built-in rules by name
INGRESS_RULES = ("mixed", "answer", "all")


@dataclass(frozen=True)
class Everything:
    """Admit every group (a FIFO of all trajectories, as uniform FIFO replay's source pushes them)."""

    def __call__(self, group: GroupRecord) -> bool:
        _rewards(group)
        return True


@dataclass(frozen=True)
class MixedOutcome:
    """Admit iff the group's rewards are not all equal."""

    def __call__(self, group: GroupRecord) -> bool:
        r = _rewards(group)
        return bool((r != r[0]).any())


@dataclass(frozen=True)
class AnswerBased:
    """Admit iff 1 <= #{i : r_i >= threshold} <= n - 1."""

    threshold: float

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not math.isfinite(
            self.threshold
        ):
            raise ReplayConfigError(f"answer_threshold: must be a finite number, got {self.threshold!r}",
                                    field="answer_threshold")

    def answers(self, group: GroupRecord) -> torch.Tensor:
        """(n,) bool answer indicators a_i."""
        return _rewards(group) >= self.threshold

    def __call__(self, group: GroupRecord) -> bool:
        s = int(self.answers(group).sum())
        return 1 <= s <= group.num_responses - 1


def make_ingress_rule(rule: Union[str, IngressRule], *, answer_threshold: float | None = None) -> IngressRule:
    """Resolve a rule by name (:data:`INGRESS_RULES`: "mixed", "answer", "all") or pass a callable through."""
    if callable(rule):
        return rule
    if not isinstance(rule, str):
        raise ReplayConfigError(f"ingress: must be a rule name {list(INGRESS_RULES)} or a callable, got "
                                f"{type(rule).__name__}", field="ingress")
    if rule == "mixed":
        return MixedOutcome()
    if rule == "all":
        return Everything()
    if rule == "answer":
        if answer_threshold is None:
            raise ReplayConfigError(
                "ingress='answer' needs answer_threshold (a_i = 1[r_i >= threshold]; the paper uses 0.9 "
                "for rewards 0/0.1/0.9/1.0)"
            )
        return AnswerBased(answer_threshold)
    raise ReplayConfigError(f"unknown ingress rule {rule!r}; valid: {list(INGRESS_RULES)} or a callable")
