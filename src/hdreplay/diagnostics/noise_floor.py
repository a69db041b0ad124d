"""The Drift noise floor: the Drift a group shows at UNCHANGED weights, only because it is re-scored in another batch
layout (other batch composition, padding or chunking) than the one its generation log-probs came from.

In exact arithmetic every layout gives the same log-probs; in bf16 each layout runs other kernels and reductions, and
the gate sees rounding before the policy has moved.  When the floor's 99th percentile reaches tau/10 the gate's
decisions near tau start to depend on rounding, so both trainers warn at start (:func:`floor_warning`), quoting
:data:`MEASURED_FLOORS` (measured by ``benchmarks/bf16_floor.py`` on the CPU and ``benchmarks/gpu_check.py`` on one
GPU; docs/results/bf16_floor.md) and the tau in use.  ``hdreplay calibrate run`` measures the floor of the model it
calibrates (:mod:`hdreplay_lab.drift_floor`).

    >>> from hdreplay import ReplayConfig
    >>> floor_warning(ReplayConfig(tau=1e-3), "bf16_weights") is not None
    True
    >>> floor_warning(ReplayConfig(tau=1e-2), "bf16_weights") is None  # tau >= 10x every measured floor
    True
    >>> floor_warning(ReplayConfig(tau=1e-3), "fp32") is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ReplayConfig
from ..selectors import SELECTORS

#: the compute precisions a trainer can report: fp32; fp32 weights under bf16 autocast (TRL ``bf16=True``), with the
#: LM head in fp32 outside autocast or not (TRL ``cast_lm_head_to_fp32``); bf16 weights (a model loaded in bf16, or FSDP
#: mixed precision with ``param_dtype=bf16``: the forward runs on bf16 parameters); fp16 (weights or autocast; not
#: measured: 3 more mantissa bits than bf16, so no warning is issued)
PRECISIONS = ("fp32", "bf16_autocast", "bf16_autocast_fp32_head", "bf16_weights", "fp16")

#: a floor is worth a warning when its 99th percentile reaches this fraction of tau
WARN_FRACTION = 0.1


class DriftFloorWarning(UserWarning):
    """The measured Drift floor of the training precision reaches tau/10."""


@dataclass(frozen=True)
class FloorMeasurement:
    """One measured floor: ``l2_p99`` / ``l1_p99`` = 99th percentile over groups and layouts of the group's Drift
    (l2: mean squared log-prob difference; l1: mean absolute), None where not measured; ``where``: device, model and
    shapes, and the file holding the run."""

    precision: str
    l2_p99: float
    l1_p99: float | None
    where: str

    def p99(self, norm: str) -> float | None:
        return self.l2_p99 if norm == "l2" else self.l1_p99


#: every floor measured so far (docs/results/bf16_floor.md: p99 over groups and layouts); the warning quotes them all
#: and decides on the largest for the precision in use
_H200 = "an NVIDIA H200, 494M random-init Qwen2-shaped model, completions of 512 tokens (docs/results/gpu_check.md)"
_SANDBOX = ("the CPU, the 0.6M sandbox model warm-started on the mix task, completions ending at EOS "
            "(docs/results/bf16_floor.md)")
_QWEN = "the CPU, a 112M random-init Qwen2-shaped model, completions of 96 tokens (docs/results/bf16_floor.md)"
MEASURED_FLOORS: tuple[FloorMeasurement, ...] = (
    FloorMeasurement("bf16_weights", 1.70e-4, None, _H200),
    FloorMeasurement("bf16_weights", 7.61e-4, 1.31e-2, _SANDBOX),
    FloorMeasurement("bf16_weights", 3.64e-5, 4.61e-3, _QWEN),
    FloorMeasurement("bf16_autocast", 7.24e-5, None, _H200),
    FloorMeasurement("bf16_autocast", 5.30e-4, 8.93e-3, _SANDBOX),
    FloorMeasurement("bf16_autocast", 1.35e-5, 2.74e-3, _QWEN),
    FloorMeasurement("bf16_autocast_fp32_head", 2.34e-4, 6.48e-3, _SANDBOX),
)


def precision_of(param_dtype: torch.dtype, autocast_dtype: torch.dtype | None = None, *,
                 fp32_head: bool = False) -> str:
    """The :data:`PRECISIONS` key of a forward on ``param_dtype`` parameters under autocast to ``autocast_dtype``
    (None: no autocast), ``fp32_head``: the LM head runs in fp32 outside autocast.

    >>> precision_of(torch.float32, torch.bfloat16), precision_of(torch.bfloat16, torch.bfloat16)
    ('bf16_autocast', 'bf16_weights')
    """
    if param_dtype == torch.bfloat16:
        return "bf16_weights"
    if param_dtype == torch.float16 or autocast_dtype == torch.float16:
        return "fp16"
    if autocast_dtype == torch.bfloat16:
        return "bf16_autocast_fp32_head" if fp32_head else "bf16_autocast"
    return "fp32"


def worst_floor(precision: str, norm: str = "l2") -> FloorMeasurement | None:
    """The measurement of ``precision`` with the largest p99 for ``norm`` (None if none is measured)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; valid: {list(PRECISIONS)}")
    rows = [m for m in MEASURED_FLOORS if m.precision == precision and m.p99(norm) is not None]
    return max(rows, key=lambda m: m.p99(norm), default=None)


def gate_tau(config: ReplayConfig, adaptive=None) -> float | None:
    """The smallest tau the gate can use (an adaptive schedule's lower bound), None for a selector without a gate."""
    if not SELECTORS[config.selector].gate:
        return None
    return adaptive.tau_min if adaptive is not None else config.tau


def floor_warning(config: ReplayConfig, precision: str, *, adaptive=None) -> str | None:
    """A warning when the largest measured floor of ``precision`` (for ``config.drift_norm``) reaches
    :data:`WARN_FRACTION` x the smallest tau the gate uses (``adaptive``: an :class:`AdaptiveTau` moving it),
    quoting every measurement of that precision; None when tau >= 10x the floor, without a gate, or when no floor of
    that precision is measured."""
    tau = gate_tau(config, adaptive)
    m = worst_floor(precision, config.drift_norm)
    if tau is None or m is None:
        return None
    norm = config.drift_norm
    p99 = m.p99(norm)
    if p99 < WARN_FRACTION * tau:
        return None
    rows = sorted((x for x in MEASURED_FLOORS if x.precision == precision and x.p99(norm) is not None),
                  key=lambda x: x.p99(norm))
    seen = "; ".join(f"p99 {x.p99(norm):.2g} = {x.p99(norm) / tau:.2f} x tau on {x.where}" for x in rows)
    knob = "adaptive_tau.tau_min" if adaptive is not None else "tau"
    return (f"Drift gate at {knob}={tau:g} ({norm}) in {precision}: the Drift floor (groups re-scored at unchanged "
            f"weights in another batch layout than at birth) measured in {precision}: {seen}. The gate's decisions "
            f"near tau partly follow rounding. Raise {knob} to >= {p99 / WARN_FRACTION:.2g} (10x the largest floor; "
            "the calibrated range is 1e-3 .. 1e-1) or train in fp32; `hdreplay calibrate run` measures the floor of "
            "your model (docs/results/bf16_floor.md).")
