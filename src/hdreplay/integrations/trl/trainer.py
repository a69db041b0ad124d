"""HDRGRPOTrainer: GRPOTrainer with Headroom-Drift Replay, at one seam.

One replay step = one optimizer update; its state is one :class:`~.step.ReplayStep`.  Read it top
to bottom (every override post-processes what TRL produced; nothing of TRL's is copied):

1. ``_prepare_inputs`` -> ``_generate_and_score_completions``: TRL generates and scores as usual (vLLM
   or transformers; TRL's own weight sync).  The first generation of an update opens a ReplayStep at
   ``state.global_step``; every generation records its rows, rewards (``_calculate_rewards``) and
   generation-time log-probs (TRL's ``old_per_token_logps``, or captured in step 3).  The first one
   also selects replay groups (re-scored on the current weights, sharded over ranks).
2. ``_prepare_inputs``: TRL's own method generates, shuffles and splits the fresh rows; each of its micro-batches
   gets this rank's replay rows as extra chunks (:class:`~.microstep.MicroStep`).
3. ``compute_loss``: TRL's loss on the fresh micro-batch, then on each replay chunk (at most
   ``per_device_train_batch_size`` rows; forward + backward each), scaled so the sum is TRL's loss on
   the merged micro-batch (:func:`chunk_scales`); the entropy bonus and router loss counted once
   (:mod:`.terms`); every part but the last defers gradient sync and is no accumulation boundary, under DDP,
   DeepSpeed ZeRO and FSDP2 alike (:mod:`.sharded`).  ``replay_micro_step="grow"`` runs one merged
   forward instead.  Fresh rows' log-probs are captured from their own forward when TRL computed none.
4. ``on_step_end`` (after the optimizer step): the step's groups are gathered from all ranks,
   staged and committed; ``replay/*`` metrics join TRL's log of that step.
5. ``_save_checkpoint``: the replay state goes into ``checkpoint-N/hdreplay`` before the Trainer's
   rotation may delete the previous checkpoint (:mod:`.checkpoints`); ``train(resume_from_checkpoint=...)``
   restores it before the Trainer loads anything (``True``: the newest complete checkpoint).

With ``replay_selector="none"`` none of this runs and the trainer is plain ``GRPOTrainer``.
"""

from __future__ import annotations

import inspect
import os
import warnings
from contextlib import contextmanager, nullcontext

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from ...store.multimodal import schema_of
from ...store.padding import pad_groups
from ..common import restore, scan_budget
from . import mm, terms
from .agreement import check_rank_agreement, selection_digest
from .batch import ReplayStep, check_keys, gather_objects, gather_rows, generation_groups, ingress_rows, replay_rows
from .checkpoints import HDReplayRun, resumed_run, save_with_replay
from .checks import check_padding_drift
from .config import as_replay_config
from .microstep import MicroStep, merged, replay_chunks
from .nodes import check_settings, resume_together
from .peers.exgrpo import split_off
from .peers.strategies import build_strategy
from .positions import install_position_ids, padding_drift
from .reference import refresh_reference
from .rescore import can_share_prompt, rescore_batches, share_pays, shared_prompt_logps
from .sharded import backward_kwargs, deferred_sync, shards_parameters

_INIT = inspect.signature(GRPOTrainer.__init__)


class _CommitAfterUpdate(TrainerCallback):
    """Commits the open replay step once its optimizer update has been applied."""

    def __init__(self, trainer: "HDRGRPOTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._commit_step()


class HDRGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with Headroom-Drift Replay; configure it with :class:`HDRGRPOConfig` (a plain
    ``GRPOConfig`` is converted with the default replay settings and a warning; ``args=None`` builds a
    default ``HDRGRPOConfig`` as ``GRPOTrainer`` builds a default ``GRPOConfig``)."""

    _capture: tuple | None = None  # (generation, part) while one fresh part's loss forward runs
    _terms: terms.PartTerms | None = None  # a part's entropies / router loss while its loss runs

    def __init__(self, *args, **kwargs):
        bound = _INIT.bind(None, *args, **kwargs)
        bound.arguments["args"] = as_replay_config(bound.arguments.get("args"), bound.arguments["model"])
        mm.check_model(bound.arguments.get("processing_class"), bound.arguments["model"])
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._is_vlm = mm.check_setup(self.processing_class, self.train_dataset, replay=self.args.replay_selector,
                                      micro_step=self.args.replay_micro_step)
        a = self.args
        settings = a.replay_settings()  # built and validated once, with the config (not again here)
        self.replay_plan, self.replay_config = settings.plan, settings.config
        self._seam = build_strategy(self)  # controller + hooks of the run's strategy (trl/strategies.py)
        self.replay, self.replay_active = self._seam.controller, self._seam.active
        self._replay_step: ReplayStep | None = None  # the open step (one optimizer update)
        self._gated_update: int | None = None  # the optimizer update whose gate admitted the buffered replay rows
        self._step_offset: int | None = None  # replay step = global_step + offset (0 unless train() is called again)
        self.replay_padding_drift: float | None = None
        self._position_hook = None
        if self.replay_active:
            unwrapped = self.accelerator.unwrap_model(self.model)
            self._position_hook = install_position_ids(unwrapped)
            self._share_prompt = (can_share_prompt(unwrapped) and not self._is_vlm and self._position_hook is not None
                                  and not shards_parameters(self.accelerator))  # see .sharded
            # first in line: user callbacks' on_step_end (step timers, loggers) see the step committed
            self.callback_handler.callbacks.insert(0, _CommitAfterUpdate(self))
            self.add_callback(HDReplayRun())  # the run id in trainer_state.json (checkpoints.py)

    # ------------------------------------------------------------------ 1. generation and selection
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        wrap = self._seam.generation
        if (self._replay_step is not None or wrap is not None) and self.model.training:
            w = self.reward_weights.to(rewards_per_func.device)
            total = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)  # global (N,)
            if wrap is not None:  # a strategy that builds the batch reads them (trl/strategies.py)
                wrap.rewards = total
            else:
                self._replay_step.current.rewards = total
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        wrap = self._seam.generation
        if wrap is not None and not self.replay_active and self.model.training:  # on-policy (dynamic sampling)
            return self._wrapped_generation(inputs, step=self.state.global_step)
        if not (self.replay_active and self.model.training):
            return super()._generate_and_score_completions(inputs)
        if self._replay_step is None:
            if self._step_offset is None:  # a second train() call restarts global_step; replay steps must increase
                last, now = self.replay.last_step, self.state.global_step
                self._step_offset = 0 if last is None or now > last else last + 1 - now
            self._replay_step = ReplayStep(index=self.state.global_step + self._step_offset)
        step = self._replay_step
        gen = step.open_generation()
        if wrap is not None:  # the strategy builds the batch (ExGRPO, BAPO, POPO); gen.rewards are the batch's
            out = self._wrapped_generation(inputs, step=step.index)
            gen.rewards = wrap.batch_rewards
        else:
            out = super()._generate_and_score_completions(inputs)
        check_keys(out)
        if self._is_vlm:
            gen.mm_rows, gen.mm_why = mm.row_inputs(out)
        if gen.rewards is None:
            raise RuntimeError("HDRGRPOTrainer: rewards of this generation batch were not captured")
        B, C = out["completion_ids"].shape
        gen.rows = ingress_rows(out, pad_token_id=self._tokenizer.pad_token_id,
                                masked_truncated=self.mask_truncated_completions)
        if "old_per_token_logps" in out:  # TRL's own forward at the generation weights: pi_gen exactly
            gen.gen_logps = out["old_per_token_logps"]
        else:  # captured from each fresh row's training forward (before this update)
            gen.start_capture(B, C, self.accelerator.device)
            if "hdr_off" in out:  # injected stored rows: their generation log-probs are the stored ones
                idx = out["hdr_off"].nonzero().flatten()
                gen.capture(idx, out["hdr_off_logps"][idx])
        out["hdr_row"] = torch.arange(B, device=self.accelerator.device)
        if len(step.generations) == 1:
            if self._is_vlm:
                mm.check_images(self, out, gen)
            self._select(step)
            if step.selection.groups:
                out["num_items_in_batch"] = out["num_items_in_batch"] + step.replay_tokens
        return out

    def _wrapped_generation(self, inputs, *, step: int):
        """The strategy's generation hook around TRL's own generation; its counters join TRL's log."""
        wrap = self._seam.generation
        out = wrap.generate(inputs, super()._generate_and_score_completions, step=step)
        for k, v in wrap.metrics.items():
            self._metrics["train"][k].append(v)
        return out

    def _select(self, step: ReplayStep) -> None:
        if self.replay_padding_drift is None and not self._is_vlm:  # a VLM is checked on a real row (mm.check_images)
            self._check_padding_invariance()
        if self._seam.observe is not None:  # a prompt-conditioned strategy (RePO) sees the batch's prompts first
            self._seam.observe(step.current.rows)
        sel = step.selection = self.replay.select(step=step.index, scorer=self._replay_scorer, **self._scan_budget())
        check_rank_agreement(self.accelerator, step.index, selection_digest(step.index, sel, self.replay))
        if not sel.groups:
            return
        W, r, dev = self.accelerator.num_processes, self.accelerator.process_index, self.accelerator.device
        per = sum(g.num_responses for g in sel.groups) // W  # whole by the truncation unit
        rows = replay_rows(sel.groups, slice(r * per, (r + 1) * per), pad_token_id=self._tokenizer.pad_token_id,
                           loss_weights=sel.loss_weights)
        rows = mm.to_device(rows, dev)
        if "importance_sampling_ratio" in rows and self.vllm_importance_sampling_mode.startswith("sequence"):
            rows["importance_sampling_ratio"] = rows["importance_sampling_ratio"].amax(dim=1, keepdim=True)
        if "ref_per_token_logps" in rows and self._ref_syncs():
            self._refresh_reference(step, rows, slice(r * per, (r + 1) * per))
        step.replay_rows = per
        step.replay_tokens = sum(g.num_loss_tokens for g in sel.groups)
        step.replay_part = rows

    # ------------------------------------------------------------------ re-scoring
    @property
    def _score_batch_size(self) -> int:
        return self.args.replay_score_batch_size or self.args.per_device_train_batch_size

    def _scan_budget(self) -> dict:
        """How the gate fills its forwards (:func:`..common.scan_budget`): the rows of TRL's own old-log-prob forward,
        ``_score_batch_size`` on every rank; latency-bound (speculative scoring, whole groups at high acceptance) off
        the CPU only, where a partly filled forward costs what a full one does (a CPU pays per token)."""
        return scan_budget(self.replay, rows_per_forward=self.accelerator.num_processes * self._score_batch_size,
                           group_size=self.args.num_generations, configured=self.args.replay_scan_tokens,
                           latency_bound=self.accelerator.device.type != "cpu")

    def _logps(self, input_ids, attention_mask, logits_to_keep, model=None, **mm_inputs):
        """Per-token log-probs through TRL's own forward (same temperature, autocast, fused head); a VLM's rows
        pass their TRL multimodal keys (:func:`.mm.batch_inputs`)."""
        model = self.model if model is None else model
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=self._score_batch_size,
                **mm.to_device(mm_inputs, input_ids.device))
        return logps

    def _row_logps(self, groups, rows: list[int], pg=None) -> torch.Tensor:
        """(len(rows), C) current log-probs of rows ``rows`` of ``pg = pad_groups(groups)`` through TRL's full-row
        forward (columns no row of them needs are trimmed before the forward and zero-filled after it)."""
        pg = pg if pg is not None else pad_groups(groups, pad_token_id=self._tokenizer.pad_token_id)
        idx = torch.as_tensor(rows)
        pm, cm = pg.prompt_mask[idx], pg.completion_mask[idx]
        P, C = int(pm.sum(1).max()), int(cm.sum(1).max())
        ids = torch.cat([pg.prompt_ids[idx][:, -P:], pg.completion_ids[idx][:, :C]], 1).to(self.accelerator.device)
        mask = torch.cat([pm[:, -P:], cm[:, :C]], 1).to(self.accelerator.device)
        images = mm.batch_inputs([groups[int(g)].mm_inputs for g in pg.row_group[idx].tolist()], pm[:, -P:], C)
        out = torch.zeros(len(rows), pg.completion_ids.shape[1])
        out[:, :C] = self._logps(ids, mask, C, **images).float().cpu()
        return out

    def _shared_logps(self, groups, min_batches: int) -> torch.Tensor:
        """(R, C) current log-probs of ``groups``' rows (``pad_groups`` layout), one prompt pass per group, in at
        least ``min_batches`` forward calls (filler calls repeat the first batch: every rank runs as many)."""
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return shared_prompt_logps(self.accelerator.unwrap_model(self.model), groups,
                                       pad_token_id=self._tokenizer.pad_token_id, device=self.accelerator.device,
                                       max_rows=self._score_batch_size, autocast=self.accelerator.autocast,
                                       min_batches=min_batches)

    def _replay_scorer(self, groups):
        """Current-policy log-probs of ``groups`` (whole groups or response slices of them, :mod:`hdreplay.scan`).

        The forwards are sharded over ranks and every rank runs the same number of forward calls whatever the
        groups' sizes (ZeRO-3 / FSDP gather parameters inside each forward): the full-row path gives each rank
        ceil(R / W) rows (the last rank repeats a filler row); the prompt-shared path gives each rank
        ceil(G / W) groups and pads every rank to the largest number of forward calls."""
        acc = self.accelerator
        W, r, G = acc.num_processes, acc.process_index, len(groups)
        pg = pad_groups(groups, pad_token_id=self._tokenizer.pad_token_id)
        R = pg.num_rows
        if self._share_prompt and share_pays(groups):  # decided on all groups: the same on every rank
            per = -(-G // W)
            shards = [[groups[min(i, G - 1)] for i in range(q * per, (q + 1) * per)] for q in range(W)]
            calls = max(len(rescore_batches(s, self._score_batch_size)) for s in shards)
            logps = self._shared_logps(shards[r], calls)
            sizes = [sum(g.num_responses for g in s) for s in shards]
            logps = torch.cat([logps, logps.new_zeros(max(sizes) - logps.shape[0], logps.shape[1])])
            if W > 1:
                logps = acc.gather(acc.pad_across_processes(logps.to(acc.device), dim=1, pad_index=0)).cpu()
            blocks = logps.split(max(sizes))
            logps = torch.cat([b[:n] for b, n in zip(blocks, sizes)])
        else:
            per = -(-R // W)
            logps = self._row_logps(groups, [min(i, R - 1) for i in range(r * per, (r + 1) * per)], pg)
            if W > 1:
                logps = acc.gather(acc.pad_across_processes(logps.to(acc.device), dim=1, pad_index=0)).cpu()
        return pg.split_by_group(logps[:R])

    def _mm_schema(self):
        """The buffer's multimodal schema (None for the text-only per-prompt stores of RePO, ExGRPO and BAPO)."""
        buffer = getattr(self.replay, "buffer", None)
        return None if buffer is None else buffer.mm_schema

    def _check_padding_invariance(self, err: float | None = None) -> None:
        if err is None:
            cfg = self.accelerator.unwrap_model(self.model).config
            err = padding_drift(lambda i, m, k: self._logps(i, m, k),
                                vocab_size=int(getattr(cfg.get_text_config(), "vocab_size", 2)),
                                pad_token_id=self._tokenizer.pad_token_id, device=self.accelerator.device)
        model = self.accelerator.unwrap_model(self.model)
        low = self.args.bf16 or self.args.fp16 or any(  # a model loaded in bf16 (TRL's dtype="auto") without args.bf16
            p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
        self.replay_padding_drift = check_padding_drift(err, low_precision=low, model=model)

    # ------------------------------------------------------------------ reference model syncs (beta != 0)
    def _ref_syncs(self) -> int | None:
        a = self.args
        return (a.ref_model_sync_steps if (a.sync_ref_model and self.beta != 0.0 and self.ref_model is not None)
                else None)

    def _refresh_reference(self, step: ReplayStep, rows: dict, sl: slice) -> None:
        births = torch.tensor([g.birth_step for g in step.selection.groups for _ in range(g.num_responses)])[sl]
        step.ref_refreshed = refresh_reference(rows, births, step=step.index, sync_every=self._ref_syncs(),
                                               ref_logps=lambda *a, **k: self._logps(*a, model=self.ref_model, **k))

    # ------------------------------------------------------------------ 2. micro-steps
    def _prepare_inputs(self, generation_batch):
        if not (self.replay_active and self.model.training):
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        before = self._buffered_inputs
        super()._prepare_inputs(generation_batch)  # TRL generates, shuffles and splits (or hands out its buffer)
        if self._buffered_inputs is not before:  # a new generation: TRL's own micro-batches, plus the replay chunks
            self._buffered_inputs = self._with_replay(list(self._buffered_inputs), spg)
        micro = self._buffered_inputs[self._step % spg]
        if micro.replay and self._gated_update != self.state.global_step \
                and self._seam.part_loss is None \
                and self.args.replay_train_scope == "update":  # a later update: its gate no longer vouches for them
            micro = MicroStep(micro.fresh, [], micro.generation)
        return micro

    def _with_replay(self, fresh: list[dict], spg: int) -> list[MicroStep]:
        """The generation's micro-steps: each of TRL's fresh micro-batches with its replay chunks."""
        step = self._replay_step
        gen = step.current
        first = gen is step.generations[0] and step.replay_rows
        replay = [[] for _ in fresh]
        if self._seam.part_loss is not None:  # ExGRPO's injected rows: a chunk of their own, the shaped loss
            fresh, offs = zip(*(split_off(f) for f in fresh))
            replay = [[o] if o is not None else [] for o in offs]
        if first:  # (never with ExGRPO: it selects no replay groups)
            steps = spg if self.args.replay_train_scope == "generation" else self._micro_steps_left(spg)
            replay = replay_chunks(step.replay_part, spg=steps, max_rows=self.args.per_device_train_batch_size,
                                   num_items=fresh[0]["num_items_in_batch"]) + [[] for _ in range(spg - steps)]
            self._gated_update = self.state.global_step
            for chunk in (c for cs in replay for c in cs if "hdr_mm" in c):  # TRL's flat image layout per chunk
                images = mm.batch_inputs(chunk.pop("hdr_mm"), chunk["prompt_mask"].cpu(),
                                         chunk["completion_ids"].shape[1])
                chunk.update(mm.to_device(images, chunk["prompt_mask"].device))
            step.replay_part = None
        capture = gen if gen.needs_capture else None
        return [MicroStep(f, r, capture) for f, r in zip(fresh, replay)]

    def _micro_steps_left(self, spg: int) -> int:
        """Micro-steps of the generation that run in the current optimizer update (replay_train_scope="update")."""
        ga = self.args.gradient_accumulation_steps
        return max(1, min(spg, ga - self._step % ga))

    # ------------------------------------------------------------------ 3. the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(inputs, MicroStep):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.args.replay_micro_step == "grow" and inputs.replay:
            parts = [merged(inputs, pad_token_id=self._tokenizer.pad_token_id)]
        else:
            parts = [inputs.fresh, *inputs.replay]
        done = None
        scales = self._seam.loss_scales(self.loss_type, parts)  # TRL's loss on the merged batch (RePO: on + off)
        keep = [i for i, p in enumerate(parts) if p["prompt_ids"].shape[0]]  # an all-injected fresh part is empty
        parts, scales = [parts[i] for i in keep], [scales[i] for i in keep]
        loss_shares, token_shares = terms.shares(parts)
        coef = terms.applied_entropy_coef(self)  # before the controller may step (in the last part)
        for i, (part, w) in enumerate(zip(parts, scales)):
            last = i == len(parts) - 1
            with (nullcontext() if last else deferred_sync(self.accelerator, model)), \
                    self._capturing(inputs.generation if i == 0 and keep[0] == 0 else None, part), \
                    self._capturing_terms() as captured:
                loss = (self._shaped_loss(model, part) if "hdr_shaped_logps" in part
                        else super().compute_loss(model, part)) * w
                loss = loss + terms.correction(self, part, captured, weight=w, loss_share=loss_shares[i],
                                               token_share=token_shares[i], entropy_coef=coef)
                if not last:  # earlier parts: their own backward now, so one part's activations are alive at a time
                    self.accelerator.backward(loss, **backward_kwargs(self.accelerator))
                    done = loss.detach() if done is None else done + loss.detach()
        return loss if done is None else loss + done

    def _shaped_loss(self, model, part: dict) -> torch.Tensor:
        return self._seam.part_loss(model, part)  # ExGRPO's policy-shaped term on injected rows

    @contextmanager
    def _capturing(self, generation, part):
        self._capture = (generation, part) if (generation is not None or part.get("hdr_fill_old")) else None
        try:
            yield
        finally:
            self._capture = None

    @contextmanager
    def _capturing_terms(self):
        """Keep what the part's loss forward returns besides log-probs (entropies, router loss, entropy mask)."""
        self._terms = terms.PartTerms()
        try:
            yield self._terms
        finally:
            self._terms = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        if self._terms is not None and not self._terms.seen and kwargs.get("compute_entropy"):
            self._terms.entropies, self._terms.aux, self._terms.seen = out[1], out[2], True
        if self._capture is not None:  # the policy forward of one fresh part's loss (the first call in it)
            gen, part = self._capture
            self._capture = None
            logps, rows = out[0].detach(), part["hdr_row"]
            fresh = rows >= 0
            if part.get("hdr_fill_old"):
                part["old_per_token_logps"][fresh] = logps[fresh].to(part["old_per_token_logps"].dtype)
            if gen is not None:
                gen.capture(rows[fresh], logps[fresh])
        return out

    # ------------------------------------------------------------------ 4. commit
    def _commit_step(self) -> None:
        step, self._replay_step = self._replay_step, None
        if step is None:
            return
        groups, empty, problems, fresh = [], 0, [], 0
        for gi, gen in enumerate(step.generations):
            rows = gather_rows(self.accelerator, gen.ingress_rows(), pad_token_id=self._tokenizer.pad_token_id)
            mm_rows, mm_why = (gather_objects(self.accelerator, gen.mm_rows),
                               gather_objects(self.accelerator, gen.mm_why))
            schema = self._mm_schema()
            if schema is None and groups:
                schema = schema_of(groups[0].mm_inputs)
            got = generation_groups(rows, gen.rewards, num_generations=self.args.num_generations, step=step.index,
                                    id_prefix=f"s{step.index}.{gi}g", mm_rows=mm_rows, mm_why=mm_why, schema=schema)
            groups += got.groups
            empty += len(got.empty)
            problems += got.problems
            fresh += got.num_groups
        if problems:
            warnings.warn(f"hdreplay: {len(problems)} group(s) of step {step.index} not eligible for the buffer, "
                          f"e.g. {problems[0]}", stacklevel=2)
        self.replay.stage(groups, step=step.index)
        metrics = self.replay.commit(num_fresh_groups=fresh)
        metrics["replay/ingress_empty"] = float(empty)
        metrics["replay/ingress_skipped"] = float(len(problems))
        metrics["replay/truncated"] = float(len(step.selection.truncated))
        metrics["replay/generations"] = float(len(step.generations))
        if self._ref_syncs():
            metrics["replay/ref_refreshed"] = float(step.ref_refreshed)
        for k, v in metrics.items():
            if v == v:  # TRL averages what is appended; skip NaN (e.g. no scan this step)
                self._metrics["train"][k].append(v)

    # ------------------------------------------------------------------ 5. checkpoints
    def _save_checkpoint(self, model, trial):
        if not self.replay_active:
            return super()._save_checkpoint(model, trial)
        save_with_replay(self, model, trial, save_trainer=super()._save_checkpoint,
                         write_state=lambda path, identity: self.replay.save(path, allow_open_step=True,
                                                                             identity=identity))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.replay_active:
            check_settings(self)  # every node runs the same replay settings (nodes.py)

            def load(path, identity):
                restore(self.replay, path, allow_missing=self.args.replay_resume_without_state,
                        option="replay_resume_without_state", expect=identity)
                resumed_run(self, identity)

            # every rank sees the checkpoint, or every rank refuses by name; then loaded, main process last
            resume_from_checkpoint = resume_together(self, resume_from_checkpoint, load=load)
        if self._is_vlm and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            # transformers#43701: the Trainer's resume skips the weights a VLM saved under their original key names;
            # load them converted first (the Trainer then loads the keys it can map: the same values)
            path = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True \
                else resume_from_checkpoint
            if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
                mm.reload_converted_weights(self.model, str(path))
        self._step_offset = None
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.replay_active:
            self.replay.close()
        return result
