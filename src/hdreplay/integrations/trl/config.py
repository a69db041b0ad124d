"""HDRGRPOConfig: GRPOConfig plus ``replay_<knob>`` fields generated from :class:`hdreplay.ReplayConfig`.

Every core knob (:func:`hdreplay.config.knobs`) and every integration knob
(:data:`hdreplay.integrations.common.INTEGRATION_KNOBS`) becomes one field with the same type, default
and help, so the settings, their documentation and their validation live in one place.  TRL-specific
choices (the default of ``replay_k_rep``, the re-scoring batch size) are the only fields written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, Optional

from trl import GRPOConfig

from ...config import Knob, ReplayConfig, knobs
from ..common import INTEGRATION_KNOBS

PREFIX = "replay_"

#: TRL-only defaults and help additions for core knobs
_TRL_OVERRIDES: dict[str, tuple[Any, Any, str]] = {
    # name: (type, default, help suffix)
    "k_rep": (Optional[int], None, " Unset = half the fresh groups of one optimizer update (the paper's b + b/2)."),
}
_TRL_KNOBS = (
    Knob("score_batch_size", int, None, True,
         "rows per forward call when re-scoring replay candidates; unset = per_device_train_batch_size", None),
)


def _field_type(k: Knob):
    if k.flat == "json":
        return Optional[dict | str]
    base = Literal[tuple(k.choices)] if k.choices else k.flat
    return Optional[base] if k.optional else base


def _replay_fields() -> list[tuple[str, Any, Any]]:
    out = []
    for k in (*knobs(), *INTEGRATION_KNOBS, *_TRL_KNOBS):
        typ, default, help_ = _field_type(k), k.default, k.help
        if k.name in _TRL_OVERRIDES:
            typ, default, extra = _TRL_OVERRIDES[k.name]
            help_ += extra
        out.append((PREFIX + k.name, typ, field(default=default, metadata={"help": help_})))
    return out


_ReplayFields = make_dataclass("_ReplayFields", _replay_fields())
REPLAY_FIELDS = tuple(f.name for f in fields(_ReplayFields))


@dataclass
class HDRGRPOConfig(_ReplayFields, GRPOConfig):
    """``GRPOConfig`` with Headroom-Drift Replay: every ``GRPOConfig`` field, plus one ``replay_<name>`` field per
    replay setting (see ``HDRGRPOConfig.replay_help()`` or ``--help`` of a TrlParser script)."""

    def __post_init__(self):
        super().__post_init__()
        if self.use_vllm:
            raise ValueError(
                "HDRGRPOConfig: use_vllm=True is not supported yet (vLLM importance-sampling correction needs "
                "per-row sampling log-probs for replayed rows, which hdreplay does not store). Use the transformers "
                "generation backend (use_vllm=False), or the verl recipe for vLLM rollouts."
            )
        sbs = self.replay_score_batch_size
        if sbs is not None and (isinstance(sbs, bool) or not isinstance(sbs, int) or sbs < 1):
            raise ValueError(f"HDRGRPOConfig: replay_score_batch_size must be unset or an int >= 1, got {sbs!r}")
        if not isinstance(self.replay_resume_without_state, bool):
            raise ValueError("HDRGRPOConfig: replay_resume_without_state must be True or False, got "
                             f"{self.replay_resume_without_state!r}")
        self.to_replay_config()  # validates every core replay_* field, naming it as the user spells it

    @property
    def fresh_groups_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    def replay_values(self) -> dict[str, Any]:
        """The core knobs as set on this config (name without prefix -> value)."""
        return {k.name: getattr(self, PREFIX + k.name) for k in knobs()}

    def to_replay_config(self, *, extra_multiple: int = 1) -> ReplayConfig:
        """The core ReplayConfig these fields describe (``extra_multiple`` is folded into the truncation)."""
        values = self.replay_values()
        if values["k_rep"] is None:
            values["k_rep"] = self.fresh_groups_per_generation // 2
        u = values["truncate_multiple"]
        if isinstance(u, int) and not isinstance(u, bool) and u >= 1:
            values["truncate_multiple"] = math.lcm(u, extra_multiple)
        values["group_size"] = self.num_generations
        return ReplayConfig.from_flat(values, label=lambda n: PREFIX + n, where="HDRGRPOConfig")

    @classmethod
    def replay_help(cls) -> str:
        """One line per replay field: name, default, help."""
        return "\n".join(f"{f.name} (default {f.default!r}): {f.metadata['help']}" for f in fields(_ReplayFields))
