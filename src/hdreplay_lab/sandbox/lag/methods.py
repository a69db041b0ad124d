"""The compared ways of handling a group that arrives k policy versions behind.

=============  =====================================================================  ===========================
name           rule                                                                   loss
=============  =====================================================================  ===========================
age1/2/4       train groups with k <= s (TRL ``max_staleness`` / verl's span bound),  PPO-clip against the
               drop the rest                                                          sampler's log-probs
wait           AReaL-style admission control: generation is throttled so it never    PPO-clip against the
               runs more than eta = 2 steps ahead; nothing is dropped                 sampler's log-probs
keep_tis       train everything as it arrives, no throttle                            decoupled PPO: clip against
                                                                                      the current policy, times
                                                                                      min(pi / pi_sampler, 2)
gated          k <= 1 trains as fresh; older mixed groups are diverted into the       PPO-clip against the
               buffer and the Headroom-ranked, Drift-gated scan admits up to           sampler's log-probs (fresh
               K_rep = b/2 of them per step (zero-variance stale groups dropped)      and replayed rows)
gated_hdr      gated, plus fresh mixed groups enter the buffer too (Headroom-Drift    as gated
               replay of older groups)
=============  =====================================================================  ===========================

Every method trains b groups from the arrival queue per step (oldest arrival first); the gated ones add up to
K_rep replayed groups, so their steps are larger (what hdreplay's integrations do: no fresh group displaced).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AsyncMethod:
    name: str
    label: str
    #: "age" (drop k > bound), "wait" (throttled, keep all), "keep" (keep all), "gated" (the staleness rule)
    kind: str
    bound: int | None = None  # age: max staleness; gated: the fresh bound
    throttle: int | None = None  # wait: eta
    loss: str = "clip"  # "clip" (PPO-clip vs the sampler) | "tis" (decoupled PPO, truncated IS)
    is_cap: float = 2.0
    replay_mult: float = 0.0  # gated: K_rep in units of b
    ingest_fresh: bool = False

    def k_rep(self, b: int) -> int:
        return int(round(self.replay_mult * b))


ASYNC_METHODS: dict[str, AsyncMethod] = {
    m.name: m
    for m in (
        AsyncMethod("age1", "age-drop, max_staleness 1", "age", bound=1),
        AsyncMethod("age2", "age-drop, max_staleness 2", "age", bound=2),
        AsyncMethod("age4", "age-drop, max_staleness 4", "age", bound=4),
        AsyncMethod("wait", "wait (throttle, eta 2)", "wait", throttle=2),
        AsyncMethod("keep_tis", "keep all, truncated IS", "keep", loss="tis"),
        AsyncMethod("gated", "Drift-gated staleness", "gated", bound=1, replay_mult=0.5),
        AsyncMethod("gated_hdr", "Drift-gated staleness + HDR replay", "gated", bound=1, replay_mult=0.5,
                    ingest_fresh=True),
    )
}
#: the method the paired differences are taken against, and the one the issue asks to beat
REFERENCE = "gated"


def get_async_methods(names) -> list[AsyncMethod]:
    unknown = [n for n in names if n not in ASYNC_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid methods: {list(ASYNC_METHODS)}")
    return [ASYNC_METHODS[n] for n in names]
