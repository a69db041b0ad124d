"""What HDRGRPOTrainer refuses before it trains: settings its replay step cannot honour (at construction; a
DeepSpeed or FSDP setup among them) and a model whose log-probs change when a sequence is re-padded (at the first
step).  Pure checks: they
read the trainer's settings and raise ``ValueError`` naming the setting and the fix, or warn."""

from __future__ import annotations

import warnings

import torch

from .microstep import GLOBAL_TOKENS, LOCAL_TOKENS, ROW_MEAN
from .plan import ReplayPlan, ReplaySettingWarning
from .positions import active_dropout

#: max |d logp| tolerated between paddings of one sequence (fp32 / low-precision autocast)
PADDING_TOLERANCE = {"fp32": 1e-4, "low": 3e-2}


def check_supported(args, plan: ReplayPlan, model: torch.nn.Module, *, loss_type: str, processes: int, vlm: bool,
                    repo: bool) -> None:
    """Refuse (or warn about) a replay configuration of ``args`` (an HDRGRPOConfig) on this ``model``."""
    if repo and (processes > 1 or args.replay_micro_step != "chunk" or vlm or loss_type not in ROW_MEAN):
        raise ValueError("replay_repo (RePO's separate off-policy loss term) runs on one process, text only, with "
                         f"replay_micro_step='chunk' and a row-mean loss_type ({', '.join(ROW_MEAN)}); got "
                         f"{processes} processes, {args.replay_micro_step!r}, {loss_type!r}"
                         + (", a vision-language model" if vlm else ""))
    live = active_dropout(model)
    if live:
        raise ValueError(
            f"the model has active dropout ({', '.join(live[:3])}{', ...' if len(live) > 3 else ''}): "
            "training-mode log-probs are then random, so stored generation log-probs and the Drift gate "
            "measure dropout noise instead of policy change. Set disable_dropout=True in HDRGRPOConfig.")
    if loss_type not in ROW_MEAN + LOCAL_TOKENS + GLOBAL_TOKENS:
        raise ValueError(f"HDRGRPOTrainer: loss_type={loss_type!r} is not one hdreplay knows how to split "
                         "into chunks; use one of " + ", ".join(ROW_MEAN + LOCAL_TOKENS + GLOBAL_TOKENS))
    if args.replay_micro_step == "grow":
        warnings.warn(f"replay_micro_step='grow': replay rows join the micro-batch, so a forward holds up to "
                      f"{plan.grow_factor:.2f}x per_device_train_batch_size={args.per_device_train_batch_size} "
                      "rows and activation memory grows by that factor; 'chunk' (the default) keeps it at "
                      "per_device_train_batch_size rows.", ReplaySettingWarning, stacklevel=3)


def check_sharding(args, accelerator) -> None:
    """Refuse a DeepSpeed or FSDP setup that replay's micro-step cannot honour, before anything is prepared.

    DeepSpeed: the config's ``gradient_accumulation_steps`` and ``train_micro_batch_size_per_gpu`` must be TRL's
    (or ``"auto"``): TRL scales the loss for its own accumulation and replay chunks ride on its micro-steps (the
    Trainer would refuse a mismatch too, but only when training starts).  FSDP: version 2 (the version replay
    runs and is tested under; transformers deprecates FSDP1)."""
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds is not None:
        conf = ds.deepspeed_config or {}
        for key, field, want in (("gradient_accumulation_steps", "gradient_accumulation_steps",
                                  args.gradient_accumulation_steps),
                                 ("train_micro_batch_size_per_gpu", "per_device_train_batch_size",
                                  args.per_device_train_batch_size)):
            got = conf.get(key, "auto")
            if got != "auto" and int(got) != want:
                raise ValueError(
                    f"HDRGRPOTrainer: the DeepSpeed config sets {key}={got} but {field}={want}: replay chunks run "
                    f"inside TRL's micro-steps, whose accumulation TRL scales itself. Set {key} to \"auto\" in the "
                    f"DeepSpeed config (or to {want}), or change {field}.")
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) != 2:
        raise ValueError("HDRGRPOTrainer: replay under FSDP runs with FSDP2 only (fsdp_config={'version': 2}, "
                         "accelerate's fsdp_version: 2); FSDP1 is deprecated by transformers and replay was never run "
                         "under it. Set the FSDP version to 2.")


def check_padding_drift(err: float, *, low_precision: bool, model: torch.nn.Module) -> float:
    """``err`` = max |d logp| between two paddings of one sequence (:func:`.positions.padding_drift`); returned
    when within :data:`PADDING_TOLERANCE`, else refused: replayed groups could not be re-scored consistently."""
    tol = PADDING_TOLERANCE["low" if low_precision else "fp32"]
    if not err <= tol:
        raise ValueError(
            f"{type(model).__name__}: the same sequence re-padded changes its log-probs by up to {err:.2e} "
            f"(> {tol:g}), even with generation-style position ids; replayed groups could not be re-scored "
            "consistently. Use a model whose forward accepts position_ids (rotary or absolute), or "
            "replay_selector='none'.")
    return err
