"""HDRGRPOTrainer: GRPOTrainer with Headroom-Drift Replay, at one seam.

What it overrides, and why (everything else is TRL's):

* ``_calculate_rewards``: keeps the global per-row rewards TRL computes (needed for ingress).
* ``_generate_and_score_completions``: post-processes TRL's output.  It records every fresh
  row's generation-time log-probs (one no-grad forward when TRL did not compute
  ``old_per_token_logps``), gathers the step's groups from all ranks so every rank holds the
  same buffer, runs the replay selection (re-scoring sharded over ranks), stages ingress, and
  prepends this rank's share of the replay rows: ``[replay rows ; fresh rows]`` with stored
  log-probs as ``old_per_token_logps``, stored advantages, stored loss mask as ``tool_mask``,
  and ``num_items_in_batch`` counting the replay tokens.
* ``_prepare_inputs`` (train branch): shuffles the fresh rows only and splits the batch into
  micro-steps in order, so replay rows fill the first micro-steps and no row is dropped.
* ``training_step``: commits the replay step once its last micro-step has run.
* ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: the controller is saved into
  ``checkpoint-N/hdreplay`` and restored on ``resume_from_checkpoint``.
* ``train``: writes the final per-group lifetime records.

With ``replay_selector="none"`` none of this runs and the trainer is plain ``GRPOTrainer``.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from transformers import ProcessorMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict

from ...controller import ReplayController
from ...padding import pad_groups
from ..common import STATE_DIR, restore, trim_rows
from ...selection import Selection
from .config import HDRGRPOConfig
from .positions import active_dropout, install_position_ids, padding_drift
from .batch import check_keys, concat_rows, groups_from_rows, replay_rows, split_rows, take_rows

#: max |d logp| tolerated between paddings of one sequence (fp32 / low-precision autocast)
PADDING_TOLERANCE = {"fp32": 1e-4, "low": 3e-2}


class HDRGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with Headroom-Drift Replay; configure it with :class:`HDRGRPOConfig`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, HDRGRPOConfig):
            raise TypeError(
                f"HDRGRPOTrainer needs args=HDRGRPOConfig(...), got {type(self.args).__name__}; the replay "
                "settings live in HDRGRPOConfig's replay_* fields"
            )
        if isinstance(self.processing_class, ProcessorMixin) or getattr(self, "_is_vlm", False):
            raise ValueError("HDRGRPOTrainer does not support multimodal models yet (per-image tensors are not "
                             "stored with replayed groups); use a text-only model or replay_selector='none'")
        a = self.args
        if a.replay_selector != "none":
            live = active_dropout(self.accelerator.unwrap_model(self.model))
            if live:
                raise ValueError(
                    f"the model has active dropout ({', '.join(live[:3])}{', ...' if len(live) > 3 else ''}): "
                    "training-mode log-probs are then random, so stored generation log-probs and the Drift gate "
                    "measure dropout noise instead of policy change. Set disable_dropout=True in HDRGRPOConfig."
                )
        W, spg = self.accelerator.num_processes, a.steps_per_generation
        # replay rows per rank must be whole and divisible into the micro-steps of a generation
        per_group = a.num_generations
        auto_u = (W * spg) // math.gcd(per_group, W * spg)
        self.replay_config = a.to_replay_config(extra_multiple=auto_u)
        self.replay_active = self.replay_config.selector != "none"
        diag = a.replay_diagnostics_dir
        if diag is None:
            diag = os.path.join(a.output_dir, "replay")
        self.replay = ReplayController(
            self.replay_config,
            diagnostics_dir=diag if (diag and self.accelerator.is_main_process and self.replay_active) else None,
        )
        self._replay_sel: Selection | None = None
        self._replay_pending: dict | None = None
        self._replay_capture: torch.Tensor | None = None
        self._replay_captured: torch.Tensor | None = None
        self._loss_inputs: dict | None = None
        self._replay_rows_local = 0
        self._replay_rewards: torch.Tensor | None = None
        self._replay_padding_checked = False
        self._position_hook = None
        if self.replay_active:
            self._position_hook = install_position_ids(self.accelerator.unwrap_model(self.model))

    # ------------------------------------------------------------------ rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.replay_active and self.model.training:
            w = self.reward_weights.to(rewards_per_func.device)
            self._replay_rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)  # global (N,)
        return rewards_per_func

    # ------------------------------------------------------------------ forward helpers
    @property
    def _score_batch_size(self) -> int:
        return self.args.replay_score_batch_size or self.args.per_device_train_batch_size

    def _logps(self, input_ids, attention_mask, logits_to_keep):
        """Per-token log-probs through TRL's own forward (same temperature, autocast, fused head)."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=self._score_batch_size
            )
        return logps

    def _check_padding_invariance(self) -> None:
        dev = self.accelerator.device
        err = padding_drift(lambda i, m, k: self._logps(i, m, k), vocab_size=self._vocab_size(),
                            pad_token_id=self._tokenizer.pad_token_id, device=dev)
        low = self.args.bf16 or self.args.fp16
        tol = PADDING_TOLERANCE["low" if low else "fp32"]
        if not err <= tol:
            name = type(self.accelerator.unwrap_model(self.model)).__name__
            raise ValueError(
                f"{name}: the same sequence re-padded changes its log-probs by up to {err:.2e} (> {tol:g}), even with "
                "generation-style position ids; replayed groups could not be re-scored consistently. Use a model "
                "whose forward accepts position_ids (rotary or absolute), or replay_selector='none'."
            )
        self.replay_padding_drift = err

    def _vocab_size(self) -> int:
        cfg = self.accelerator.unwrap_model(self.model).config
        return int(getattr(cfg.get_text_config(), "vocab_size", 2))

    def _replay_scorer(self, groups):
        """Current-policy log-probs of ``groups``, the forward sharded over ranks (same call count everywhere)."""
        pg = pad_groups(groups, pad_token_id=self._tokenizer.pad_token_id)
        R, W, r = pg.num_rows, self.accelerator.num_processes, self.accelerator.process_index
        per = -(-R // W)
        idx = torch.arange(r * per, (r + 1) * per).clamp(max=R - 1)  # the last rank repeats a row as filler
        rows = trim_rows(pg, idx)
        dev = self.accelerator.device
        logps = self._logps(rows.input_ids().to(dev), rows.attention_mask().to(dev),
                            rows.completion_ids.shape[1]).float()
        if W > 1:
            logps = self.accelerator.pad_across_processes(logps, dim=1, pad_index=0)
            logps = self.accelerator.gather(logps)[:R]
        return pg.split_by_group(logps.cpu())

    # ------------------------------------------------------------------ the seam
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not (self.replay_active and self.model.training):
            return out
        check_keys(out)
        return self._with_replay(out)

    def _with_replay(self, out: dict) -> dict:
        acc = self.accelerator
        if not self._replay_padding_checked:
            self._check_padding_invariance()
            self._replay_padding_checked = True
        step = 0 if self.replay.last_step is None else self.replay.last_step + 1
        if self._replay_rewards is None:
            raise RuntimeError("HDRGRPOTrainer: rewards of this generation batch were not captured")
        B, C = out["completion_ids"].shape
        loss_mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        # What ingress needs at commit time. Generation-time log-probs: TRL's own old_per_token_logps when it
        # computed them; otherwise (aligned steps) they are captured from the training forward of each fresh
        # row, which runs before any weight update, so no extra forward pass is spent.
        self._replay_pending = {
            "step": step, "rewards": self._replay_rewards,
            "rows": {"prompt_ids": out["prompt_ids"], "prompt_mask": out["prompt_mask"],
                     "completion_ids": out["completion_ids"], "completion_mask": out["completion_mask"],
                     "loss_mask": loss_mask, "advantages": out["advantages"],
                     **({"ref_logps": out["ref_per_token_logps"]} if "ref_per_token_logps" in out else {})},
            "gen_logps": out.get("old_per_token_logps"),
        }
        self._replay_rewards = None
        capture = out.get("old_per_token_logps") is None
        self._replay_capture = torch.zeros(B, C, device=acc.device) if capture else None
        self._replay_captured = torch.zeros(B, dtype=torch.bool, device=acc.device) if capture else None

        sel = self.replay.select(step=step, scorer=self._replay_scorer)
        self._replay_sel = sel
        fresh = dict(out)
        fresh["hdr_is_replay"] = torch.zeros(B, dtype=torch.bool, device=acc.device)
        fresh["hdr_row"] = torch.arange(B, device=acc.device)
        if not sel.groups:
            self._replay_rows_local = 0
            return fresh
        R = sum(g.num_responses for g in sel.groups)
        W, r = acc.num_processes, acc.process_index
        per = R // W  # whole by construction of the truncation multiple
        fresh.setdefault("tool_mask", torch.ones_like(out["completion_mask"]))
        if capture:  # placeholder: overwritten in place with the rows' own detached log-probs (ratio exactly 1)
            fresh["old_per_token_logps"] = torch.zeros(B, C, device=acc.device)
        pad = self._tokenizer.pad_token_id
        rep = replay_rows(sel.groups, slice(r * per, (r + 1) * per), pad_token_id=pad, keys=set(fresh),
                          device=acc.device)
        merged = concat_rows(rep, {k: v for k, v in fresh.items() if k in rep}, pad_token_id=pad)
        merged["num_items_in_batch"] = out["num_items_in_batch"] + sum(g.num_loss_tokens for g in sel.groups)
        self._replay_rows_local = per
        return merged

    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs if self._replay_sel is not None else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        inp = self._loss_inputs
        if inp is not None and self._replay_capture is not None and "hdr_row" in inp:
            self._loss_inputs = None  # the policy forward of this loss only
            logps, rows = out[0].detach(), inp["hdr_row"]
            fresh = rows >= 0
            if "old_per_token_logps" in inp:  # fresh rows beside replay rows: ratio exactly 1, as in plain TRL
                inp["old_per_token_logps"][fresh] = logps[fresh].to(inp["old_per_token_logps"].dtype)
            c = min(logps.shape[1], self._replay_capture.shape[1])
            self._replay_capture[rows[fresh], :c] = logps[fresh, :c].float()
            self._replay_captured[rows[fresh]] = True
        return out

    def _ingress_groups(self) -> tuple[list, list[str]]:
        """This step's fresh groups (gathered from every rank) with their generation-time log-probs."""
        pend = self._replay_pending
        rows = dict(pend["rows"])
        if pend["gen_logps"] is not None:
            rows["gen_logps"] = pend["gen_logps"].float()
        else:
            if not bool(self._replay_captured.all()):
                raise RuntimeError("HDRGRPOTrainer: some fresh rows were never trained on this step; their "
                                   "generation log-probs are unknown (this is a bug, please report it)")
            rows["gen_logps"] = self._replay_capture
        if "ref_logps" in rows:
            rows["ref_logps"] = rows["ref_logps"].float()
        rows = self._gather_rows(rows)
        return groups_from_rows(rows, pend["rewards"], num_generations=self.args.num_generations,
                                step=pend["step"], id_prefix=f"s{pend['step']}g")

    def _gather_rows(self, rows: dict) -> dict:
        acc = self.accelerator
        if acc.num_processes == 1:
            return rows
        out = {}
        for k, v in rows.items():
            if v.dim() == 2:
                v = acc.pad_across_processes(v, dim=1, pad_index=self._tokenizer.pad_token_id if k.endswith("ids") else 0,
                                             pad_first=k.startswith("prompt"))
            out[k] = acc.gather(v)
        return out

    def _prepare_inputs(self, generation_batch):
        if not (self.replay_active and self.model.training):
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            R = self._replay_rows_local
            n = batch["prompt_ids"].shape[0]
            fresh = shuffle_sequence_dict(take_rows(batch, slice(R, n)))  # TRL's shuffle, fresh rows only
            if R:
                batch = concat_rows(take_rows(batch, slice(0, R)), fresh, pad_token_id=self._tokenizer.pad_token_id)
                batch["num_items_in_batch"] = fresh["num_items_in_batch"]
            else:
                batch = fresh
            self._buffered_inputs = split_rows(batch, spg)
        return self._buffered_inputs[self._step % spg]

    def training_step(self, model, inputs, num_items_in_batch):
        output = super().training_step(model, inputs, num_items_in_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._replay_sel is not None and self._step % generate_every == 0:
            self._commit_replay()
        return output

    def _commit_replay(self) -> None:
        groups, problems = self._ingress_groups()
        if problems:
            warnings.warn(f"hdreplay: {len(problems)} group(s) of step {self._replay_pending['step']} not eligible "
                          f"for the buffer, e.g. {problems[0]}", stacklevel=2)
        self.replay.stage(groups, step=self._replay_pending["step"])
        metrics = self.replay.commit(num_fresh_groups=len(groups) + len(problems))
        self._replay_pending = self._replay_capture = self._replay_captured = None
        metrics["replay/ingress_skipped"] = float(len(problems))
        metrics["replay/truncated"] = float(len(self._replay_sel.truncated))
        self._replay_sel = None
        for k, v in metrics.items():
            if v == v:  # TRL averages what is appended; skip NaN (e.g. no scan this step)
                self._metrics["train"][k].append(v)

    # ------------------------------------------------------------------ checkpointing
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.replay_active:
            return
        ckpt = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.accelerator.is_main_process:  # every rank holds the same buffer
            self.replay.save(os.path.join(ckpt, STATE_DIR), allow_open_step=True)
        self.accelerator.wait_for_everyone()

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.replay_active and checkpoint is not None:
            restore(self.replay, checkpoint, allow_missing=self.args.replay_resume_without_state,
                    option="replay_resume_without_state")

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        if self.replay_active:
            self.replay.close()
        return result
