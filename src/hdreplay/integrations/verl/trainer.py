"""HDRRayPPOTrainer: verl's v0 RayPPOTrainer with Headroom-Drift Replay, at one seam.

What it overrides, and why (everything else, including ``fit``'s step body, is verl's):

* ``_update_actor(batch)``: at this point verl has generated, rewarded, computed ``old_log_probs``
  (and ``ref_log_prob``) and advantages for the fresh batch, and the weights are still those that
  produced them.  The override
    1. stores the step's groups (one per ``uid``) and runs the selection on the PRE-EXISTING buffer,
       re-scoring candidates through ``_compute_old_log_prob`` on chunks padded to the dp size
       (times the inference micro-batch, which verl's worker also requires);
    2. stages this step's ingress (groups whose rewards are not all equal, or the answer rule);
    3. builds ``[replay ; fresh]`` (replay rows carry stored tokens, ``response_mask``, generation-time
       log-probs as ``old_log_probs``, stored advantages, stored ``ref_log_prob``), permuted so that every
       rank trains replay in the first mini-batches with balanced token loads, and calls verl's own
       ``_update_actor`` on it;
    4. commits (refresh scanned caches, append ingress, evict FIFO) and merges ``replay/*`` metrics.
* ``_save_checkpoint`` / ``_load_checkpoint`` (:class:`.checkpoints.ReplayCheckpoints`, shared with the
  v1 recipe): writes the controller to ``global_step_N/hdreplay`` *before* verl writes
  ``latest_checkpointed_iteration.txt``, prunes states of checkpoints verl no longer keeps, restores
  ``hdreplay/`` from the checkpoint verl resumes from.
* ``fit``: writes the final per-group lifetime records.

With ``hdr.selector=none`` (or ``hdr.k_rep=0``) none of this runs and the trainer is RayPPOTrainer.
"""

from __future__ import annotations

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from ...controller import ReplayController
from ...diagnostics import observers
from ..common import scan_budget
from .actor_batch import build_actor_batch
from .checkpoints import ReplayCheckpoints
from .dataproto import groups_from_batch, scoring_batch
from .settings import validate_verl_config, verl_truncate_multiple, warn_drift_floor


class HDRRayPPOTrainer(ReplayCheckpoints, RayPPOTrainer):
    """``RayPPOTrainer`` with Headroom-Drift Replay; configured by the ``hdr`` config section."""

    RESUME_HONOURS_HDFS = True  # v0's _load_checkpoint does not resume when trainer.default_hdfs_dir is set

    def __init__(self, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        self.hdr = validate_verl_config(config)  # fail before verl builds dataloaders
        warn_drift_floor(config, self.hdr)
        super().__init__(*args, **kwargs)
        self.replay_active = self.hdr.active
        self.replay = ReplayController(
            self.hdr.replay_config,
            diagnostics_dir=self.hdr.diagnostics_dir if self.replay_active else None,
            observers=observers(self.hdr.diagnostics, self.hdr.replay_config),
        )
        #: what the last replay step did (rows, layout, selection) - for logging and tests
        self.last_replay: dict | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def _pad_token_id(self) -> int:
        tok = getattr(self, "tokenizer", None)
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        return int(pad) if pad is not None else 0

    def _actor_dp(self) -> int:
        return self._get_dp_size(self.actor_rollout_wg, "actor")

    def _scoring_divisor(self) -> int:
        """Rows a log-prob batch must be a multiple of: dp (nd-dispatch chunks equally) times the worker's
        inference micro-batch (``prepare_micro_batches`` asserts whole micro-batches unless dynamic bsz)."""
        cfg = self.config.actor_rollout_ref
        micro = 1 if cfg.actor.use_dynamic_bsz else int(cfg.rollout.get("log_prob_micro_batch_size_per_gpu") or 1)
        return self._actor_dp() * micro

    def _scan_budget(self) -> dict:
        """The gate's forwards filled as verl's own: a log-prob call runs in micro-batches of dp x the inference
        micro-batch rows and pads up to them, so that room is filled speculatively; its workers are GPUs,
        latency-bound (issue 37; ``hdr.scan_tokens`` sets the budget instead)."""
        return scan_budget(self.replay, rows_per_forward=self._scoring_divisor(),
                           group_size=int(self.config.actor_rollout_ref.rollout.n),
                           configured=self.hdr.replay_config.scan_tokens, latency_bound=True)

    def _replay_scorer(self, groups):
        """Scorer for the core selection: current-policy log-probs of the groups' stored tokens.

        One ``_compute_old_log_prob`` call on the groups' rows (padded with verl's
        ``pad_dataproto_to_divisor`` to a multiple of dp x the inference micro-batch); returns G flat
        ``(T_g,)`` tensors.
        """
        temperature = self.config.actor_rollout_ref.rollout.temperature
        data, pg = scoring_batch(groups, pad_token_id=self._pad_token_id, meta_info={"temperature": temperature})
        padded, pad = pad_dataproto_to_divisor(data, self._scoring_divisor())
        padded.meta_info["global_token_num"] = padded.batch["attention_mask"].sum(dim=-1).tolist()
        out, _mfu = self._compute_old_log_prob(padded)
        lp = unpad_dataproto(out, pad).batch["old_log_probs"].float().cpu()
        return pg.split_by_group(lp)

    # ------------------------------------------------------------------ the seam
    def _update_actor(self, batch: DataProto) -> DataProto:
        if not self.replay_active:
            return super()._update_actor(batch)
        step = int(self.global_steps)
        cfg = self.config.actor_rollout_ref
        n, dp = int(cfg.rollout.n), self._actor_dp()
        m = int(cfg.actor.ppo_mini_batch_size) * n
        u_dp = verl_truncate_multiple(ppo_mini_batch_size=int(cfg.actor.ppo_mini_batch_size), n=n, dp=dp)
        if self.hdr.replay_config.truncate_multiple % u_dp:
            raise RuntimeError(f"actor data-parallel size {dp} does not divide ppo_mini_batch_size * rollout.n = {m} "
                               "rows; verl's update needs whole per-rank mini-batches")
        if len(batch) % m:
            raise RuntimeError(f"fresh batch of {len(batch)} rows is not a multiple of the mini-batch ({m} rows)")

        groups, problems, num_uids = groups_from_batch(
            batch, step=step, group_size=n, estimator=str(self.config.algorithm.adv_estimator),
            schema=self.replay.buffer.mm_schema)
        sel = self.replay.select(step=step, scorer=self._replay_scorer, **self._scan_budget())
        self.replay.stage(groups, step=step)
        actor_batch, info = build_actor_batch(sel.groups, batch, minibatch_rows=m, dp=dp,
                                              pad_token_id=self._pad_token_id)
        out = super()._update_actor(actor_batch)

        metrics = self.replay.commit(num_fresh_groups=num_uids)
        metrics.update(info["metrics"])
        metrics["replay/rows"] = float(info["num_replay_rows"])
        metrics["replay/truncated"] = float(len(sel.truncated))
        metrics["replay/ingress_skipped"] = float(len(problems))
        out.meta_info.setdefault("metrics", {}).update({k: v for k, v in metrics.items() if v == v})  # drop NaN
        self.last_replay = {"step": step, "selection": sel, "problems": problems, **info}
        return out

    def fit(self):
        result = super().fit()
        if self.replay_active:
            self.replay.close()
        return result
