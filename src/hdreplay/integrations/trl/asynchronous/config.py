"""HDRAsyncGRPOConfig: TRL's ``AsyncGRPOConfig`` plus the replay and staleness settings.

``replay_<knob>``: one field per core replay knob (:func:`hdreplay.config.knobs`, same type, default and help);
``staleness_<field>``: the :class:`hdreplay.staleness.StalenessConfig` fields except ``fresh_bound`` (that is TRL's
own ``max_staleness``) and ``ingest_fresh`` (not offered here: with TRL's one-micro-batch prefetch a fresh group
could be replayed in the step that trains it); ``replay_supply_warn_s`` / ``replay_supply_timeout_s``: the
supply watchdog (:mod:`.async_queue`); ``replay_diagnostics_dir``: where ``steps.jsonl`` / ``async.jsonl`` go;
``replay_resume_without_state``: accept a checkpoint without the replay state (an empty start).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, Optional

from trl.experimental.async_grpo import AsyncGRPOConfig

from ....config import ReplayConfig, knobs
from ....errors import ReplayConfigError
from ....staleness import StalenessConfig

PREFIX = "replay_"
STALE = "staleness_"
_STALENESS_FIELDS = ("max_divert_age", "floor_initial", "floor_ema", "floor_min_groups")
_HELP = {f: h for f, h in (
    ("max_divert_age", "diverted groups more than this many versions behind are dropped instead (unset: no limit)"),
    ("floor_initial", "the sampler-vs-trainer Drift floor used until it is measured on staleness-0 groups (0 = the "
                      "stricter gate; `hdreplay calibrate` reports one)"),
    ("floor_ema", "weight of the newest step's staleness-0 measurement in the running floor, in (0, 1]"),
    ("floor_min_groups", "staleness-0 groups measured before the running floor replaces staleness_floor_initial"))}


def _knob_type(k):
    if k.flat == "json":
        return Optional[dict | str]
    base = Literal[tuple(k.choices)] if k.choices else k.flat
    return Optional[base] if k.optional else base


def _fields() -> list[tuple[str, Any, Any]]:
    out = [(PREFIX + k.name, _knob_type(k), field(default=k.default, metadata={"help": k.help})) for k in knobs()]
    defaults = StalenessConfig()
    for name in _STALENESS_FIELDS:
        typ = Optional[int] if name == "max_divert_age" else type(getattr(defaults, name))
        out.append((STALE + name, typ, field(default=getattr(defaults, name), metadata={"help": _HELP[name]})))
    out += [
        ("replay_supply_warn_s", float, field(default=60.0, metadata={
            "help": "log a warning with the numbers every this many seconds the rollout worker supplies no sample"})),
        ("replay_supply_timeout_s", Optional[float], field(default=None, metadata={
            "help": "raise RolloutSupplyError after this many seconds without a sample (unset: keep waiting, "
                    "warning)"})),
        ("replay_diagnostics_dir", Optional[str], field(default=None, metadata={
            "help": "directory for steps.jsonl / groups.jsonl / async.jsonl (unset: <output_dir>/hdreplay)"})),
        ("replay_resume_without_state", bool, field(default=False, metadata={
            "help": "allow resuming from a checkpoint without the replay and staleness state (written without "
                    "hdreplay, or by a version that did not save it); the buffer, the floor, the ledger and the "
                    "routing then start empty. Off by default: losing them silently changes the run"})),
    ]
    return out


_AsyncReplayFields = make_dataclass("_AsyncReplayFields", _fields())


@dataclass
class HDRAsyncGRPOConfig(_AsyncReplayFields, AsyncGRPOConfig):
    """``AsyncGRPOConfig`` with Drift-gated staleness: every ``AsyncGRPOConfig`` field, plus ``replay_<knob>`` and
    ``staleness_<field>`` fields (see the module docstring)."""

    def __post_init__(self):
        super().__post_init__()
        self.to_replay_config()
        self.to_staleness_config()
        if not isinstance(self.replay_resume_without_state, bool):
            raise ReplayConfigError(f"HDRAsyncGRPOConfig: replay_resume_without_state must be true or false, got "
                                    f"{self.replay_resume_without_state!r}", field="replay_resume_without_state")
        for name in ("replay_supply_warn_s", "replay_supply_timeout_s"):
            v = getattr(self, name)
            if v is None and name.endswith("timeout_s"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ReplayConfigError(f"HDRAsyncGRPOConfig: {name} must be a number of seconds > 0, got {v!r}",
                                        field=name)

    def to_replay_config(self) -> ReplayConfig:
        values = {k.name: getattr(self, PREFIX + k.name) for k in knobs()}
        values["group_size"] = self.num_generations
        return ReplayConfig.from_flat(values, label=lambda n: PREFIX + n, where="HDRAsyncGRPOConfig")

    def to_staleness_config(self) -> StalenessConfig:
        kw = {name: getattr(self, STALE + name) for name in _STALENESS_FIELDS}
        try:
            return StalenessConfig(fresh_bound=self.max_staleness, **kw)
        except ReplayConfigError as e:
            name = "max_staleness" if e.field == "fresh_bound" else STALE + (e.field or "")
            raise ReplayConfigError(f"HDRAsyncGRPOConfig: {name}: {e.message}", field=name) from None


REPLAY_FIELDS = tuple(f.name for f in fields(_AsyncReplayFields))
