"""HDRReplayBufferAsync: verl v1's async sampler, handing stale mixed groups to hdreplay instead of evicting them.

verl 0.9.1's ``ReplayBufferAsync`` (the v1 rollout buffer of the async trainers) evicts finished groups whose span
``global_steps - prompt_global_steps + 1`` exceeds ``trainer.v1.sampler.max_off_policy_threshold``
(``_stale_terminal_keys`` -> ``_evict_terminal_groups`` -> ``_clear_groups``) and refills their prompts.  This
subclass reads those groups' rows from TransferQueue in ``_evict_terminal_groups``, before verl's own eviction
clears them, and keeps them (:attr:`diverted`) for the recipe's trainer, which stages them into the replay buffer
at its next actor update (:mod:`.v1_async`).  verl then evicts and refills exactly as before: the prompt stream and
the sampler's metrics are unchanged; only the rows' fate differs.

Select it with::

    trainer.v1.sampler.custom_sampler.path=pkg://hdreplay.integrations.verl.v1_sampler
    trainer.v1.sampler.custom_sampler.name=HDRReplayBufferAsync

What a diverted group stores: the prompt and the n responses, ``response_mask`` as the loss mask, the sampler's
``rollout_log_probs`` (the trainer's own log-probs do not exist yet: verl computes them only for the rows it
samples), rewards = ``rm_scores`` summed, and the advantages verl's estimator would give the group (its
``compute_grpo_outcome_advantage`` / ``compute_rloo_outcome_advantage`` on the group alone: outcome advantages
depend on the group's rewards only), and the rollout log-probs again as the ``rollout_logprobs`` extra that fresh
groups of the same run carry.  ``birth_step`` = the prompt's ``global_steps`` x ``parameter_sync_step``.
Zero-variance groups are kept too; the trainer's staleness rule drops and counts them.
"""

from __future__ import annotations

import numpy as np
import torch
import transfer_queue as tq
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from ...errors import ReplayInputError
from ...store.ingest import one_group, rows_from_responses
from ...store.record import GroupRecord
from .dataproto import response_level

#: estimators whose advantages are a function of the group's outcome rewards alone (what a diverted group can get)
DIVERT_ESTIMATORS = {"grpo": core_algos.compute_grpo_outcome_advantage,
                     "rloo": core_algos.compute_rloo_outcome_advantage}
FIELDS = ("prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores")


def stale_group(uid: str, rows: list[dict], *, birth_step: int, estimator: str, norm_by_std: bool = True
                ) -> GroupRecord:
    """One GroupRecord from a stale uid's n rows (dicts of unpadded ``FIELDS``), advantages by verl's estimator."""
    if estimator not in DIVERT_ESTIMATORS:
        raise ReplayInputError(f"algorithm.adv_estimator={estimator}: a diverted group's advantages are computed "
                               f"from its rewards; supported: {sorted(DIVERT_ESTIMATORS)}")
    L = max(r["responses"].numel() for r in rows)
    scores = torch.zeros(len(rows), L)
    mask = torch.zeros(len(rows), L)
    for i, r in enumerate(rows):
        scores[i, :r["rm_scores"].numel()] = r["rm_scores"].float()
        mask[i, :r["response_mask"].numel()] = r["response_mask"].float()
    kw = {"norm_adv_by_std_in_grpo": norm_by_std} if estimator == "grpo" else {}
    adv, _ = DIVERT_ESTIMATORS[estimator](token_level_rewards=scores, response_mask=mask,
                                          index=np.asarray([uid] * len(rows), dtype=object), **kw)
    prompt = rows[0]["prompts"]
    if any(not torch.equal(r["prompts"], prompt) for r in rows[1:]):
        raise ReplayInputError(f"uid {uid!r}: rows share the uid but not the prompt")
    lps = [r["rollout_log_probs"].float() for r in rows]
    group_rows = rows_from_responses(prompt, [r["responses"] for r in rows], lps,
                                     loss_masks=[r["response_mask"] for r in rows],
                                     advantages=response_level(adv, mask, estimator=estimator),
                                     rewards=scores.sum(-1), extras={"rollout_logprobs": lps})
    return one_group(group_rows, step=birth_step, group_id=f"stale{birth_step}:{uid}")


class HDRReplayBufferAsync(ReplayBufferAsync):
    """verl's ``ReplayBufferAsync`` that keeps a copy of every stale finished group before evicting it.

    ``diverted``: (GroupRecord, span) pairs not yet taken by the trainer (:meth:`take_diverted`); ``problems``:
    uids that could not be stored (row count != n, no rollout log-probs, ...).  :meth:`attach` (called by the
    recipe's trainer) gives it the group size, the estimator and ``parameter_sync_step``; unattached it behaves
    exactly like verl's sampler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.diverted: list[GroupRecord] = []
        self.problems: list[str] = []
        self.captured = 0  # stale groups read before verl's eviction (diverted + problems)
        self.settings: dict | None = None

    def attach(self, *, group_size: int, estimator: str, norm_by_std: bool, parameter_sync_step: int) -> None:
        self.settings = {"n": int(group_size), "estimator": str(estimator), "norm_by_std": bool(norm_by_std),
                         "p": int(parameter_sync_step)}

    def take_diverted(self) -> list[GroupRecord]:
        out, self.diverted = self.diverted, []
        return out

    def _evict_terminal_groups(self, global_steps, partition_id, eviction_reasons):
        stale, dapo, failed, _ = eviction_reasons
        keep = sorted(set(stale) - set(dapo) - set(failed))
        if keep and partition_id != "val" and self.settings is not None:
            self._capture(partition_id, keep)
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    def _capture(self, partition_id: str, uids: list[str]) -> None:
        s = self.settings
        keys = sorted(k for k in self.partitions[partition_id] if k.split("_")[0] in set(uids))
        if not keys:
            return
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=list(FIELDS))
        rows_of: dict[str, list[dict]] = {}
        unbind = {f: list(data[f].unbind(0)) for f in FIELDS}
        for i, key in enumerate(keys):
            rows_of.setdefault(key.split("_")[0], []).append({f: unbind[f][i] for f in FIELDS})
        for uid in uids:
            self.captured += 1
            rows = rows_of.get(uid, [])
            if len(rows) != s["n"]:
                self.problems.append(f"stale uid {uid!r}: {len(rows)} rows, expected rollout.n={s['n']}")
                continue
            birth = int(self.prompt_global_steps[partition_id].get(uid, 0)) * s["p"]
            try:
                self.diverted.append(stale_group(uid, rows, birth_step=birth, estimator=s["estimator"],
                                                 norm_by_std=s["norm_by_std"]))
            except ReplayInputError as e:
                self.problems.append(str(e))
