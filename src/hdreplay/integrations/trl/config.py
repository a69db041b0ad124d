"""HDRGRPOConfig: GRPOConfig plus ``replay_<knob>`` fields generated from :class:`hdreplay.ReplayConfig`.

Every core knob (:func:`hdreplay.config.knobs`) and every integration knob
(:data:`hdreplay.integrations.common.INTEGRATION_KNOBS`) becomes one field with the same type, default
and help, so the settings, their documentation and their validation live in one place.  TRL-specific
choices (the default of ``replay_k_rep``, the re-scoring batch size, how replay rows enter a micro-step)
are the only fields written here.  The replay arithmetic (fresh groups per step, truncation unit,
refusals and warnings) is :func:`.plan.plan_replay`.  Both are worked out once, when the config is built
(:meth:`HDRGRPOConfig.replay_settings`: one validated :class:`ReplayConfig` and its plan), and handed to the
trainer, its strategy and the log callback.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal, Optional

from trl import GRPOConfig

from ...config import Knob, ReplayConfig, knobs
from ...errors import ReplayConfigError
from ..common import INTEGRATION_KNOBS
from .plan import ReplayPlan, plan_replay

PREFIX = "replay_"
MICRO_STEP_MODES = ("chunk", "grow")

#: TRL-only defaults and help additions for core knobs
_TRL_OVERRIDES: dict[str, tuple[Any, Any, str]] = {
    # name: (type, default, help suffix)
    "k_rep": (Optional[int], None, " Unset = half the fresh groups of one replay step (one optimizer update; the "
                                   "paper's b + b/2), cut to the truncation unit."),
}
_TRL_KNOBS = (
    Knob("score_batch_size", int, None, True,
         "rows per forward call when re-scoring replay candidates; unset = per_device_train_batch_size", None),
    Knob("micro_step", str, "chunk", False,
         "how replay rows enter a micro-step: chunk = extra forward/backward passes of at most "
         "per_device_train_batch_size rows each (activation memory as without replay; the fresh rows form exactly "
         "plain TRL's micro-batch); grow = one forward/backward over fresh + replay rows (activation memory grows "
         "by (fresh + replay rows) / fresh rows; needed with DeepSpeed, which counts backward calls)",
         MICRO_STEP_MODES),
    Knob("repo", "json", None, True,
         "RePO's per-prompt replay instead of a selector (replay_selector='none'): a dict / JSON object of "
         "hdreplay.strategies.repo.RepoOptions fields, e.g. {\"retrieval\": \"recent\"} (retrieval recent | highest | "
         "max_variance, num_replays 8, min_cache 16, max_cache 16, off_coef 1.0); one process, micro_step chunk, "
         "a row-mean loss_type", None),
    Knob("exgrpo", "json", None, True,
         "ExGRPO's experience pool instead of a selector (replay_selector='none'): a dict / JSON object of "
         "hdreplay.strategies.exgrpo.ExgrpoOptions fields, e.g. {} for the released recipe (ratio 0.5, start_solved "
         "0.35, gamma 0.1, sigma 1.0, correct 1.0, lbound 0, rbound n - 1, seed = the run's seed); one process, text only, "
         "micro_step chunk, loss_type grpo | bnpo | dr_grpo | dapo, beta 0, entropy_coef 0", None),
    Knob("bapo", "json", None, True,
         "BAPO's buffer-driven batch construction instead of a selector (replay_selector='none'): a dict / JSON "
         "object of hdreplay.strategies.bapo.BapoOptions fields, e.g. {\"max_reeval\": 16} (bad_thr 1/8, "
         "target_range [1/8, 2/8], train_range [1/8, 7/8], reeval_every 2, max_reeval 16, max_uids 128, max_target "
         "8, stale_steps 3, seed 0); one process, text only, one generation per update", None),
    Knob("dynamic_sampling", bool, False, False,
         "DAPO's dynamic sampling: drop groups whose rewards are all equal and generate further prompt batches "
         "until the batch holds only mixed groups (at most dynamic_sampling_max_batches rounds); one process, "
         "replay_selector='none'", None),
    Knob("dynamic_sampling_max_batches", int, 10, False,
         "generation rounds per batch at most with replay_dynamic_sampling (verl's max_num_gen_batches; >= 1); at "
         "the limit the batch is completed with zero-variance groups (zero advantage) and the shortfall logged",
         None),
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


@dataclass(frozen=True)
class ReplaySettings:
    """What an :class:`HDRGRPOConfig`'s replay fields resolve to, once per run: the core ``config`` (K_rep and the
    truncation unit from the ``plan``) and the ``plan`` (fresh groups per step, unit, K_rep, warnings)."""

    config: ReplayConfig
    plan: ReplayPlan


@dataclass
class HDRGRPOConfig(_ReplayFields, GRPOConfig):
    """``GRPOConfig`` with Headroom-Drift Replay: every ``GRPOConfig`` field, plus one ``replay_<name>`` field per
    replay setting (see ``HDRGRPOConfig.replay_help()`` or ``--help`` of a TrlParser script)."""

    def __post_init__(self):
        super().__post_init__()
        self._check_replay(emit=True)

    def _check_replay(self, *, emit: bool) -> None:
        sbs = self.replay_score_batch_size
        if sbs is not None and (isinstance(sbs, bool) or not isinstance(sbs, int) or sbs < 1):
            raise ReplayConfigError(f"HDRGRPOConfig: replay_score_batch_size must be unset or an int >= 1, got {sbs!r}",
                                    field="replay_score_batch_size")
        if not isinstance(self.replay_resume_without_state, bool):
            raise ReplayConfigError("HDRGRPOConfig: replay_resume_without_state must be True or False, got "
                                    f"{self.replay_resume_without_state!r}", field="replay_resume_without_state")
        if self.replay_micro_step not in MICRO_STEP_MODES:
            raise ReplayConfigError(f"HDRGRPOConfig: replay_micro_step must be one of {list(MICRO_STEP_MODES)}, got "
                                    f"{self.replay_micro_step!r}", field="replay_micro_step")
        if not isinstance(self.replay_dynamic_sampling, bool):
            raise ReplayConfigError("HDRGRPOConfig: replay_dynamic_sampling must be True or False, got "
                                    f"{self.replay_dynamic_sampling!r}", field="replay_dynamic_sampling")
        mb = self.replay_dynamic_sampling_max_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ReplayConfigError(f"HDRGRPOConfig: replay_dynamic_sampling_max_batches must be an int >= 1, got "
                                    f"{mb!r}", field="replay_dynamic_sampling_max_batches")
        strategies = [name for name, opts in (("replay_repo", self.repo_options()),
                                              ("replay_exgrpo", self.exgrpo_options()),
                                              ("replay_bapo", self.bapo_options())) if opts is not None]
        for name in strategies:
            if self.replay_selector != "none":
                raise ReplayConfigError(f"HDRGRPOConfig: {name} replaces the selector; set replay_selector='none' "
                                        f"(got {self.replay_selector!r})", field=name)
        if len(strategies) > 1:
            raise ReplayConfigError(f"HDRGRPOConfig: {' and '.join(strategies)} are both set; choose one strategy",
                                    field=strategies[-1])
        if self.replay_dynamic_sampling and strategies and strategies[0] != "replay_repo":
            raise ReplayConfigError(f"HDRGRPOConfig: {strategies[0]} builds its own batches; set "
                                    "replay_dynamic_sampling=False", field=strategies[0])
        if self.replay_dynamic_sampling and (self.replay_selector != "none" or strategies):
            raise ReplayConfigError(
                f"HDRGRPOConfig: replay_dynamic_sampling=True with replay_selector={self.replay_selector!r}: dynamic "
                "sampling is implemented for on-policy training only; set replay_selector='none' or "
                "replay_dynamic_sampling=False", field="replay_dynamic_sampling")
        settings = self.replay_settings()  # built once: every core replay_* field validated, the plan worked out
        if emit:
            settings.plan.warn()

    def repo_options(self):
        """``replay_repo`` as :class:`~hdreplay.strategies.repo.RepoOptions` (None when unset)."""
        return self._options()["replay_repo"]

    def exgrpo_options(self):
        """``replay_exgrpo`` as :class:`~hdreplay.strategies.exgrpo.ExgrpoOptions` (None when unset)."""
        return self._options()["replay_exgrpo"]

    def bapo_options(self):
        """``replay_bapo`` as :class:`~hdreplay.strategies.bapo.BapoOptions` (None when unset)."""
        return self._options()["replay_bapo"]

    def _options(self) -> dict[str, Any]:
        """The strategies' JSON knobs parsed once (again only after one of them changed)."""
        from ...strategies.bapo import BapoOptions
        from ...strategies.exgrpo import ExgrpoOptions
        from ...strategies.repo import RepoOptions

        key = repr((self.replay_repo, self.replay_exgrpo, self.replay_bapo))
        cached = self.__dict__.get("_hdr_options")
        if cached is None or cached[0] != key:
            cached = (key, {name: _strategy_options(getattr(self, name), name, cls) for name, cls in
                            (("replay_repo", RepoOptions), ("replay_exgrpo", ExgrpoOptions),
                             ("replay_bapo", BapoOptions))})
            self.__dict__["_hdr_options"] = cached
        return cached[1]

    @property
    def world(self) -> int:
        return self.generation_batch_size // (self.per_device_train_batch_size * self.steps_per_generation)

    def replay_values(self) -> dict[str, Any]:
        """The core knobs as set on this config (name without prefix -> value)."""
        return {k.name: getattr(self, PREFIX + k.name) for k in knobs()}

    def replay_settings(self) -> "ReplaySettings":
        """The run's replay settings: one :class:`ReplayConfig` (every core ``replay_*`` field validated once, errors
        naming the field as the user spells it) and its :class:`~.plan.ReplayPlan`.  Built when the config is
        constructed and kept; rebuilt only if a field they depend on has changed since."""
        key = self._settings_key()
        cached = self.__dict__.get("_hdr_settings")
        if cached is None or cached[0] != key:
            cached = (key, self._build_settings())
            self.__dict__["_hdr_settings"] = cached
        return cached[1]

    def _settings_key(self) -> str:
        trl = (self.world, self.per_device_train_batch_size, self.gradient_accumulation_steps,
               self.steps_per_generation, self.num_iterations, self.num_generations)
        return repr((trl, sorted(self.replay_values().items())))

    def _build_settings(self) -> "ReplaySettings":
        values = self.replay_values()
        values["group_size"] = self.num_generations
        label = lambda n: PREFIX + n  # noqa: E731
        # the one validation of the fields as set (an unset K_rep checks as 0); the plan then works with valid values
        user = ReplayConfig.from_flat({**values, "k_rep": values["k_rep"] or 0}, label=label, where="HDRGRPOConfig")
        plan = plan_replay(world=self.world, per_device=self.per_device_train_batch_size,
                           ga=self.gradient_accumulation_steps, spg=self.steps_per_generation,
                           iterations=self.num_iterations, n=self.num_generations, k_rep=values["k_rep"],
                           capacity=user.capacity, max_scan=user.max_scan, selector=user.selector,
                           user_unit=user.truncate_multiple, tau=user.tau)
        config = user
        if (plan.k_rep, plan.unit) != (user.k_rep, user.truncate_multiple):  # K_rep and u as the plan sets them
            config = ReplayConfig.from_flat({**values, "k_rep": plan.k_rep, "truncate_multiple": plan.unit},
                                            label=label, where="HDRGRPOConfig")
        return ReplaySettings(config=config, plan=plan)

    def replay_plan(self) -> ReplayPlan:
        """Fresh groups per replay step, truncation unit and K_rep of this configuration (:meth:`replay_settings`)."""
        return self.replay_settings().plan

    def to_replay_config(self) -> ReplayConfig:
        """The core ReplayConfig these fields describe, K_rep and the truncation unit as the plan sets them
        (:meth:`replay_settings`)."""
        return self.replay_settings().config

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig) -> "HDRGRPOConfig":
        """A plain (already validated) ``GRPOConfig`` with the default replay settings added."""
        new = cls.__new__(cls)
        new.__dict__.update(args.__dict__)
        for f in fields(_ReplayFields):
            setattr(new, f.name, f.default)
        new._check_replay(emit=True)
        return new

    @classmethod
    def replay_help(cls) -> str:
        """One line per replay field: name, default, help."""
        return "\n".join(f"{f.name} (default {f.default!r}): {f.metadata['help']}" for f in fields(_ReplayFields))


def _strategy_options(value, name: str, cls):
    """A strategy's JSON knob (a dict, a JSON object string or None) as its options dataclass ``cls``; errors name
    ``name`` and the offending key."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ReplayConfigError(f"HDRGRPOConfig: {name} is not valid JSON ({e})", field=name) from None
    if not isinstance(value, dict):
        raise ReplayConfigError(f"HDRGRPOConfig: {name} must be a dict of {cls.__name__} fields, got {value!r}",
                                field=name)
    unknown = sorted(set(value) - set(cls.__dataclass_fields__))
    if unknown:
        raise ReplayConfigError(f"HDRGRPOConfig: {name} has unknown key(s) {unknown}; valid: "
                                f"{sorted(cls.__dataclass_fields__)}", field=name)
    try:
        return cls(**value)
    except ReplayConfigError as e:
        raise ReplayConfigError(f"HDRGRPOConfig: {name}.{e.field}: {e}", field=name) from None


def as_replay_config(args, model) -> HDRGRPOConfig:
    """What ``HDRGRPOTrainer(args=...)`` accepts: an HDRGRPOConfig, a plain GRPOConfig (converted, with a warning
    that says which replay settings it gets), or None (a default HDRGRPOConfig, as GRPOTrainer builds its own)."""
    if isinstance(args, HDRGRPOConfig):
        return args
    if args is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return HDRGRPOConfig(f"{name.split('/')[-1]}-GRPO")
    if isinstance(args, GRPOConfig):
        new = HDRGRPOConfig.from_grpo_config(args)
        warnings.warn(
            f"HDRGRPOTrainer got a plain GRPOConfig: converted to HDRGRPOConfig with the default replay settings "
            f"(replay_selector={new.replay_selector!r}, replay_k_rep={new.replay_plan().k_rep}, "
            f"replay_tau={new.replay_tau}, replay_capacity={new.replay_capacity}). Pass HDRGRPOConfig(...) to choose "
            "them, or HDRGRPOConfig(..., replay_selector='none') for plain GRPO.", UserWarning, stacklevel=3)
        return new
    raise TypeError(f"HDRGRPOTrainer: args must be an HDRGRPOConfig, a GRPOConfig or None, got {type(args).__name__}")
