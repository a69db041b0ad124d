"""Checks of the v1 recipe's asynchronous settings: hdreplay's sampler (:mod:`.v1_sampler`) and verl's bypass mode.

Pure (reads the composed config only); :func:`async_problems` is called by :func:`.settings.validate_verl_config`.
"""

from __future__ import annotations

from typing import Any, Callable

SAMPLER_PATH = "pkg://hdreplay.integrations.verl.v1_sampler"
SAMPLER_NAME = "HDRReplayBufferAsync"
#: verl 0.9.1 policy losses that never read ``old_log_prob`` (in bypass mode: the rollout log-probs), so replayed
#: rows' stored sampler log-probs would be ignored (read from core_algos: gpg is a plain -A log pi)
LOSSES_WITHOUT_OLD_LOGPROB = ("gpg",)
#: estimators whose advantages a diverted group can get from its own rewards (:data:`.v1_sampler.DIVERT_ESTIMATORS`)
DIVERT_ESTIMATORS = ("grpo", "rloo")
ACTOR = "actor_rollout_ref.actor"


def uses_hdr_sampler(get: Callable[[str, Any], Any]) -> bool:
    return get("trainer.v1.sampler.custom_sampler.name", None) == SAMPLER_NAME


def bypass_mode(get: Callable[[str, Any], Any]) -> bool:
    return bool(get("algorithm.rollout_correction.bypass_mode", False))


def async_problems(get: Callable[[str, Any], Any]) -> list[str]:
    """Problems of the hdreplay sampler / bypass-mode settings of a v1 config (``get(dotted_key, default)``)."""
    problems = []
    sampler, bypass = uses_hdr_sampler(get), bypass_mode(get)
    if not (sampler or bypass):
        return problems
    if not get("actor_rollout_ref.rollout.calculate_log_probs", False):
        what = "diverted groups store the sampler's log-probs" if sampler else "bypass mode trains on them"
        problems.append(f"actor_rollout_ref.rollout.calculate_log_probs=false: the sampler gives no log-probs, but "
                        f"{what}; set it to true")
    if bypass:
        loss = get(f"{ACTOR}.policy_loss.loss_mode", "vanilla")
        if loss in LOSSES_WITHOUT_OLD_LOGPROB:
            problems.append(f"algorithm.rollout_correction.bypass_mode=true with {ACTOR}.policy_loss.loss_mode={loss}: "
                            "that loss never reads old_log_probs (in bypass mode the rollout log-probs), so replayed "
                            "rows' stored sampler log-probs would not enter it; use vanilla / bypass_mode (or another "
                            "ratio loss), or bypass_mode=false")
    if sampler:
        path = get("trainer.v1.sampler.custom_sampler.path", None)
        if path != SAMPLER_PATH:
            problems.append(f"trainer.v1.sampler.custom_sampler.path={path}: {SAMPLER_NAME} is loaded from "
                            f"{SAMPLER_PATH}")
        mode = get("trainer.v1.trainer_mode", "sync")
        if mode == "sync":
            problems.append(f"trainer.v1.sampler.custom_sampler.name={SAMPLER_NAME} with trainer.v1.trainer_mode=sync: "
                            "the sync trainer never evicts stale groups; use colocate_async or separate_async")
        est = str(get("algorithm.adv_estimator", "gae"))
        if est not in DIVERT_ESTIMATORS:
            problems.append(f"algorithm.adv_estimator={est}: a diverted group's advantages are computed from its own "
                            f"rewards before verl sees it; supported: {list(DIVERT_ESTIMATORS)}")
        level = get("algorithm.rollout_correction.rollout_is", None)
        if level and not bypass:
            problems.append(f"algorithm.rollout_correction.rollout_is={level} with {SAMPLER_NAME} in decoupled mode: "
                            "fresh groups store their birth rollout_is_weights but diverted groups have none (verl "
                            "evicts them before computing any), and the buffer holds one kind of group; set "
                            "algorithm.rollout_correction.bypass_mode=true (verl's fully-async default: the stored "
                            "rollout log-probs are the ratio's denominator) or rollout_is=null")
        if get(f"{ACTOR}.use_kl_loss", False):
            problems.append(f"{ACTOR}.use_kl_loss=true: diverted groups have no reference log-probs (verl computes "
                            "them only for the rows it samples); set it to false with the hdreplay sampler")
        if get("trainer.v1.sampler.max_off_policy_strategy", "drop") != "drop":
            problems.append("trainer.v1.sampler.max_off_policy_strategy="
                            f"{get('trainer.v1.sampler.max_off_policy_strategy', None)}: with 'wait' verl never evicts "
                            f"a stale group, so {SAMPLER_NAME} has nothing to divert; use drop")
        cap, tbs = get("hdr.capacity", None), get("data.train_batch_size", None)
        if isinstance(cap, int) and isinstance(tbs, int) and cap < tbs:
            problems.append(f"hdr.capacity={cap} cannot hold one step's groups (data.train_batch_size={tbs}): diverted "
                            f"groups would be evicted before any scan sees them; raise hdr.capacity to at least {tbs}")
        if get("trainer.v1.sampler.max_off_policy_threshold", None) is None:
            problems.append("trainer.v1.sampler.max_off_policy_threshold=null: nothing is ever stale; set the fresh "
                            "bound (spans above it are diverted to hdreplay)")
    return problems
