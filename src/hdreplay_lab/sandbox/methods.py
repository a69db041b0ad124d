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
uniform_fifo       uniform sampling from a FIFO of all groups  b         r          grpo
freshper           FreshPER: |r| priority x exp(-age/2) PER    b         r          grpo
adv_priority       rollouts by |A|, evicted after 4 steps      b         r rows     grpo
dapo_dynamic       DAPO + dynamic sampling (drop all-equal)    b kept    -          dapo
bapo               BAPO: filtered fresh + promoted + targets   <= b      fill to b  dapo
popo               POPO: zero-variance groups swapped for the  <= b      swap to b  grpo+dec. IS
                   newest stored effective groups
repo_recency       RePO: newest 8 stored responses per prompt  b         8/prompt   grpo+off
repo_reward        RePO: 8 highest-reward stored responses     b         8/prompt   grpo+off
repo_variance      RePO: 8 stored responses of max variance    b         8/prompt   grpo+off
exgrpo             ExGRPO: 1 stored correct row in b/2 groups  b         b/2 rows   dr_grpo+shaped
exgrpo_grpo        ExGRPO's mixing under the GRPO loss         b         b/2 rows   grpo+shaped
hdr_l1             Headroom-Drift with L1 Drift                b         r          grpo
hdr_advantage      Headroom-Drift, |A|-weighted Headroom       b         r          grpo
hdr_fullscan       Headroom-Drift, full scan (no slicing)      b         r          grpo
hdr_skip           Headroom-Drift + futile-rescoring skip      b         r          grpo
=================  ==========================================  ========  =========  ========

``hdr_l1`` and ``hdr_advantage`` are the paper's two design-choice ablations (mechanism signatures in
docs/results/fidelity): Drift as the mean absolute instead of squared log-prob change, at 5 x the L2
tau as in the paper's pairing (tau_1 = 0.005 against tau_2 = 0.001, Appendix "L1-style versus L2-style
policy drift"; the two gates bound different regions, so no tau makes them the same gate), and
Headroom weighted by |A_i| instead of the sign of the advantage.

``hdr_fullscan`` and ``hdr_skip`` are the gate-cost variants (issue 27, docs/results/gate_cost): the paper's scan
forwarding every scanned group whole (``scan_passes=1``, the scan before exact early rejection; its gate decisions
are the default's, its cached-Headroom refresh differs for early-rejected groups), and the default scan plus
``skip_rejected=4`` (a group rejected with Drift D sits out min(4, floor(log2(D / tau))) steps).

The DAPO baseline is TRL's ``loss_type="dapo"`` (token-level normalisation) with clip-higher
(epsilon_high = 0.28); ``dapo`` alone has no dynamic sampling, ``dapo_dynamic`` adds it
(``replay_dynamic_sampling``: over-generate and drop groups whose rewards are all equal until the batch
holds b mixed groups; the extra fresh responses are counted).  The peer strategies are compositions of
the same machinery (selector, ingress rule, priority knobs, max age); docs/strategies.md has their sources,
rules as implemented and deviations.  ``bapo`` (BAPO's buffer-driven batch: fresh groups filtered to
accuracy [1/8, 7/8], re-evaluated difficult prompts promoted into the batch, stored 1/8..2/8 groups replayed to
fill b) counts its re-evaluation rollouts as fresh responses.  ``popo`` (POPO: each fresh group whose rewards
are all equal is swapped for one of the newest stored effective groups, trained with decoupled importance
sampling) generates b groups and replays as many stored groups as it swaps out.
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
    #: the strategy's own replay knobs (ReplayConfig name -> value); --replay.<knob> given by the user overrides
    replay: tuple[tuple[str, object], ...] = ()
    #: DAPO's dynamic sampling (HDRGRPOConfig.replay_dynamic_sampling)
    dynamic_sampling: bool = False
    #: RePO's per-prompt replay (HDRGRPOConfig.replay_repo: RepoOptions fields)
    repo: tuple[tuple[str, object], ...] = ()
    #: BAPO's buffer-driven batches (HDRGRPOConfig.replay_bapo: BapoOptions fields; None = off)
    bapo: tuple[tuple[str, object], ...] | None = None
    tau_scale: float = 1.0  # this method's tau = tau_scale x the comparison's tau
    #: further HDRGRPOConfig fields of the strategy (name -> value), e.g. ExGRPO's replay_exgrpo
    trl: tuple[tuple[str, object], ...] = ()

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
               replay=(("drift_norm", "l1"),), tau_scale=5.0),
        Method("hdr_advantage", "Headroom-Drift, |A|-weighted (b+r)", selector="headroom_drift", replay_mult=0.5,
               replay=(("headroom_weighting", "advantage"),)),
        Method("hdr_fullscan", "Headroom-Drift, full scan (b+r)", selector="headroom_drift", replay_mult=0.5,
               replay=(("scan_passes", 1),)),
        Method("hdr_skip", "Headroom-Drift + futile skip (b+r)", selector="headroom_drift", replay_mult=0.5,
               replay=(("skip_rejected", 4),)),
        # peers (docs/strategies.md): uniform FIFO replay of every group (arXiv 2604.08706)
        Method("uniform_fifo", "Uniform FIFO (b+r)", selector="uniform", replay_mult=0.5,
               replay=(("ingress", "all"),)),
        # FreshPER (arXiv 2604.16918): (mean|r| + eps) x exp(-age / tau_age), ^0.6, PER weights beta 0.4;
        # tau_age rescaled to the buffer's 4-step horizon (paper: 500 steps)
        Method("freshper", "FreshPER (b+r)", selector="freshper", replay_mult=0.5,
               replay=(("priority_alpha", 0.6), ("age_decay", 2.0), ("is_beta", 0.4))),
        # rollout-level |A|-prioritised replay, age eviction (arXiv 2606.04560): r x n single rollouts
        Method("adv_priority", "|A|-priority rollouts (b+r)", selector="adv_priority", replay_mult=0.5,
               replay=(("priority_alpha", 1.0), ("max_age", 4))),
        # DAPO with dynamic sampling (arXiv 2503.14476): b mixed groups per step, over-generated
        Method("dapo_dynamic", "DAPO + dynamic sampling (b)", loss_type="dapo", epsilon_high=0.28,
               dynamic_sampling=True),
        # RePO (arXiv 2506.09340), released run: 8 replays per prompt once 16 are cached, separate loss term;
        # replays only prompts seen twice before, so compare with --train-pool (prompts cycled over epochs)
        *(Method(f"repo_{name}", f"RePO {name} (b+8/prompt)", repo=(("retrieval", rule),))
          for name, rule in (("recency", "recent"), ("reward", "highest"), ("variance", "max_variance"))),
        # ExGRPO (arXiv 2510.02245; LUFFY/ExGRPO run_exgrpo.sh): b prompts, up to b/2 of them experience prompts
        # whose group holds one stored correct trajectory (policy-shaped, unclipped); dr_grpo aggregation
        # (loss_remove_token_mean), advantages r - mean (grpo_use_std=False)
        Method("exgrpo", "ExGRPO (b, mixed groups)", loss_type="dr_grpo",
               trl=(("replay_exgrpo", "{}"), ("scale_rewards", "none"))),
        # the same mechanism under the sandbox's GRPO loss (group-std advantages, grpo aggregation): separates
        # ExGRPO's mixing from its loss recipe at the comparison's learning rate
        Method("exgrpo_grpo", "ExGRPO mixing, GRPO loss (b)", trl=(("replay_exgrpo", "{}"),)),
        # BAPO (arXiv 2602.20722), released recipe (token-mean loss, clip 0.2 / 0.28) at b = 16: re-evaluation of
        # <= 16 difficult prompts every 2 steps, 128 uids; no delayed behaviour policy (rho_tis = 1)
        Method("bapo", "BAPO (b, buffer-filled)", loss_type="dapo", epsilon_high=0.28, bapo=()),
        # POPO (arXiv 2606.01281; no public code): zero-variance fresh groups swapped for the newest of a FIFO of 64
        # effective groups (4b, the others' capacity), decoupled IS truncated at 2; the sandbox's GRPO loss
        Method("popo", "POPO (b, zero-variance swapped)", trl=(("replay_popo", "{}"),)),
    )
}

#: the default comparison (issue 16): Headroom-Drift against the paper's baselines and its two components;
#: recency_larger and the design-choice variants (hdr_l1, hdr_advantage) run when named (the variants also run
#: once each among the signature runs)
COMPARE_METHODS = ("onpolicy_matched", "onpolicy_larger", "recency_matched", "dapo", "headroom_only", "drift_only",
                   "headroom_drift")
#: the strategy comparison (docs/results/strategies): the paper's method, its role-aligned baselines, the peers
STRATEGY_METHODS = ("onpolicy_matched", "onpolicy_larger", "recency_matched", "headroom_drift", "uniform_fifo",
                    "freshper", "adv_priority", "dapo_dynamic", "repo_recency", "repo_reward", "repo_variance",
                    "exgrpo", "bapo", "popo")
DEMO_METHODS = ("onpolicy_matched", "recency_matched", "headroom_drift")
#: the paper's agentic-search set (Search-R1): no recency-larger, no ablations
SEARCH_METHODS = ("onpolicy_matched", "onpolicy_larger", "recency_matched", "dapo", "headroom_drift")
#: the paper's multimodal set (Geometry3K / MathVista / MathVision): on-policy b and 1.5b, DAPO, Headroom-Drift
GEO_METHODS = ("onpolicy_matched", "onpolicy_larger", "dapo", "headroom_drift")


def get_methods(names) -> list[Method]:
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid methods: {list(METHODS)}")
    return [METHODS[n] for n in names]
