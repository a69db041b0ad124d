"""HDRAsyncGRPOTrainer: TRL 1.16's async GRPO trainer with Drift-gated staleness, at one seam.

TRL (``trl.experimental.async_grpo``) trains on a stream of rollout samples that a worker generated with an older
policy; its dataset drops every sample more than ``max_staleness`` versions behind.  This trainer post-processes
that stream and keeps everything else of TRL's (dataset, batcher, tree packing, collator, loss, weight sync):

1. ``__init__``: TRL's trainer is built as usual; then (rank 0) ``trainer.rollout_queue`` is replaced by a
   :class:`~.async_queue.GroupRoutingQueue`, which TRL's dataset reads: fresh groups pass unchanged, stale mixed
   groups are diverted, stale zero-variance groups dropped, and admitted replay groups are emitted first.
2. ``get_train_dataloader`` (rank 0): TRL's collator additionally writes each packed sample's ``group_id``
   (``hdr_segment_group``), so ``compute_loss`` can attribute its own log-probs to samples: per-sample Drift
   against the sampler comes free from the loss's forward (a forward hook reads the log-probs TRL computed).
   Staleness-0 fresh groups give the sampler-vs-trainer floor; the rest is logged for calibration.
3. ``on_step_end`` (every rank, after TRL's weight sync): rank 0 broadcasts what it routed and measured; every
   rank applies it to its own replica of the controller (:class:`~hdreplay.staleness.AsyncReplay`), commits the
   update, then selects the next update's replay groups, re-scoring the candidates sharded over the ranks
   (:func:`~.async_rows.tree_logprobs`, TRL's own packing and model call) and gathering the results; rank 0 hands
   the admitted groups to the proxy.  ``async/*`` (the ledger) and ``replay/*`` metrics join TRL's log.

4. Checkpoints (``_save_checkpoint``, ``train``): the controller, the staleness rule's state and rank 0's routing
   state go into ``checkpoint-N/hdreplay`` in the synchronous trainer's crash-safe order
   (:func:`.checkpoints.save_with_replay`); a resume restores them before the Trainer loads anything (a checkpoint
   without them is refused unless ``replay_resume_without_state``) and, at train begin, re-makes the selection the
   interrupted run had made for the next update (:mod:`.async_resume` says what is saved and what TRL's rollout
   stream loses).

Steps: the controller's step of the update at global step u is ``u - 1`` (the updates its policy has seen), a
sample's ``birth_step`` is ``model_version - 1`` (less the version shift of a resumed run), so ages are TRL's
staleness.  TRL's dataloader prefetches one micro-batch, so replay selected after update u lands in update u + 1 only
when the rest of that step has room (gradient_accumulation_steps >= 2); ``async/replay_landing_delay_mean`` reports it.
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from functools import partial

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from transformers import TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOTrainer

from ....controller import ReplayController
from ....errors import ReplayConfigError, ReplayResumeWarning
from ....staleness import AsyncReplay, plan_problems
from ...common import restore
from ..checkpoints import HDReplayRun, resumed_run, save_with_replay
from ..nodes import check_settings, resume_together
from .config import HDRAsyncGRPOConfig
from .resume import apply_routing, parse_routing, routing_state
from .routing import GroupRoutingQueue
from .rows import tree_logprobs

SEGMENT_KEY = "hdr_segment_group"


class _AfterWeightSync(TrainerCallback):
    def __init__(self, trainer: "HDRAsyncGRPOTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # after TRL's: the weights are synced
        self.trainer._begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_update()

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.accelerator.is_main_process:
            self.trainer.areplay.controller.close()


def check_async_plan(args: HDRAsyncGRPOConfig, world: int) -> list[str]:
    """Refusals and warnings of a configuration, before TRL builds anything; returns the warnings."""
    if not isinstance(args, HDRAsyncGRPOConfig):
        raise TypeError(f"HDRAsyncGRPOTrainer: args must be an HDRAsyncGRPOConfig, got {type(args).__name__}")
    rc, sc = args.to_replay_config(), args.to_staleness_config()
    n, S = args.num_generations, args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    micro = args.per_device_train_batch_size * world
    errors = []
    if args.weight_sync_steps != 1:
        errors.append(f"weight_sync_steps={args.weight_sync_steps}: the staleness rule counts policy versions as "
                      "updates; set weight_sync_steps=1")
    if args.token_budget is None or args.token_budget > 0:
        errors.append(f"token_budget={args.token_budget}: token-budgeted micro-batches make the samples per step vary, "
                      "so replay groups cannot be placed into a step; set token_budget=0 (fixed-count batches)")
    if S % n:
        errors.append(f"per_device_train_batch_size x gradient_accumulation_steps x processes = {S} samples per step "
                      f"is not a multiple of num_generations={n}; a step must hold whole groups")
    inflight = args.max_inflight_tasks if args.max_inflight_tasks >= 0 else max(args.max_staleness, 1) * S
    e, warns = plan_problems(capacity=rc.capacity, k_rep=rc.k_rep, groups_per_step=max(S // n, 1),
                             supply_groups=inflight // n, fresh_bound=args.max_staleness, drift_norm=rc.drift_norm,
                             sampler_reference=True, floor_initial=sc.floor_initial,
                             names={"capacity": "replay_capacity", "k_rep": "replay_k_rep", "fresh_bound":
                                    "max_staleness", "drift_norm": "replay_drift_norm", "floor_initial":
                                    "staleness_floor_initial", "supply": "max_inflight_tasks / num_generations"})
    errors += e
    if rc.k_rep * n > S - micro:
        warns.append(f"replay_k_rep={rc.k_rep} groups = {rc.k_rep * n} samples, but after the micro-batch TRL's "
                     f"dataloader has already fetched only {S - micro} of the step's {S} samples are left: the rest "
                     "of the replay lands one update later than its Drift was measured for (raise "
                     "gradient_accumulation_steps or lower replay_k_rep)")
    if errors:
        raise ReplayConfigError("HDRAsyncGRPOTrainer: incompatible configuration:\n  - " + "\n  - ".join(errors))
    return warns


class HDRAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose stale groups go to hdreplay instead of being dropped; configure it with
    :class:`.async_config.HDRAsyncGRPOConfig`.  Constructor arguments are ``AsyncGRPOTrainer``'s."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        if args is None:
            args = HDRAsyncGRPOConfig(f"{str(model).rstrip('/').split('/')[-1]}-AsyncGRPO")
        for w in check_async_plan(args, PartialState().num_processes):  # before TRL builds anything
            warnings.warn(f"hdreplay async: {w}", UserWarning, stacklevel=2)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        main = self.accelerator.is_main_process
        diag = args.replay_diagnostics_dir or os.path.join(args.output_dir, "hdreplay")
        rc = args.to_replay_config()
        self.areplay = AsyncReplay(ReplayController(rc, diagnostics_dir=diag if main else None),
                                   args.to_staleness_config(), diagnostics_dir=diag if main else None,
                                   resume_without_state=args.replay_resume_without_state,
                                   resume_option="replay_resume_without_state")
        self.samples_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                                 * self.accelerator.num_processes)
        self.areplay.routing_parser = partial(parse_routing, samples_per_step=self.samples_per_step)
        self._resuming = False  # a checkpoint was restored: train begin re-makes its open selection
        #: the resumed run's first selection (for update N + 1 after checkpoint N), for logging and tests
        self.resume_selection: list | None = None
        if main:
            self.rollout_queue = GroupRoutingQueue(
                self.rollout_queue, n=args.num_generations, fresh_bound=args.max_staleness,
                version_fn=lambda: self.model_version, mixed_fn=self.areplay.controller._admit,
                samples_per_step=self.samples_per_step, max_divert_age=args.staleness_max_divert_age,
                warn_after_s=args.replay_supply_warn_s, timeout_s=args.replay_supply_timeout_s)
        self._drift_log: list = []  # rank 0: (group_id, squared-difference sum, tokens) per trained sample
        self._intended: dict = {}  # rank 0: replay group id -> the global step it was selected for
        #: per update, what the replay step did (every rank; for logging and tests)
        self.replay_log: list[dict] = []
        self.add_callback(_AfterWeightSync(self))  # after TRL's weight-sync callback
        self.add_callback(HDReplayRun())  # the run id in trainer_state.json (checkpoints.py)

    # ------------------------------------------------------------------ per-sample Drift from the loss's forward
    def get_train_dataloader(self):
        dl = super().get_train_dataloader()
        if self.accelerator.is_main_process:
            collator = getattr(dl, "base_dataloader", dl).collate_fn
            inner = collator.torch_call

            def torch_call(examples):
                batch = inner(examples)
                (rows,) = examples
                ids = torch.full((len(rows), max(len(r.samples) for r in rows)), -1, dtype=torch.long)
                for r, row in enumerate(rows):
                    for i, s in enumerate(row.samples):
                        ids[r, i] = int(s["group_id"])
                batch[SEGMENT_KEY] = ids
                return batch

            collator.torch_call = torch_call
        return dl

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seg = inputs.pop(SEGMENT_KEY)
        captured = {}
        hook = self.accelerator.unwrap_model(model).register_forward_hook(
            lambda m, a, out: captured.__setitem__("lp", out.log_probs.detach()))
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        with torch.no_grad():
            sel = inputs["token_index"] >= 0
            lp = captured["lp"].flatten()[inputs["token_index"][sel]].float().cpu()
            old, sid = inputs["old_log_probs"][sel].float().cpu(), inputs["segment_id"][sel].cpu()
            k = int(sid.max()) + 1 if sid.numel() else 0
            sq = torch.zeros(k).index_add_(0, sid, (lp - old) ** 2)
            cnt = torch.zeros(k).index_add_(0, sid, torch.ones_like(old))
            mine = list(zip(seg.reshape(-1)[:k].tolist(), sq.tolist(), cnt.tolist()))
        parts = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        if self.accelerator.is_main_process:
            self._drift_log.extend(x for part in parts for x in part)
        return loss

    # ------------------------------------------------------------------ the replay step
    def _scorer(self, groups):
        """Current log-probs of ``groups``, re-scored sharded over the ranks (one forward per rank) and gathered."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        shard = groups[rank::world]
        model = self.accelerator.unwrap_model(self.model)
        with self.compute_loss_context_manager():
            lps = tree_logprobs(model, shard or groups[:1], device=self.accelerator.device)
        mine = lps if shard else []
        parts = gather_object([mine]) if world > 1 else [mine]
        return [parts[i % world][i // world] for i in range(len(groups))]

    def _measurements(self, landed: dict) -> dict:
        """Rank 0: per group trained in this update, token-weighted Drift against the sampler, by kind; the floor
        samples are fresh groups trained at the version they were generated with (the trainer's weights are the
        sampler's)."""
        per = defaultdict(lambda: [0.0, 0.0])
        for gid, sq, cnt in self._drift_log:
            per[gid][0] += sq
            per[gid][1] += cnt
        self._drift_log = []
        kinds = self.rollout_queue.kind_of
        out = {"floor": ([], []), "drift": defaultdict(lambda: [0.0, 0.0]), "delays": []}
        for gid, (sq, cnt) in per.items():  # trained in this update, by the policy after update global_step - 1
            kind, birth = kinds.get(gid, ("fresh", -1))
            label = "replay" if kind == "replay" else ("fresh0" if birth == self.state.global_step - 1 else "fresh")
            out["drift"][label][0] += sq
            out["drift"][label][1] += cnt
            if label == "fresh0" and cnt:
                out["floor"][0].append(sq / cnt)
                out["floor"][1].append(int(cnt))
        for gid, marks in landed.items():
            for kind, step in marks:
                if kind == "replay" and gid in self._intended:
                    out["delays"].append(step - self._intended.pop(gid))
        out["drift"] = dict(out["drift"])
        out["fresh_groups"] = len({gid for gid, marks in landed.items()
                                   if any(kd == "fresh" and st == self.state.global_step for kd, st in marks)})
        return out

    def _after_update(self) -> None:
        main, u = self.accelerator.is_main_process, self.state.global_step
        payload = None
        if main:
            routed, landed = self.rollout_queue.drain(u)
            payload = {"routed": routed, "landed": landed, **self._measurements(landed)}
        if self.accelerator.num_processes > 1:
            payload = broadcast_object_list([payload], from_process=0)[0]
        ar = self.areplay
        for r in payload["routed"]:
            got = ar.offer(r.group, step=r.step, sampler_reference=True)
            if got != r.route:  # one rule, two evaluations: they cannot differ unless versions were mislabelled
                raise RuntimeError(f"group {r.group.group_id}: routed {r.route!r} at version {r.version} but the "
                                   f"staleness rule says {got!r} at step {r.step}")
        ar.observe_floor(*payload["floor"])
        metrics = ar.commit(num_fresh_groups=payload["fresh_groups"]) if ar.is_open else {}
        sel = ar.select(step=u, scorer=self._scorer)
        if main:
            self.rollout_queue.enqueue_replay(sel.groups)
            self._intended.update({g.group_id: u + 1 for g in sel.groups})
        for label, (sq, cnt) in payload["drift"].items():
            if cnt:
                metrics[f"async/sample_drift_{label}_mean"] = sq / cnt
        if payload["delays"]:
            metrics["async/replay_landing_delay_mean"] = sum(payload["delays"]) / len(payload["delays"])
        for key, v in metrics.items():
            if v == v:
                self._metrics["train"][key].append(float(v))
        routed = [(r.group.group_id, r.route, r.staleness) for r in payload["routed"]]
        self.replay_log.append({"step": u, "routed": routed,
                                "selected": [g.group_id for g in sel.groups], "delays": payload["delays"],
                                "metrics": metrics, "landed": payload["landed"]})

    # ------------------------------------------------------------------ checkpoints (see the module doc, 4.)
    def _save_checkpoint(self, model, trial):
        routing = routing_state(self.rollout_queue, step=self.state.global_step, intended=self._intended) \
            if self.accelerator.is_main_process else None
        if self.accelerator.num_processes > 1:  # rank 0 routes; another node's first rank may write a copy too
            routing = broadcast_object_list([routing], from_process=0)[0]

        def write_state(path, identity):
            self.areplay.routing = routing
            try:  # the state as of the last commit
                self.areplay.controller.save(path, allow_open_step=True, identity=identity)
            finally:
                self.areplay.routing = None

        save_with_replay(self, model, trial, save_trainer=super()._save_checkpoint, write_state=write_state)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        check_settings(self)  # every node runs the same replay settings (nodes.py)

        def load(path, identity):
            # the routing state must be of the checkpoint's step too (checked with the rest, before any file changes)
            self.areplay.routing_parser = partial(parse_routing, samples_per_step=self.samples_per_step,
                                                  step=identity["global_step"])
            restore(self.areplay.controller, path, allow_missing=self.args.replay_resume_without_state,
                    option="replay_resume_without_state", expect=identity)
            resumed_run(self, identity)
            self._resuming = True

        # every rank sees the checkpoint, or every rank refuses by name; then loaded, main process last (nodes.py)
        resume_from_checkpoint = resume_together(self, resume_from_checkpoint, load=load)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _known_group_ids(self, routing) -> set:
        """The group ids a resumed run's restored state holds outside the routing queue (which adds its own; see
        GroupRoutingQueue.resumed)."""
        buf = self.areplay.controller.buffer
        ids = set(buf.group_ids(buf.insertion_ids())) | set(self.areplay.tracked) | set(self._intended)
        return ids | set(routing["selected"]) if routing is not None else ids

    def _begin(self) -> None:
        """Train begin (every rank, after TRL's first weight sync): set the version shift; on a resume, hand the
        restored routing to the proxy and re-make the selection the interrupted run had made for this update."""
        main, u = self.accelerator.is_main_process, self.state.global_step
        routing, self.areplay.routing = self.areplay.routing, None
        if main:
            self.rollout_queue.version_shift = self.model_version - (u + 1)
            if routing is not None:
                self._intended = apply_routing(self.rollout_queue, routing)
            elif self._resuming:  # no routing state (replay_resume_without_state): steps count on from TRL's
                self.rollout_queue.emitted = u * self.samples_per_step
            if self._resuming:
                self.rollout_queue.resumed(self._known_group_ids(routing))
        if not self._resuming:
            return
        self._resuming = False
        self.model.train()  # as at the end of an update, where the interrupted run selected
        sel = self.areplay.select(step=u, scorer=self._scorer)
        self.resume_selection = [g.group_id for g in sel.groups]
        if main:
            self.rollout_queue.enqueue_replay(sel.groups)
            self._intended.update({g.group_id: u + 1 for g in sel.groups})
            if routing is not None and routing["selected"] != self.resume_selection:
                warnings.warn(f"hdreplay async: the resumed run selected {self.resume_selection} for update {u + 1}, "
                              f"the interrupted run had selected {routing['selected']}: re-scoring with the restored "
                              "weights did not reproduce its Drift (a non-deterministic forward?)", ReplayResumeWarning,
                              stacklevel=2)
