"""Which controller and generation-seam wrapper an HDRGRPOTrainer runs, from its config (one place for the choice).

=====================  ==========================================  =======================================
setting                controller (select -> stage -> commit)      wrapper of TRL's generation
=====================  ==========================================  =======================================
``replay_selector``    :class:`~hdreplay.controller.ReplayController`  -
``replay_repo``        :class:`~hdreplay.strategies.repo.RepoController`  -
``replay_exgrpo``      :class:`~hdreplay.strategies.exgrpo.ExgrpoController`  :class:`.exgrpo.ExperienceMixer`
``replay_bapo``        :class:`~hdreplay.strategies.bapo.BapoController`  :class:`.bapo.BapoSampler`
``replay_dynamic_...`` (none: on-policy)                         :class:`.dynamic.DynamicSampler`
=====================  ==========================================  =======================================
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...controller import ReplayController
from ...noise_floor import DriftFloorWarning, floor_warning, precision_of
from ...strategies.bapo import BapoController
from ...strategies.exgrpo import ExgrpoController
from ...strategies.repo import RepoController
from .bapo import BapoSampler, check_bapo
from .checks import check_exgrpo, check_supported
from .dynamic import DynamicSampler
from .exgrpo import ExperienceMixer, token_entropies


@dataclass
class Strategy:
    """The trainer's replay machinery: ``controller`` (always set; an inactive ReplayController for plain GRPO),
    ``active`` (the controller takes part in every step), and at most one generation wrapper."""

    controller: Any
    active: bool
    mixer: ExperienceMixer | None = None
    bapo: BapoSampler | None = None
    dynamic: DynamicSampler | None = None


def warn_drift_floor(config, model, args) -> str | None:
    """Warn (:class:`hdreplay.noise_floor.DriftFloorWarning`) when the measured Drift floor of the training precision
    (the model's parameter dtype, ``args.bf16`` / ``args.fp16`` autocast, ``args.cast_lm_head_to_fp32``) reaches tau/10;
    returns the message."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    autocast = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    precision = precision_of(dtype, autocast, fp32_head=bool(getattr(args, "cast_lm_head_to_fp32", False)))
    msg = floor_warning(config, precision)
    if msg:
        warnings.warn(msg, DriftFloorWarning, stacklevel=4)
    return msg


def build_strategy(trainer) -> Strategy:
    """Check ``trainer``'s replay settings against its setup and build what they ask for (errors name the setting)."""
    a = trainer.args
    repo, exgrpo, bapo = a.repo_options(), a.exgrpo_options(), a.bapo_options()
    active = trainer.replay_config.selector != "none" or any(x is not None for x in (repo, exgrpo, bapo))
    procs, pad = trainer.accelerator.num_processes, trainer._tokenizer.pad_token_id
    if active:
        check_supported(a, trainer.replay_plan, trainer.accelerator.unwrap_model(trainer.model),
                        loss_type=trainer.loss_type, processes=procs, vlm=trainer._is_vlm, repo=repo is not None,
                        deepspeed=trainer.is_deepspeed_enabled)
    out = Strategy(controller=None, active=active)
    if repo is not None:
        out.controller = RepoController(repo)
    elif exgrpo is not None:
        check_exgrpo(trainer, a)
        out.controller = ExgrpoController(exgrpo, n=a.num_generations, seed=a.seed)
        out.mixer = ExperienceMixer(out.controller, n=a.num_generations, pad_token_id=pad,
                                    entropies=partial(token_entropies, trainer), scale_rewards=trainer.scale_rewards)
    elif bapo is not None:
        check_bapo(a, processes=procs, vlm=trainer._is_vlm)
        out.bapo = BapoSampler(BapoController(bapo), n=a.num_generations, pad_token_id=pad)
        out.controller = out.bapo.controller
    else:
        diag = a.replay_diagnostics_dir
        if diag is None:
            diag = os.path.join(a.output_dir, "replay")
        out.controller = ReplayController(
            trainer.replay_config,
            diagnostics_dir=diag if (diag and trainer.accelerator.is_main_process and active) else None)
        if active:
            warn_drift_floor(trainer.replay_config, trainer.accelerator.unwrap_model(trainer.model), a)
    if a.replay_dynamic_sampling:
        if procs > 1:
            raise ValueError("replay_dynamic_sampling=True runs on one process only (the group filter needs every "
                             "rank's rewards); launch one process or turn it off")
        out.dynamic = DynamicSampler(trainer.train_dataset, n=a.num_generations, seed=a.seed,
                                     max_batches=a.replay_dynamic_sampling_max_batches, pad_token_id=pad)
    return out
