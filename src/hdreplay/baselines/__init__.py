"""The peers of Headroom-Drift Replay, apart from the paper's primitive, behind one protocol.

Every strategy here is driven by a trainer through :class:`~.protocol.Strategy` (select -> stage -> commit once per
optimizer update, plus checkpoints) -- the protocol the core's :class:`~hdreplay.controller.ReplayController`
already speaks -- and the integration's generation-side seam (``integrations/trl/peers/strategies.py``), so no trainer
asks which strategy it holds.

=================  ==========================================  ==============================================
module             what                                        trainer side (TRL)
=================  ==========================================  ==============================================
:mod:`.orders`     uniform FIFO, FreshPER, rollout-level |A|   selectors of the core scan (``replay_selector``),
                   priority: random orders, registered as      registered when this package is imported
                   selectors
:mod:`.repo`       RePO's per-prompt stores and retrieval      ``replay_repo``: the batch's prompts before
                                                               selection; replay as a separate loss term
:mod:`.exgrpo`     ExGRPO's experience pool, buckets, pick     ``replay_exgrpo``: prompt substitution, one
                                                               injected row per group, the shaped loss
:mod:`.bapo`       BAPO's uid store, re-evaluation, eviction   ``replay_bapo``: filtered fresh + promoted +
                                                               target groups
:mod:`.popo`       POPO's effective-group FIFO, decoupled IS   ``replay_popo``: zero-variance fresh groups
                                                               swapped for the newest stored groups
:mod:`.dapo`       DAPO's dynamic sampling rule                ``replay_dynamic_sampling``: rounds until the
                                                               batch holds mixed groups only
=================  ==========================================  ==============================================

:mod:`.store` is the per-prompt records' checkpoint format (validated field by field on load); :mod:`.sampling`
the seeded random orders and ExGRPO's buckets; :mod:`.rollouts` the split of a group into single responses.
docs/strategies.md documents every strategy: sources, rules as implemented, deviations.  The paper's own method and
its ablations (headroom_only, drift_only, recency, the l1 and advantage-weighted variants) stay in the core.
"""

from __future__ import annotations

from . import orders as _orders  # noqa: F401  (registers uniform, freshper, adv_priority)
from .bapo import BapoController, BapoOptions
from .dapo import DynamicSampling
from .exgrpo import ExgrpoController, ExgrpoOptions
from .popo import PopoController, PopoOptions
from .protocol import Strategy
from .repo import RepoController, RepoOptions

__all__ = ["BapoController", "BapoOptions", "DynamicSampling", "ExgrpoController", "ExgrpoOptions", "PopoController",
           "PopoOptions", "RepoController", "RepoOptions", "Strategy"]
