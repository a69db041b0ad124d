"""What an HDRGRPOTrainer runs, from its config: one :class:`StrategySeam` per run, built in one place.

The trainer calls the seam and never asks which strategy it holds: the controller through the
:class:`~hdreplay.baselines.protocol.Strategy` protocol (select -> stage -> commit, checkpoints), and the seam's
hooks, each None or a default where a strategy needs nothing.

=====================  ==============================================  =======================================
``HDRGRPOConfig``      controller (:mod:`hdreplay.baselines` but the   hooks
                       first)
=====================  ==============================================  =======================================
``replay_selector``    :class:`~hdreplay.controller.ReplayController`  -
``replay_repo``        :class:`~hdreplay.baselines.repo.RepoController`  ``observe`` (the batch's prompts),
                                                                       ``loss_scales`` (on + off_coef x off)
``replay_exgrpo``      :class:`~hdreplay.baselines.exgrpo.ExgrpoController`  ``generation``
                                                                       (:class:`.exgrpo.ExperienceMixer`),
                                                                       ``part_loss`` (the shaped term)
``replay_bapo``        :class:`~hdreplay.baselines.bapo.BapoController`  ``generation`` (:class:`.bapo.BapoSampler`)
``replay_popo``        :class:`~hdreplay.baselines.popo.PopoController`  ``generation`` (:class:`.popo.PopoSampler`)
``replay_dynamic_...`` (an inactive ReplayController: on-policy)       ``generation`` (:class:`.dynamic.DynamicSampler`)
=====================  ==============================================  =======================================

A generation hook wraps TRL's own ``_generate_and_score_completions``: ``generate(inputs, generate_once, *,
step)`` returns the batch to train, reads the round's rewards from its ``rewards`` attribute (set by the trainer's
``_calculate_rewards``) and leaves the returned rows' rewards in ``batch_rewards`` and its counters in ``metrics``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from ....baselines import BapoController, ExgrpoController, PopoController, RepoController
from ....baselines.protocol import Strategy
from ....controller import ReplayController
from ....diagnostics import observers
from ....diagnostics.noise_floor import DriftFloorWarning, floor_warning, precision_of
from ..checks import check_sharding, check_supported
from ..microstep import chunk_scales, separate_term_scales
from .bapo import BapoSampler, check_bapo
from .dynamic import DynamicSampler
from .exgrpo import ExperienceMixer, check_exgrpo, shaped_part_loss, token_entropies
from .popo import PopoSampler, check_popo


@dataclass
class StrategySeam:
    """The trainer's replay machinery.

    Attributes:
        controller: a :class:`~hdreplay.baselines.protocol.Strategy` (an inactive ReplayController for plain GRPO).
        active: the controller takes part in every step.
        generation: wraps TRL's generation (see the module), or None.
        observe: called with the first generation's ingress rows before selection (RePO), or None.
        loss_scales: ``(loss_type, parts) -> weights`` of one micro-step's parts (fresh rows, replay chunks).
        part_loss: ``(model, part) -> loss`` of a part of injected rows (ExGRPO's shaped term), or None.
    """

    controller: Strategy
    active: bool
    generation: Any = None
    observe: Callable[[dict], None] | None = None
    loss_scales: Callable[[str, list], list] = chunk_scales
    part_loss: Callable | None = None


def warn_drift_floor(config, model, args, adaptive=None) -> str | None:
    """Warn (:class:`hdreplay.diagnostics.noise_floor.DriftFloorWarning`) when the measured Drift floor of the training
    precision (the model's parameter dtype, ``args.bf16`` / ``args.fp16`` autocast, ``args.cast_lm_head_to_fp32``)
    reaches tau/10; returns the message."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    autocast = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    precision = precision_of(dtype, autocast, fp32_head=bool(getattr(args, "cast_lm_head_to_fp32", False)))
    msg = floor_warning(config, precision, adaptive=adaptive)
    if msg:
        warnings.warn(msg, DriftFloorWarning, stacklevel=5)
    return msg


def build_strategy(trainer) -> StrategySeam:
    """Check ``trainer``'s replay settings against its setup and build what they ask for (errors name the setting)."""
    a = trainer.args
    name, options = a.strategy()
    active = trainer.replay_config.selector != "none" or name not in ("replay", "dynamic")
    procs, pad = trainer.accelerator.num_processes, trainer._tokenizer.pad_token_id
    if active:
        check_supported(a, trainer.replay_plan, trainer.accelerator.unwrap_model(trainer.model),
                        loss_type=trainer.loss_type, processes=procs, vlm=trainer._is_vlm, repo=name == "repo")
        check_sharding(a, trainer.accelerator)
    return _BUILDERS[name](trainer, options, active=active, procs=procs, pad=pad)


def _replay(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    a = trainer.args
    diag = a.replay_diagnostics_dir
    if diag is None:
        diag = os.path.join(a.output_dir, "replay")
    diagnostics = a.diagnostics_config()
    seam = StrategySeam(ReplayController(
        trainer.replay_config, diagnostics_dir=diag if (diag and trainer.accelerator.is_main_process and active)
        else None, observers=observers(diagnostics, trainer.replay_config)), active)
    if active:
        warn_drift_floor(trainer.replay_config, trainer.accelerator.unwrap_model(trainer.model), a,
                         diagnostics.adaptive_tau)
    return seam


def _dynamic(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    a = trainer.args
    if procs > 1:
        raise ValueError("replay_dynamic_sampling=True runs on one process only (the group filter needs every "
                         "rank's rewards); launch one process or turn it off")
    seam = _replay(trainer, None, active=active, procs=procs, pad=pad)
    seam.generation = DynamicSampler(trainer.train_dataset, n=a.num_generations, seed=a.seed,
                                     max_batches=a.replay_dynamic_sampling_max_batches, pad_token_id=pad)
    return seam


def _repo(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    ctl = RepoController(options)
    return StrategySeam(ctl, active, observe=lambda rows: ctl.observe_batch(rows["prompt_ids"], rows["prompt_mask"]),
                        loss_scales=lambda loss_type, parts: separate_term_scales(parts, options.off_coef))


def _exgrpo(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    a = trainer.args
    check_exgrpo(trainer, a)
    ctl = ExgrpoController(options, n=a.num_generations, seed=a.seed)
    mixer = ExperienceMixer(ctl, n=a.num_generations, pad_token_id=pad, entropies=partial(token_entropies, trainer),
                            scale_rewards=trainer.scale_rewards)
    return StrategySeam(ctl, active, generation=mixer,
                        part_loss=partial(shaped_part_loss, trainer, gamma=options.gamma))


def _bapo(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    a = trainer.args
    check_bapo(a, processes=procs, vlm=trainer._is_vlm)
    sampler = BapoSampler(BapoController(options), n=a.num_generations, pad_token_id=pad)
    return StrategySeam(sampler.controller, active, generation=sampler)


def _popo(trainer, options, *, active: bool, procs: int, pad: int) -> StrategySeam:
    a = trainer.args
    check_popo(a, processes=procs, vlm=trainer._is_vlm, loss_type=trainer.loss_type)
    sampler = PopoSampler(PopoController(options), n=a.num_generations, pad_token_id=pad)
    return StrategySeam(sampler.controller, active, generation=sampler)


_BUILDERS = {"replay": _replay, "dynamic": _dynamic, "repo": _repo, "exgrpo": _exgrpo, "bapo": _bapo, "popo": _popo}
