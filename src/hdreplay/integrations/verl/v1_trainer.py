"""Headroom-Drift Replay on verl's v1 ``PPOTrainer`` (``trainer.use_v1=true``), at one seam.

verl 0.9.1's v1 step (``PPOTrainer._step_once``) samples the fresh batch from verl's own rollout buffer
(DAPO's ``algorithm.filter_groups`` and the staleness bound act there), balances and pads it, computes
old / reference log-probs and advantages in TransferQueue, then calls ``_update_actor(batch, metrics)``.
There the fresh rows carry pi_old log-probs and advantages and the weights are still the ones that computed
them.  :class:`HDRTrainerMixin` overrides:

* ``_update_actor(batch, metrics)``:
    1. reads the fresh rows (``tq.kv_batch_get``) and builds one group per uid (:mod:`.v1_rows`);
    2. selects replay from the PRE-EXISTING buffer; candidates are re-scored by the worker group's
       ``compute_log_prob`` -- the call ``_compute_old_log_prob`` makes for fresh rows, with the same
       ``rollout.temperature`` -- on rows written to a scratch partition (not through
       ``_compute_old_log_prob`` itself: that needs ``rollout_log_probs``, writes metrics, and in
       ``separate_async`` restores the pi_old weights first, which would measure Drift against pi_old);
    3. stages this step's ingress;
    4. writes the replay rows and zero-loss padding rows into the batch's partition, builds one
       ``KVBatchMeta`` ``[replay ; fresh ; padding]`` permuted for verl's dispatch and mini-batch iteration
       (:mod:`.minibatches`: replay fills the first mini-batches; padding only the last), calls verl's own
       ``_update_actor`` on it, and removes the replay and padding rows again;
    5. commits and adds ``replay/*`` to the step metrics; returns the *fresh* meta, so ``fit``'s metrics,
       rollout dump and TransferQueue cleanup stay on fresh rows.
* ``_save_checkpoint`` / ``_load_checkpoint`` (:class:`.checkpoints.ReplayCheckpoints`): the controller in
  ``global_step_N/hdreplay`` written before verl's save (so before ``latest_checkpointed_iteration.txt``),
  restored from the folder verl resumes from.
* ``fit``: writes the final per-group lifetime records.

The replay step counter is the actor-update counter ``global_steps * parameter_sync_step + local_trigger_step``
(= ``global_steps`` for ``sync`` / ``colocate_async``), so in ``separate_async`` a group is never replayed
before a weight update since its birth.  With ``hdr.selector=none`` (or ``hdr.k_rep=0``) the trainer is verl's.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import transfer_queue as tq
import verl.trainer.main_ppo as _main_ppo
import verl.trainer.ppo.v1.trainer_base as _tb
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.utils.padding import response_from_nested

from ...controller import ReplayController
from ...diagnostics import observers
from ...store.record import GroupRecord
from ..common import scan_budget
from .checkpoints import ReplayCheckpoints
from .minibatches import actor_order, layout_metrics, padding_needed
from .mm import POSITIONS
from .settings import validate_verl_config, warn_drift_floor
from .v1_rows import fresh_groups, padding_rows, replay_rows, score_fields, scoring_rows

#: TransferQueue partition of the rows being re-scored (empty between calls)
SCORE_PARTITION = "hdr_score"


def _put(keys: list[str], partition: str, fields: list[dict], tags: list[dict]) -> None:
    if keys:
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)


def _clear(keys: Sequence[str], partition: str) -> None:
    if keys:  # tq.kv_clear([]) raises
        tq.kv_clear(keys=list(keys), partition_id=partition)


class HDRTrainerMixin(ReplayCheckpoints):
    """Headroom-Drift Replay for a v1 ``PPOTrainer`` subclass; configured by the ``hdr`` config section."""

    def __init__(self, config):
        self.hdr = validate_verl_config(config)  # fail before verl builds anything
        warn_drift_floor(config, self.hdr)
        super().__init__(config)
        self.replay_active = self.hdr.active
        self.replay = ReplayController(self.hdr.replay_config,
                                       diagnostics_dir=self.hdr.diagnostics_dir if self.replay_active else None,
                                       observers=observers(self.hdr.diagnostics, self.hdr.replay_config))
        #: what the last replay step did (selection, keys, layout) - for logging and tests
        self.last_replay: dict | None = None
        #: the staleness rule (hdreplay's async sampler / bypass mode), else None (:mod:`.v1_async`)
        self.async_seam = None
        if self.replay_active:
            from .v1_async import seam_for

            self.async_seam = seam_for(self)
        self._score_calls = 0  # keys of scoring rows are unique per call

    # ------------------------------------------------------------------ helpers
    def _update_step(self) -> int:
        """Strictly increasing per actor update (separate_async runs parameter_sync_step updates per step)."""
        return int(self.global_steps) * int(self.parameter_sync_step) + int(self.local_trigger_step)

    def _actor_dp(self) -> int:
        """Data-parallel size of the actor mesh (what ``_balance_batch`` asks the worker group)."""
        wg = self.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        return max(wg._dispatch_info["actor"]) + 1

    @property
    def _token_id(self) -> int:
        tok = getattr(self, "tokenizer", None)
        for name in ("eos_token_id", "pad_token_id"):
            if getattr(tok, name, None) is not None:
                return int(getattr(tok, name))
        return 0

    def _scan_budget(self) -> dict:
        """The gate's forwards filled as verl's own (:func:`..common.scan_budget`): rows of dp x the inference
        micro-batch, which a log-prob call pads up to anyway, so that room is filled speculatively; its workers are
        GPUs, latency-bound (issue 37)."""
        return scan_budget(self.replay, rows_per_forward=self._score_rows(),
                           group_size=int(self.config.actor_rollout_ref.rollout.n),
                           configured=self.hdr.replay_config.scan_tokens, latency_bound=True)

    def _score_rows(self) -> int:
        """Rows a log-prob call runs in whole: dp x the inference micro-batch (1 with dynamic bsz)."""
        cfg = self.config.actor_rollout_ref
        micro = 1 if cfg.actor.use_dynamic_bsz else int(cfg.rollout.get("log_prob_micro_batch_size_per_gpu") or 1)
        return self._actor_dp() * micro

    def _replay_scorer(self, groups: Sequence[GroupRecord]) -> list[torch.Tensor]:
        """Current-policy log-probs of the groups' stored tokens: G flat ``(T_g,)`` tensors.

        Rows go to :data:`SCORE_PARTITION`, padded with zero-loss rows to a multiple of dp x the inference
        micro-batch (the worker asserts whole micro-batches unless dynamic bsz), then one
        ``actor_rollout_wg.compute_log_prob`` call at ``rollout.temperature``.
        """
        cfg = self.config.actor_rollout_ref
        fields, tags = scoring_rows(groups)
        names = score_fields(groups)
        K = groups[0].mm_inputs[POSITIONS].shape[1] if POSITIONS in groups[0].mm_inputs else None
        n_pad = padding_needed(len(fields), minibatch_rows=self._score_rows())
        pad, pad_tags = padding_rows(n_pad, fields=names, dtypes={}, token_id=self._token_id, uid="hdrpad",
                                     position_rows=K)
        self._score_calls += 1
        tag = f"hdrs{self._update_step()}c{self._score_calls}n"
        keys = [f"{tag}{i}_0_0" for i in range(len(fields) + n_pad)]
        _put(keys, SCORE_PARTITION, fields + pad, tags + pad_tags)
        try:
            meta = KVBatchMeta(partition_id=SCORE_PARTITION, keys=keys, tags=tags + pad_tags, fields=names)
            meta.extra_info.update({"calculate_entropy": False, "compute_loss": False,
                                    "temperature": cfg.rollout.temperature})
            self.actor_rollout_wg.compute_log_prob(meta)
            out = tq.kv_batch_get(keys=keys[:len(fields)], partition_id=SCORE_PARTITION,
                                  select_fields=["log_probs", "response_mask"])
        finally:
            _clear(keys, SCORE_PARTITION)
        rows = list(response_from_nested(out["log_probs"], out["response_mask"]).unbind(0))
        result, i = [], 0
        for g in groups:
            result.append(torch.cat([r.float().cpu() for r in rows[i:i + g.num_responses]]))
            i += g.num_responses
        return result

    def _write_actor_batch(self, batch: KVBatchMeta, fresh, groups: Sequence[GroupRecord], *, step: int,
                           minibatch_rows: int, dp: int) -> tuple[KVBatchMeta, dict]:
        """Put replay + padding rows next to the fresh rows and return the permuted actor meta + info."""
        rep, rep_tags = replay_rows(groups, fields=fresh.fields, dtypes=fresh.dtypes)
        n_pad = padding_needed(len(rep) + len(fresh.rows), minibatch_rows=minibatch_rows)
        pad, pad_tags = padding_rows(n_pad, fields=fresh.fields, dtypes=fresh.dtypes, token_id=self._token_id,
                                     uid=f"hdrpad{step}", position_rows=fresh.position_rows)
        rep_keys = [f"hdrr{step}n{i}_0_0" for i in range(len(rep))]
        pad_keys = [f"hdrp{step}n{i}_0_0" for i in range(n_pad)]
        _put(rep_keys + pad_keys, batch.partition_id, rep + pad, rep_tags + pad_tags)
        keys = rep_keys + [batch.keys[i] for i in fresh.rows] + pad_keys
        tags = rep_tags + [batch.tags[i] for i in fresh.rows] + pad_tags
        lengths = [int(t["seq_len"]) for t in tags]
        order, layout = actor_order(lengths[:len(rep)], lengths[len(rep):], minibatch_rows=minibatch_rows, dp=dp)
        meta = KVBatchMeta(partition_id=batch.partition_id, keys=[keys[i] for i in order],
                           tags=[tags[i] for i in order], fields=list(fresh.fields))
        info = {"keys": keys, "order": order, "layout": layout, "lengths": lengths, "num_replay_rows": len(rep),
                "num_padding_rows": n_pad, "extra_keys": rep_keys + pad_keys,
                "metrics": layout_metrics(layout, lengths, len(rep))}
        return meta, info

    # ------------------------------------------------------------------ the seam
    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if not self.replay_active:
            return super()._update_actor(batch, metrics)
        step = self._update_step()
        cfg = self.config.actor_rollout_ref
        n, dp = int(cfg.rollout.n), self._actor_dp()
        m = int(cfg.actor.ppo_mini_batch_size) * n
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id)
        # vision-language runs: a text-only prompt (or another image layout) is one of the problems, not fatal
        fresh = fresh_groups(data, batch.tags, step=step, group_size=n,
                             estimator=str(self.config.algorithm.adv_estimator), schema=self.replay.buffer.mm_schema)
        seam = self.async_seam
        sel = seam.select(step) if seam else self.replay.select(step=step, scorer=self._replay_scorer,
                                                                          **self._scan_budget())
        if seam:
            seam.stage(fresh.groups, step=step, data=data, tags=batch.tags)
        else:
            self.replay.stage(fresh.groups, step=step)
        actor, info = self._write_actor_batch(batch, fresh, sel.groups, step=step, minibatch_rows=m, dp=dp)
        try:
            super()._update_actor(actor, metrics)
        finally:
            _clear(info["extra_keys"], batch.partition_id)
        replay = (seam.commit if seam else self.replay.commit)(num_fresh_groups=fresh.num_uids)
        rec = self.replay.last_record
        replay.update(info["metrics"])
        replay.update({"replay/accepted_gate": float(rec.accepted_gate), "replay/truncated": float(rec.truncated),
                       "replay/rows": float(info["num_replay_rows"]),
                       "replay/padding_rows": float(info["num_padding_rows"]),
                       "replay/ingress_skipped": float(len(fresh.problems))})
        metrics.update({k: v for k, v in replay.items() if v == v})  # NaN (nothing scanned) is left out
        self.last_replay = {"step": step, "selection": sel, "problems": fresh.problems, **info}
        return batch

    def fit(self, agent_loop_manager):
        result = super().fit(agent_loop_manager)
        if self.replay_active:
            self.replay.close()
        return result


class HDRPPOTrainerSync(HDRTrainerMixin, PPOTrainerSync):
    """verl's v1 ``PPOTrainerSync`` (``trainer.v1.trainer_mode=sync``) with Headroom-Drift Replay."""


class HDRPPOTrainerColocateAsync(HDRTrainerMixin, PPOTrainerColocateAsync):
    """verl's v1 ``PPOTrainerColocateAsync`` (``trainer_mode=colocate_async``) with Headroom-Drift Replay."""


class HDRPPOTrainerSeparateAsync(HDRTrainerMixin, PPOTrainerSeparateAsync):
    """verl's v1 ``PPOTrainerSeparateAsync`` (``trainer_mode=separate_async``) with Headroom-Drift Replay."""


#: verl's ``trainer.v1.trainer_mode`` -> the recipe's trainer
HDR_TRAINERS = {"sync": HDRPPOTrainerSync, "colocate_async": HDRPPOTrainerColocateAsync,
                "separate_async": HDRPPOTrainerSeparateAsync}


@contextlib.contextmanager
def registry_entry(mode: str, cls: type):
    """Make verl's ``get_trainer_cls(mode)`` return ``cls`` (``register_trainer`` refuses to rebind a name)."""
    saved = _tb.TRAINER_REGISTRY[mode]
    _tb.TRAINER_REGISTRY[mode] = cls
    try:
        yield
    finally:
        _tb.TRAINER_REGISTRY[mode] = saved


class HDRTaskRunnerV1(_main_ppo.TaskRunnerV1.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` building the recipe's trainer for ``trainer.v1.trainer_mode`` (runs inside its
    own Ray actor process, so the registry swap happens there)."""

    def run(self, config):
        validate_verl_config(config)
        mode = config.trainer.v1.trainer_mode
        with registry_entry(mode, HDR_TRAINERS[mode]):
            return super().run(config)
