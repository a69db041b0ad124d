"""EXPERIMENTAL: Drift-gated staleness for asynchronous GRPO (stale mixed groups diverted into the buffer).

Not the paper's method and not part of the core: ``import hdreplay`` does not import this package.  An asynchronous
pipeline drops groups generated too many policy versions ago; here a stale group with a mixed outcome is diverted
into the replay buffer instead, and the Drift gate (against the sampler's log-probs, plus a measured
sampler-vs-trainer floor) decides whether and when it trains (:mod:`.rule`); a ledger records where every generated
group went (:mod:`.ledger`).  The adapters are ``hdreplay.integrations.trl.HDRAsyncGRPOTrainer`` (TRL 1.16's
``trl.experimental.async_grpo``) and ``hdreplay.integrations.verl.HDRReplayBufferAsync`` (verl v1 async).

Measured verdict (docs/async.md, docs/results/async: the policy-lag sandbox, 8 paired seeds, and a second, independent
lag model): **no better than dropping by age.**  At the same fresh bound (max_staleness 1) it trains ~2 points more of
the generated groups than age-drop, and 6-18 points fewer than age-drop at max_staleness 2 / 4, at equal or lower
held-out accuracy (paired differences -0.008 to -0.013 Mean@n, intervals covering 0).  What it buys: a ledger of
where stale groups went, and a Drift bound on what trains.  What it does not buy: accuracy or throughput over raising
the framework's own staleness bound.  Use it to study staleness, not to speed training up.
"""

from .ledger import LEDGER_FILE, StalenessLedger
from .rule import ROUTES, AsyncReplay, DriftFloor, FloorWarning, StalenessConfig, plan_problems, route

__all__ = ["AsyncReplay", "DriftFloor", "FloorWarning", "LEDGER_FILE", "plan_problems", "ROUTES", "route",
           "StalenessConfig", "StalenessLedger"]
