"""The peers whose replay order is random, as selectors of the core scan (registered when ``hdreplay`` is imported).

=================  ======================================  =====  ==========================================
name               order                                   gate   source
=================  ======================================  =====  ==========================================
uniform            uniform random, without replacement     no     uniform sampling from a FIFO (2604.08706)
freshper           proportional to p^alpha, p = (mean|r| + no     FreshPER (2604.16918): PER priority x
                   eps) x exp(-age / age_decay)                   exp(-age / age_decay), PER importance weights
adv_priority       rollouts proportional to |A|^alpha      no     rollout-level |A|-prioritised replay
                                                                  (2606.04560), single rollouts, max_age
=================  ======================================  =====  ==========================================

Each is a :class:`~hdreplay.selectors.SelectorSpec` whose ``draw`` is :func:`draw` and (``adv_priority``) whose
``split`` is :func:`~.rollouts.split_rollouts`; their knobs (``seed``, ``priority_alpha``, ``age_decay``,
``is_beta``, ``max_age``) are :class:`~hdreplay.config.ReplayConfig` fields, so every front end exposes them.
docs/strategies.md has the rules as implemented and the deviations.
"""

from __future__ import annotations

import numpy as np

from ..config import ReplayConfig
from ..selectors import SELECTORS, BufferView, SelectorSpec, register_selector
from .rollouts import split_rollouts
from .sampling import importance_weights, proportional_order, uniform_order

#: FreshPER's epsilon added to the |reward| priority (``priority_functions.reward_fresh_priority``)
PRIORITY_EPS = 1e-6


def priorities(buffer: BufferView, config: ReplayConfig, step: int) -> np.ndarray:
    """(size,) oldest first: the base priority of every live unit ("reward": mean |r_i| + eps, "advantage":
    mean |A_i|) times exp(-age / age_decay) when ``age_decay`` is set (FreshPER's freshness factor)."""
    spec = SELECTORS[config.selector]
    base = buffer.group_means("rewards" if spec.priority == "reward" else "advantages")
    if spec.priority == "reward":
        base = base + PRIORITY_EPS
    if config.age_decay is not None:
        ages = step - buffer.slot_values("birth_step", buffer.insertion_ids())
        base = base * np.exp(-ages / config.age_decay)
    return base


def draw(buffer: BufferView, config: ReplayConfig, rng: np.random.Generator, step: int, k: int,
         eligible: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ids drawn in order, their loss weights or None) of the configured random order over the ``eligible`` units
    ((size,) bool, oldest first): uniform without replacement, or proportional to priority^alpha with PER
    importance weights when ``is_beta`` > 0."""
    spec, ids = SELECTORS[config.selector], buffer.insertion_ids()
    pos = np.flatnonzero(eligible)
    if spec.order == "uniform":
        return ids[pos[uniform_order(rng, len(pos), k)]], None
    w = priorities(buffer, config, step)[pos] ** config.priority_alpha
    drawn = proportional_order(rng, w, k)
    weights = None
    if config.is_beta > 0 and len(drawn):
        weights = importance_weights(w / w.sum(), drawn, config.is_beta)
    return ids[pos[drawn]], weights


PEER_SELECTORS = (
    SelectorSpec("uniform", "uniform", gate=False, refresh=False, draw=draw),
    SelectorSpec("freshper", "proportional", gate=False, refresh=False, priority="reward", draw=draw),
    SelectorSpec("adv_priority", "proportional", gate=False, refresh=False, priority="advantage", unit="rollout",
                 draw=draw, split=split_rollouts),
)
for _spec in PEER_SELECTORS:
    register_selector(_spec)
