"""The one protocol a trainer calls, whatever replays: the paper's :class:`~hdreplay.controller.ReplayController` and
every peer controller of :mod:`hdreplay.baselines` alike.

Once per optimizer update::

    sel = strategy.select(step=t, scorer=score_fn)   # what is replayed this step (copies; may be empty)
    strategy.stage(fresh_groups, step=t)             # this step's fresh groups, held aside
    ...  train on the fresh rows and sel.groups
    metrics = strategy.commit()                      # after the update: store, evict; flat metrics

and ``save`` / ``load`` for checkpoints, ``close`` at the end of training.  Nothing else: what a peer needs beyond
it (RePO's batch prompts, BAPO's re-evaluation rounds, ExGRPO's prompt substitution, POPO's swap count) is fed by
that peer's own generation-side code in the integration (e.g. ``integrations/trl/peers/strategies.py`` builds one
:class:`~hdreplay.integrations.trl.peers.strategies.StrategySeam` per run), so the trainer calls this protocol and
the seam's hooks and never asks which strategy it holds.

>>> from hdreplay import ReplayConfig, ReplayController
>>> from hdreplay.baselines import BapoController, BapoOptions, PopoController, PopoOptions
>>> all(isinstance(s, Strategy) for s in (ReplayController(ReplayConfig()), PopoController(PopoOptions()),
...                                       BapoController(BapoOptions())))
True
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from ..selectors import Selection
from ..store.record import GroupRecord


@runtime_checkable
class Strategy(Protocol):
    """select -> stage -> commit once per optimizer update, plus checkpoints (see the module)."""

    last_step: int | None  # the last committed step (None before the first)

    def select(self, *, step: int, scorer: Any = None) -> Selection: ...

    def stage(self, groups: Sequence[GroupRecord], *, step: int) -> Any: ...

    def commit(self, *, num_fresh_groups: int | None = None,
               counters: Mapping[str, Any] | None = None) -> dict[str, float]: ...

    def save(self, directory: str | os.PathLike, *, allow_open_step: bool = False,
             identity: dict | None = None) -> None: ...

    def load(self, directory: str | os.PathLike, *, expect: dict | None = None) -> None: ...

    def close(self) -> None: ...
