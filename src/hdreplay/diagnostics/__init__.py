"""Diagnostics and experiments that stand around the method (not imported by ``import hdreplay``).

Each is an observer of :class:`~hdreplay.ReplayController` (``ReplayController(config, observers=[...])``): it may
score more groups after a selection, add fields to the step record's ``extras`` and move ``controller.tau`` between
steps, never change what a selection replays.

=======================  ==========================================================================================
``Counterfactual``       the paper's same-buffer counterfactual: recency's subset of the same buffer, scored too
``UngatedDiagnosis``     Drift / replay KL of what an ungated order (recency replay) replays
``AdaptiveTauObserver``  moves tau within bounds (loosen when starved, tighten when replay KL rises)
``noise_floor``          the measured bf16 Drift floors and the start-up warning when one reaches tau / 10
=======================  ==========================================================================================

:class:`DiagnosticsConfig` declares them once for the front ends (TRL ``replay_diagnose_ungated``,
``replay_counterfactual``, ``replay_adaptive_tau``; verl ``hdr.*``); :func:`observers` builds them.

>>> from hdreplay import ReplayConfig, ReplayController
>>> cfg = ReplayConfig(k_rep=2, tau=1e-3, capacity=16)
>>> ctrl = ReplayController(cfg, observers=observers(DiagnosticsConfig(counterfactual=True), cfg))
>>> [o.name for o in ctrl.observers]
['counterfactual']
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..config import ReplayConfig
from ..errors import ReplayConfigError
from .adaptive_tau import AdaptiveTau, AdaptiveTauObserver, TauState, adaptive_tau_from, advance_tau, update_tau
from .counterfactual import Counterfactual
from .ungated import UngatedDiagnosis

__all__ = ["AdaptiveTau", "AdaptiveTauObserver", "advance_tau", "Counterfactual", "DiagnosticsConfig", "observers",
           "TauState", "UngatedDiagnosis", "update_tau"]


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What a run measures beyond the method (each off by default; none changes what is replayed but adaptive tau,
    which moves the threshold)."""

    diagnose_ungated: bool = field(default=False, metadata={"help": (
        "also re-score the groups recency replay picks, so their Drift and replay KL are reported (one forward over "
        "them)")})
    counterfactual: bool = field(default=False, metadata={"help": (
        "also score the subset recency replay would take from the same pre-step buffer and record it beside the "
        "selection (the paper's same-buffer counterfactual; one forward over the recency groups not scanned anyway)")})
    adaptive_tau: AdaptiveTau | None = field(default=None, metadata={"help": (
        "move tau within bounds (loosen when replay starves, tighten when replay KL rises); tau is the start. An "
        "AdaptiveTau, or its fields as a dict / JSON object, e.g. {\"tau_min\": 1e-4, \"tau_max\": 0.1}")})

    def __post_init__(self) -> None:
        for name in ("diagnose_ungated", "counterfactual"):
            if not isinstance(getattr(self, name), bool):
                raise ReplayConfigError(f"{name}: must be True or False, got {getattr(self, name)!r}", field=name)
        object.__setattr__(self, "adaptive_tau", adaptive_tau_from(self.adaptive_tau))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def observers(config: DiagnosticsConfig, replay: ReplayConfig) -> list[Any]:
    """The observers ``config`` asks for, checked against the replay configuration they will watch."""
    if not isinstance(config, DiagnosticsConfig) or not isinstance(replay, ReplayConfig):
        raise ReplayConfigError("observers: needs a DiagnosticsConfig and a ReplayConfig")
    out: list[Any] = []
    if config.diagnose_ungated:
        out.append(UngatedDiagnosis())
    if config.counterfactual:
        out.append(Counterfactual())
    if config.adaptive_tau is not None:
        lo, hi = config.adaptive_tau.tau_min, config.adaptive_tau.tau_max
        if not lo <= replay.tau <= hi:
            raise ReplayConfigError(f"tau: tau={replay.tau:g} must lie within adaptive_tau's bounds [{lo:g}, {hi:g}]",
                                    field="tau")
        out.append(AdaptiveTauObserver(config.adaptive_tau))
    return out
