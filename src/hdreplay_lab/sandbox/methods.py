"""The paper's role-aligned methods at matched fresh-rollout budget, as TRL configurations.

b = fresh groups (prompts) per step, r = b / 2 replay groups (the paper's b128 + r64 / b256 + r128).

=================  ==========================================  ========  =========  ========
name               role                                        fresh     replay     loss
=================  ==========================================  ========  =========  ========
onpolicy_matched   GRPO on-policy, matched fresh budget        b         -          grpo
onpolicy_larger    GRPO on-policy, 1.5x fresh rollouts         1.5 b     -          grpo
recency_matched    GRPO + replay (latest r groups)             b         r          grpo
recency_larger     GRPO + replay (latest 2r groups)            b         2 r        grpo
dapo               DAPO-style: TRL's dapo loss + clip-higher   b         -          dapo
headroom_only      Headroom order, no Drift gate               b         r          grpo
drift_only         recency order + Drift gate                  b         r          grpo
headroom_drift     Headroom-Drift Replay (the paper)           b         r          grpo
hdr_l1             Headroom-Drift with L1 Drift                b         r          grpo
hdr_advantage      Headroom-Drift, |A|-weighted Headroom       b         r          grpo
=================  ==========================================  ========  =========  ========

``hdr_l1`` and ``hdr_advantage`` are the paper's two design-choice ablations (mechanism signatures in
docs/results/fidelity): Drift as the mean absolute instead of squared log-prob change, at 5 x the L2
tau as in the paper's pairing (tau_1 = 0.005 against tau_2 = 0.001, Appendix "L1-style versus L2-style
policy drift"; the two gates bound different regions, so no tau makes them the same gate), and
Headroom weighted by |A_i| instead of the sign of the advantage.

The DAPO baseline is TRL's ``loss_type="dapo"`` (token-level normalisation) with clip-higher
(epsilon_high = 0.28); TRL has no dynamic sampling, so DAPO's resampling of all-equal groups is
not reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    fresh_mult: float = 1.0
    selector: str = "none"
    replay_mult: float = 0.0  # replay groups per step, in units of b
    loss_type: str = "grpo"
    epsilon_high: float | None = None
    drift_norm: str = "l2"  # ReplayConfig.drift_norm
    headroom_weighting: str = "sign"  # ReplayConfig.headroom_weighting
    tau_scale: float = 1.0  # this method's tau = tau_scale x the comparison's tau

    def fresh_groups(self, b: int) -> int:
        return _whole(self.fresh_mult * b, f"{self.name} needs {self.fresh_mult} x b fresh groups")

    def replay_groups(self, b: int) -> int:
        return _whole(self.replay_mult * b, f"{self.name} needs {self.replay_mult} x b replay groups")


def _whole(x: float, what: str) -> int:
    if abs(x - round(x)) > 1e-9:
        raise ValueError(f"{what}, which is {x:g}: choose --prompts-per-step b even so b/2 and 1.5b are whole groups")
    return int(round(x))


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("onpolicy_matched", "GRPO on-policy matched (b)"),
        Method("onpolicy_larger", "GRPO on-policy larger (1.5b)", fresh_mult=1.5),
        Method("recency_matched", "GRPO + replay matched (b+r)", selector="recency", replay_mult=0.5),
        Method("recency_larger", "GRPO + replay larger (b+2r)", selector="recency", replay_mult=1.0),
        Method("dapo", "DAPO-style (b)", loss_type="dapo", epsilon_high=0.28),
        Method("headroom_only", "Headroom only (b+r)", selector="headroom_only", replay_mult=0.5),
        Method("drift_only", "Drift only (b+r)", selector="drift_only", replay_mult=0.5),
        Method("headroom_drift", "Headroom-Drift (b+r)", selector="headroom_drift", replay_mult=0.5),
        Method("hdr_l1", "Headroom-Drift, L1 Drift (b+r)", selector="headroom_drift", replay_mult=0.5,
               drift_norm="l1", tau_scale=5.0),
        Method("hdr_advantage", "Headroom-Drift, |A|-weighted (b+r)", selector="headroom_drift", replay_mult=0.5,
               headroom_weighting="advantage"),
    )
}
#: the default comparison (issue 16): Headroom-Drift against the paper's baselines and its two components;
#: recency_larger and the design-choice variants (hdr_l1, hdr_advantage) run when named (the variants also run
#: once each among the signature runs)
COMPARE_METHODS = ("onpolicy_matched", "onpolicy_larger", "recency_matched", "dapo", "headroom_only", "drift_only",
                   "headroom_drift")
DEMO_METHODS = ("onpolicy_matched", "recency_matched", "headroom_drift")
#: the paper's agentic-search set (Search-R1): no recency-larger, no ablations
SEARCH_METHODS = ("onpolicy_matched", "onpolicy_larger", "recency_matched", "dapo", "headroom_drift")


def get_methods(names) -> list[Method]:
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid methods: {list(METHODS)}")
    return [METHODS[n] for n in names]
