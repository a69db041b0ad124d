"""The staleness rule inside the v1 recipe's ``_update_actor`` (hdreplay's sampler and/or verl's bypass mode).

Active when ``trainer.v1.sampler.custom_sampler`` is :class:`.v1_sampler.HDRReplayBufferAsync` or
``algorithm.rollout_correction.bypass_mode=true``.  The recipe's controller is then driven through
:class:`hdreplay.staleness.AsyncReplay`:

* fresh groups are offered as fresh (full Headroom-Drift Replay: mixed ones enter the buffer, as without this seam);
* groups the sampler diverted since the last update are offered at their birth step: beyond the fresh bound
  (``max_off_policy_threshold x parameter_sync_step - 1`` updates, exactly the spans verl evicts) mixed ones enter
  the buffer, zero-variance ones are dropped and counted;
* the scan gates sampler-referenced groups -- the diverted ones, and every group in bypass mode, whose stored
  log-probs are ``rollout_log_probs`` -- on ``max(Drift - floor, 0) <= tau``.

The floor: in decoupled mode the fresh rows generated with the current weights carry both ``old_log_probs``
(training engine) and ``rollout_log_probs`` (sampler), so their squared difference is the floor, measured with no
forward.  In bypass mode ``old_log_probs`` are the rollout ones, so up to :data:`FLOOR_PROBE_GROUPS` such groups per
update are re-scored by the training engine (the scan's own ``compute_log_prob`` call) to measure it.

Replayed rows carry their stored log-probs as ``old_log_probs``: for a diverted group (and any group in bypass
mode) the sampler's, the denominator verl's bypass-mode loss uses for fresh rows too.

Checkpoints: the rule's state (floor, ledger, diverted groups tracked) is saved with the controller in
``global_step_N/hdreplay`` (:mod:`hdreplay.staleness.state`), with the sampler's counters (groups captured, problems);
a checkpoint without it is refused unless ``hdr.resume_without_state``.  The sampler's diverted groups are always
taken by the update that follows their eviction, before verl saves; verl restores its own rollout state
(TransferQueue, the dataloader).
"""

from __future__ import annotations

from ...errors import CheckpointError
from ...staleness import AsyncReplay, StalenessConfig
from .async_settings import bypass_mode, uses_hdr_sampler
from .v1_sampler import HDRReplayBufferAsync

#: staleness-0 fresh groups re-scored per update to measure the floor in bypass mode
FLOOR_PROBE_GROUPS = 2


def _get(cfg, dotted: str, default=None):
    from .settings import _get as get

    return get(cfg, dotted, default)


class AsyncSeam:
    """What the recipe's ``_update_actor`` calls instead of the controller (select / stage / commit)."""

    def __init__(self, trainer) -> None:
        cfg = trainer.config
        get = lambda k, d=None: _get(cfg, k, d)  # noqa: E731
        self.trainer, self.bypass = trainer, bypass_mode(get)
        p = int(trainer.parameter_sync_step)
        thr = get("trainer.v1.sampler.max_off_policy_threshold", None)
        self.sampler = trainer.replay_buffer if isinstance(trainer.replay_buffer, HDRReplayBufferAsync) else None
        if self.sampler is not None:
            self.sampler.attach(group_size=int(cfg.actor_rollout_ref.rollout.n),
                                estimator=str(cfg.algorithm.adv_estimator),
                                norm_by_std=bool(get("algorithm.norm_adv_by_std_in_grpo", True)), parameter_sync_step=p)
        bound = int(thr) * p - 1 if thr is not None else 2**40
        self.areplay = AsyncReplay(trainer.replay, StalenessConfig(fresh_bound=bound, ingest_fresh=True),
                                   diagnostics_dir=trainer.hdr.diagnostics_dir,
                                   resume_without_state=trainer.hdr.resume_without_state,
                                   resume_option="hdr.resume_without_state")
        self.areplay.routing_parser = _parse_sampler_state

    @classmethod
    def for_trainer(cls, trainer) -> "AsyncSeam | None":
        get = lambda k, d=None: _get(trainer.config, k, d)  # noqa: E731
        return cls(trainer) if uses_hdr_sampler(get) or bypass_mode(get) else None

    def select(self, step: int):
        return self.areplay.select(step=step, scorer=self.trainer._replay_scorer)

    def stage(self, groups, *, step: int, data, tags) -> None:
        for g in groups:
            self.areplay.offer(g, step=step, sampler_reference=self.bypass)
        if self.sampler is not None:
            for g in self.sampler.take_diverted():
                self.areplay.offer(g, step=step, sampler_reference=True)
        self._observe_floor(groups, data, tags)

    def commit(self, *, num_fresh_groups: int) -> dict[str, float]:
        metrics = self.areplay.commit(num_fresh_groups=num_fresh_groups)
        if self.sampler is not None:
            metrics["async/sampler_problems"] = float(len(self.sampler.problems))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def before_save(self) -> None:
        """What rides with the controller's save: the sampler's counters (its diverted groups are all taken)."""
        if self.sampler is not None and self.sampler.diverted:  # verl 0.9.1 evicts only inside its step's sampling
            raise CheckpointError(f"{len(self.sampler.diverted)} diverted groups not yet offered to the staleness rule "
                                  "at a checkpoint: they would be lost on resume (a verl loop that evicts after the "
                                  "update is not supported)")
        s = self.sampler
        self.areplay.routing = None if s is None else {"captured": s.captured, "problems": list(s.problems)}

    def after_load(self) -> None:
        routing, self.areplay.routing = self.areplay.routing, None
        if routing is not None and self.sampler is not None:
            self.sampler.captured, self.sampler.problems = routing["captured"], list(routing["problems"])

    # ------------------------------------------------------------------ the floor
    def _current_uids(self, data, tags) -> set[str]:
        """uids of the fresh rows generated entirely with the weights this update starts from."""
        t = self.trainer
        if int(getattr(t, "local_trigger_step", 0)) != 0:
            return set()
        version = int(t.global_steps) - 1
        uids = [str(u) for u in data["uid"]]
        by_uid: dict[str, bool] = {}
        for u, tag in zip(uids, tags):
            if tag.get("is_padding", False):
                continue
            ok = tag.get("min_global_steps") == version and tag.get("max_global_steps") == version
            by_uid[u] = by_uid.get(u, True) and ok
        return {u for u, ok in by_uid.items() if ok}

    def _observe_floor(self, groups, data, tags) -> None:
        uids = self._current_uids(data, tags)
        if not uids:
            return
        if not self.bypass:  # old_log_probs (trainer) vs rollout_log_probs (sampler): free
            if "rollout_log_probs" not in data.keys():
                return
            sq, cnt = {}, {}
            rows = zip([str(u) for u in data["uid"]], data["old_log_probs"].unbind(0),
                       data["rollout_log_probs"].unbind(0), data["response_mask"].unbind(0), tags)
            for u, old, roll, m, tag in rows:
                if u in uids and not tag.get("is_padding", False):
                    m = m.bool()
                    sq[u] = sq.get(u, 0.0) + float(((old.float() - roll.float())[m] ** 2).sum())
                    cnt[u] = cnt.get(u, 0) + int(m.sum())
            keep = [u for u in sq if cnt[u]]
            self.areplay.observe_floor([sq[u] / cnt[u] for u in keep], [cnt[u] for u in keep])
            return
        probe = [g for g in groups if str(g.group_id).split(":", 1)[-1] in uids][:FLOOR_PROBE_GROUPS]
        if not probe:
            return
        current = self.trainer._replay_scorer(probe)
        drifts = [float(((c - g.logprobs)[g.loss_mask] ** 2).mean()) for g, c in zip(probe, current)]
        self.areplay.observe_floor(drifts, [g.num_loss_tokens for g in probe])


def _parse_sampler_state(d) -> dict:
    if not (isinstance(d, dict) and set(d) == {"captured", "problems"} and isinstance(d["captured"], int)
            and not isinstance(d["captured"], bool) and d["captured"] >= 0 and isinstance(d["problems"], list)
            and all(isinstance(x, str) for x in d["problems"])):
        raise CheckpointError(f"the sampler's state must be {{captured: int >= 0, problems: [str]}}, got {d!r:.80}")
    return dict(d)


def seam_for(trainer) -> AsyncSeam | None:
    return AsyncSeam.for_trainer(trainer)


__all__ = ["AsyncSeam", "FLOOR_PROBE_GROUPS", "seam_for"]
