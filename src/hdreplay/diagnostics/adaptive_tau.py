"""Adaptive Drift threshold: loosen tau when replay is starved, tighten it when replay KL rises.

The paper calibrates tau with a short log-spaced sweep and notes that the same diagnostics could
drive an adaptive schedule (Appendix G.2).  This is that schedule, multiplicative and bounded:

* starved:  the running acceptance rate is below ``accept_low`` while the budget is not filled
            -> tau = min(tau * factor, tau_max)
* too loose: the fast running mean of replay KL exceeds the slow one by more than ``kl_rise``
            (relative) -> tau = max(tau / factor, tau_min)

A change is followed by ``patience`` steps without another; nothing changes during ``warmup``.
:class:`AdaptiveTauObserver` runs it beside a :class:`~hdreplay.ReplayController` (an observer: it moves
``controller.tau`` after each commit and checkpoints its state with the controller's).  The update
(:func:`advance_tau`) is a pure function of the state and three plain numbers of the
committed step (gate pass rate, budget fill, replay KL), so it checkpoints as plain numbers and needs
nothing from the diagnostics; :func:`update_tau` takes the same numbers from a step record.

The multiplicative schedule refuses to move a tau of 0.

>>> cfg = AdaptiveTau(tau_min=1e-4, tau_max=1e-2, warmup=0, patience=0)
>>> s = TauState(tau=1e-3)
>>> s = advance_tau(s, cfg, accept_rate=0.0, budget_fill=0.0, replay_kl=None)  # nothing passed the gate
>>> s.tau, s.last_action
(0.002, 'loosen')
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from ..errors import CheckpointError, ReplayConfigError, ReplayInputError
from ..validate import MAX_STEP, check_real, is_int, is_real

TAU_ACTIONS = ("hold", "loosen", "tighten")


@dataclass(frozen=True)
class AdaptiveTau:
    """Bounds and gains of the adaptive tau schedule (see module docstring)."""

    tau_min: float = 1e-4
    tau_max: float = 1e-1
    factor: float = 2.0
    accept_low: float = 0.1
    kl_rise: float = 0.25
    fast: float = 0.3
    slow: float = 0.05
    patience: int = 5
    warmup: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            ok = (type(v) is int and 0 <= v < MAX_STEP) if f.type in ("int", int) else (
                type(v) in (int, float) and math.isfinite(v))
            if not ok:
                what = "an int in [0, 2**53)" if f.type in ("int", int) else "a finite number"
                raise _err(f"adaptive_tau.{f.name} must be {what}, got {v!r}")
        if not (0 < self.tau_min <= self.tau_max):
            raise _err(f"needs 0 < tau_min <= tau_max, got [{self.tau_min}, {self.tau_max}]")
        if not self.factor > 1:
            raise _err(f"factor must be > 1, got {self.factor}")
        if not (0 <= self.accept_low < 1):
            raise _err(f"accept_low must be in [0, 1), got {self.accept_low}")
        if not self.kl_rise > 0:
            raise _err(f"kl_rise must be > 0, got {self.kl_rise}")
        if not (0 < self.slow < self.fast <= 1):
            raise _err(f"needs 0 < slow < fast <= 1 (EMA weights), got slow={self.slow}, fast={self.fast}")
        if self.patience < 0 or self.warmup < 0:
            raise _err(f"patience and warmup must be >= 0, got {self.patience}, {self.warmup}")


def _err(msg: str) -> ReplayConfigError:
    return ReplayConfigError(f"adaptive_tau: {msg}", field="adaptive_tau")


@dataclass
class TauState:
    """The current Drift threshold ``tau`` (>= 0) and, under :class:`AdaptiveTau`, the schedule's running statistics
    (EMAs of the gate pass rate and of replay KL, steps, steps since the last change, the last action)."""

    tau: float
    accept_ema: float | None = None
    kl_fast: float | None = None
    kl_slow: float | None = None
    steps: int = 0
    since_change: int = 0
    last_action: str = "hold"

    def __post_init__(self) -> None:
        check_real("tau_state.tau", self.tau, lo=0.0, err=ReplayConfigError)
        for name in ("accept_ema", "kl_fast", "kl_slow"):
            v = getattr(self, name)
            if v is not None:
                check_real(f"tau_state.{name}", v, lo=0.0, err=ReplayConfigError)
        for name in ("steps", "since_change"):
            v = getattr(self, name)
            if not is_int(v) or not 0 <= v < MAX_STEP:
                raise ReplayConfigError(f"tau_state.{name}: must be an int in [0, 2**53), got {v!r}",
                                        field=f"tau_state.{name}")
        if self.last_action not in TAU_ACTIONS:
            raise ReplayConfigError(f"tau_state.last_action: must be one of {list(TAU_ACTIONS)}, "
                                    f"got {self.last_action!r}", field="tau_state.last_action")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


def update_tau(state: TauState, record: Any, cfg: AdaptiveTau) -> TauState:
    """The next state after a committed step: :func:`advance_tau` with the ``accept_rate``, ``budget_fill`` and
    ``replay_kl`` of ``record`` (its :class:`~hdreplay.records.StepRecord`, or the same as a dict read back
    from ``steps.jsonl``; missing keys are None)."""
    if not isinstance(record, Mapping):
        if not hasattr(record, "__dict__") or isinstance(record, type):
            raise ReplayInputError(f"record: must be a StepRecord or a mapping, got {type(record).__name__}")
        record = vars(record)
    return advance_tau(state, cfg, accept_rate=record.get("accept_rate"), budget_fill=record.get("budget_fill"),
                       replay_kl=record.get("replay_kl"))


def advance_tau(state: TauState, cfg: AdaptiveTau, *, accept_rate: float | None, budget_fill: float | None,
                replay_kl: float | None) -> TauState:
    """The next state after a committed step (a new object; ``state`` is not changed).

    Args:
        accept_rate: the step's gate pass rate among scanned groups in [0, 1] (None: nothing scanned).
        budget_fill: replayed / K_rep, >= 0 (None: no budget).
        replay_kl: token-weighted replay KL of the replayed groups, >= 0 (None: not scored).
    """
    if not isinstance(state, TauState):
        raise ReplayInputError(f"state: must be a TauState, got {type(state).__name__}")
    if not isinstance(cfg, AdaptiveTau):
        raise ReplayInputError(f"cfg: must be an AdaptiveTau, got {type(cfg).__name__}")
    if not state.tau > 0:
        raise ReplayInputError(f"state.tau: the schedule moves tau by factors within [tau_min, tau_max] and cannot "
                               f"move tau = {state.tau:g}; start it inside adaptive_tau's bounds (a fixed tau of 0 "
                               "needs no schedule)")
    record = {"accept_rate": accept_rate, "budget_fill": budget_fill, "replay_kl": replay_kl}
    for key, hi in (("accept_rate", 1.0), ("budget_fill", None), ("replay_kl", None)):
        v = record[key]
        if v is not None and not (is_real(v) and math.isfinite(v) and 0 <= v and (hi is None or v <= hi)):
            raise ReplayInputError(f"record[{key!r}]: must be None or a finite number >= 0"
                                   f"{' and <= 1' if hi else ''}, got {v!r}")
    s = TauState(**state.to_dict())
    s.steps += 1
    s.since_change += 1
    if accept_rate is not None:
        s.accept_ema = _ema(s.accept_ema, float(accept_rate), cfg.fast)
    if replay_kl is not None:
        s.kl_fast = _ema(s.kl_fast, float(replay_kl), cfg.fast)
        s.kl_slow = _ema(s.kl_slow, float(replay_kl), cfg.slow)
    s.last_action = "hold"
    if s.steps <= cfg.warmup or s.since_change <= cfg.patience:
        return s
    starved = s.accept_ema is not None and s.accept_ema < cfg.accept_low and (budget_fill is None or budget_fill < 1)
    rising = (s.kl_fast is not None and s.kl_slow is not None and s.kl_slow > 0
              and s.kl_fast > (1 + cfg.kl_rise) * s.kl_slow)
    if starved and s.tau < cfg.tau_max:
        s.tau, s.last_action, s.since_change = min(s.tau * cfg.factor, cfg.tau_max), "loosen", 0
    elif rising and not starved and s.tau > cfg.tau_min:
        s.tau, s.last_action, s.since_change = max(s.tau / cfg.factor, cfg.tau_min), "tighten", 0
    return s


class AdaptiveTauObserver:
    """Moves ``controller.tau`` by the :class:`AdaptiveTau` schedule after every commit (an observer of
    :class:`~hdreplay.ReplayController`); adds ``tau_next`` and ``tau_action`` to the step record.  The schedule
    starts from the controller's tau, which must lie within its bounds."""

    name = "adaptive_tau"

    def __init__(self, schedule: AdaptiveTau) -> None:
        if not isinstance(schedule, AdaptiveTau):
            raise ReplayConfigError(f"adaptive_tau: must be an AdaptiveTau, got {schedule!r}", field="adaptive_tau")
        self.schedule, self.state = schedule, None

    def on_commit(self, controller, record) -> dict:
        state = self.state or TauState(tau=controller.tau)
        self.state = advance_tau(state, self.schedule, accept_rate=record.accept_rate,
                                 budget_fill=record.budget_fill, replay_kl=record.replay_kl)
        controller.tau = self.state.tau
        return {"tau_next": self.state.tau, "tau_action": self.state.last_action}

    def state_dict(self) -> dict | None:
        return None if self.state is None else self.state.to_dict()

    def check_state(self, d: Any, loading: Any = None) -> TauState | None:
        """A saved state, clamped into this schedule's bounds (None: none saved, the schedule starts over)."""
        if d is None:
            return None
        try:
            state = TauState(**d)
        except (TypeError, ReplayConfigError) as e:
            raise CheckpointError(f"adaptive_tau: invalid saved state ({e})") from None
        state.tau = min(max(state.tau, self.schedule.tau_min), self.schedule.tau_max)
        return state

    def restore(self, controller, state: TauState | None) -> None:
        self.state = state
        if state is not None:
            controller.tau = state.tau


def adaptive_tau_from(value: Any) -> AdaptiveTau | None:
    """An :class:`AdaptiveTau` from None, an AdaptiveTau, a mapping of its fields or a JSON object string."""
    if value is None or isinstance(value, AdaptiveTau):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ReplayConfigError(f"adaptive_tau: not valid JSON ({e.msg}); pass an object such as "
                                    '\'{"tau_min": 1e-4, "tau_max": 0.1}\'', field="adaptive_tau") from None
    if not isinstance(value, Mapping):
        raise ReplayConfigError(f"adaptive_tau: expected a mapping of AdaptiveTau fields, got {type(value).__name__}",
                                field="adaptive_tau")
    valid = {f.name for f in fields(AdaptiveTau)}
    bad = sorted(set(value) - valid)
    if bad:
        raise ReplayConfigError(f"adaptive_tau: unknown field(s) {bad}; valid: {sorted(valid)}", field="adaptive_tau")
    return AdaptiveTau(**dict(value))
