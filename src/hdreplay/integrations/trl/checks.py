"""What HDRGRPOTrainer refuses before it trains: settings its replay step cannot honour (at construction)
and a model whose log-probs change when a sequence is re-padded (at the first step).  Pure checks: they
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
                    repo: bool, deepspeed: bool) -> None:
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
    if deepspeed and args.replay_micro_step == "chunk":
        raise ValueError("HDRGRPOTrainer: replay_micro_step='chunk' runs extra backward passes inside a micro-step, "
                         "which DeepSpeed counts as micro-steps of its own. Set replay_micro_step='grow' (replay "
                         "rows join the micro-batch: activation memory grows by (fresh + replay rows) / fresh rows, "
                         f"{plan.grow_factor:.2f}x with these settings).")
    if args.replay_micro_step == "grow":
        warnings.warn(f"replay_micro_step='grow': replay rows join the micro-batch, so a forward holds up to "
                      f"{plan.grow_factor:.2f}x per_device_train_batch_size={args.per_device_train_batch_size} "
                      "rows and activation memory grows by that factor; 'chunk' (the default) keeps it at "
                      "per_device_train_batch_size rows.", ReplaySettingWarning, stacklevel=3)


def check_exgrpo(trainer, args) -> None:
    """Refuse ``replay_exgrpo`` settings its injected rows cannot honour (each message names the setting and the fix)."""
    from .exgrpo import SHAPED_LOSS_TYPES

    bad = []
    if trainer.accelerator.num_processes > 1:
        bad.append(f"{trainer.accelerator.num_processes} processes (launch one)")
    if trainer._is_vlm:
        bad.append("a vision-language model (text only)")
    if trainer.loss_type not in SHAPED_LOSS_TYPES:
        bad.append(f"loss_type={trainer.loss_type!r} (use one of {', '.join(SHAPED_LOSS_TYPES)})")
    if args.replay_micro_step != "chunk":
        bad.append("replay_micro_step='grow' (use 'chunk')")
    if trainer.beta != 0.0:
        bad.append(f"beta={trainer.beta} (use 0: stored rows carry no reference log-probs)")
    if trainer._entropy_bonus_enabled or trainer.top_entropy_quantile < 1.0 or trainer.off_policy_mask_threshold:
        bad.append("an entropy bonus, top_entropy_quantile < 1 or off_policy_mask_threshold (the shaped term has none)")
    if trainer.scale_rewards not in ("group", "none"):
        bad.append(f"scale_rewards={trainer.scale_rewards!r} (use 'group' or 'none')")
    if getattr(trainer, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        bad.append("multi_objective_aggregation other than 'sum_then_normalize'")
    if bad:
        raise ValueError("replay_exgrpo (ExGRPO's mixed-policy groups) cannot run with " + "; ".join(bad))


def check_padding_drift(err: float, *, low_precision: bool, model: torch.nn.Module) -> float:
    """``err`` = max |d logp| between two paddings of one sequence (:func:`.positions.padding_drift`); returned
    when within :data:`PADDING_TOLERANCE`, else refused: replayed groups could not be re-scored consistently."""
    tol = PADDING_TOLERANCE["low" if low_precision else "fp32"]
    if not err <= tol:
        raise ValueError(
            f"{type(model).__name__}: the same sequence re-padded changes its log-probs by up to {err:.2e} (> {tol:g}), "
            "even with generation-style position ids; replayed groups could not be re-scored consistently. Use a "
            "model whose forward accepts position_ids (rotary or absolute), or replay_selector='none'.")
    return err
