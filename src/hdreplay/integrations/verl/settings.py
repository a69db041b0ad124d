"""The ``hdr`` config section of the verl recipe and the checks run when training starts.

``hdr`` keys are the :class:`hdreplay.ReplayConfig` knobs plus the integration knobs
(``diagnostics_dir``, ``resume_without_state``), declared once in the core and turned into an
OmegaConf structured schema by :mod:`.schema`.  :func:`validate_verl_config` rejects verl settings the replay
layout cannot honour, with errors that name the config key to change.  ``trainer.use_v1`` picks the recipe:
``true`` (verl's default) the v1 ``PPOTrainer`` recipe (:mod:`.v1_trainer`), ``false`` the v0
``RayPPOTrainer`` recipe (:mod:`.trainer`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from omegaconf import ListConfig

from ... import baselines as _peers  # noqa: F401  (registers the peers' selectors)
from ...config import ReplayConfig
from ...diagnostics import DiagnosticsConfig, observers
from ...errors import ReplayConfigError
from .schema import DIAGNOSTIC_KEYS, RECIPE_KEYS, checked_section

#: verl advantage estimators whose advantages are not one value per response (token-level or
#: critic-based); replay stores response-level advantages, so these are rejected.
TOKEN_LEVEL_ESTIMATORS = ("gae", "reinforce_plus_plus", "remax", "optimal_token_baseline",
                          "tir_optimal_token_baseline")

ACTOR = "actor_rollout_ref.actor"


def verl_truncate_multiple(*, ppo_mini_batch_size: int, n: int, dp: int) -> int:
    """u in groups: the fewest groups whose ``u * n`` rows fill whole global mini-batches and split
    evenly over the data-parallel ranks.

    verl's actor update cuts each rank's contiguous slice into mini-batches of
    ``ppo_mini_batch_size * n / dp`` rows and asserts that they divide exactly, so the replay rows
    added to a (valid) fresh batch must be a multiple of ``lcm(ppo_mini_batch_size * n, dp)``.
    With verl's own precondition ``(ppo_mini_batch_size * n) % dp == 0`` this is ``ppo_mini_batch_size``.
    """
    for name, v in (("ppo_mini_batch_size", ppo_mini_batch_size), ("n", n), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ReplayConfigError(f"{name} must be an int >= 1, got {v!r}")
    rows = math.lcm(ppo_mini_batch_size * n, dp)
    return rows // math.gcd(n, rows)


def _get(cfg: Any, dotted: str, default=None):
    cur = cfg
    for part in dotted.split("."):
        if cur is None or isinstance(cur, (list, tuple, ListConfig, str)):  # (a section given as a list)
            return default
        cur = cur.get(part, None) if hasattr(cur, "get") else getattr(cur, part, None)
    return default if cur is None else cur


#: the verl keys the recipe reads: their types are checked before any is used (a config built by hand need not
#: have passed verl's schema); None = may be absent
TYPED_KEYS = {"actor_rollout_ref.rollout.n": int, f"{ACTOR}.ppo_mini_batch_size": int, f"{ACTOR}.ppo_epochs": int,
              "data.train_batch_size": int, "trainer.use_v1": bool, f"{ACTOR}.shuffle": bool}


def _typed(cfg: Any, dotted: str, default):
    """``cfg.<dotted>`` of the type :data:`TYPED_KEYS` declares (ints >= 1), else ReplayConfigError naming the key."""
    v = _get(cfg, dotted, default)
    want = TYPED_KEYS[dotted]
    ok = isinstance(v, bool) if want is bool else isinstance(v, int) and not isinstance(v, bool) and v >= 1
    if not ok:
        what = "true or false" if want is bool else "an int >= 1"
        raise ReplayConfigError(f"{dotted}: must be {what}, got {v!r}", field=dotted)
    return v


def type_problems(config: Any) -> list[str]:
    """One line per key of :data:`TYPED_KEYS` whose value has the wrong type."""
    out = []
    for key in TYPED_KEYS:
        if _get(config, key) is not None:
            try:
                _typed(config, key, None)
            except ReplayConfigError as e:
                out.append(str(e))
    return out


@dataclass(frozen=True)
class HDRSettings:
    """The resolved ``hdr`` section.

    replay_config:         the core ReplayConfig (``truncate_multiple`` = lcm(hdr.truncate_multiple, u_verl),
                           ``group_size`` = rollout.n)
    unit:                  u_verl, the recipe's truncation unit in groups: 1 on v1 (the last mini-batch is
                           completed with zero-loss rows), whole mini-batches on v0 (:func:`verl_truncate_multiple`)
    v1:                    ``trainer.use_v1``: which recipe runs
    diagnostics_dir:       where steps.jsonl / groups.jsonl go (None = off)
    resume_without_state:  allow resuming from a checkpoint without ``hdreplay/`` state
    """

    replay_config: ReplayConfig
    diagnostics: DiagnosticsConfig
    unit: int
    diagnostics_dir: str | None
    resume_without_state: bool
    v1: bool = True

    @property
    def active(self) -> bool:
        return self.replay_config.selector != "none" and self.replay_config.k_rep > 0

    @classmethod
    def from_config(cls, config: Any, *, dp: int = 1) -> "HDRSettings":
        """Build and validate from a composed verl config that has an ``hdr`` section.

        Keys and types are checked by merging the section into the structured schema
        (:func:`hdr_schema`), ranges by :class:`~hdreplay.ReplayConfig`; errors name ``hdr.<key>``."""
        hdr = _get(config, "hdr")
        if hdr is None:
            raise ReplayConfigError(
                "the config has no `hdr` section; compose hdreplay's hdr_trainer.yaml (python -m "
                "hdreplay.integrations.verl.main ...) or add `+hdr.selector=headroom_drift` etc."
            )
        values = checked_section(hdr)
        n = _typed(config, "actor_rollout_ref.rollout.n", 1)
        mbs = _typed(config, f"{ACTOR}.ppo_mini_batch_size", 1)
        v1 = _typed(config, "trainer.use_v1", True)
        unit = 1 if v1 else verl_truncate_multiple(ppo_mini_batch_size=mbs, n=n, dp=dp)
        recipe = {k: values.pop(k) for k in RECIPE_KEYS}
        diag = {k: values.pop(k) for k in DIAGNOSTIC_KEYS}
        try:
            diagnostics = DiagnosticsConfig(**diag)
        except ReplayConfigError as e:
            raise ReplayConfigError(f"hdr.{e.field}: {e.message}", field=f"hdr.{e.field}") from None
        user_u = values.get("truncate_multiple", 1)
        if isinstance(user_u, int) and not isinstance(user_u, bool) and user_u >= 1:
            values["truncate_multiple"] = math.lcm(user_u, unit)
        values["group_size"] = n
        rc = ReplayConfig.from_flat(values, label=lambda k: f"hdr.{k}", where="hdr")
        if rc.unit != "group" or rc.is_beta > 0:  # the recipe trains whole stored groups with unit row weights
            raise ReplayConfigError(
                f"hdr.{'selector' if rc.unit != 'group' else 'is_beta'}: the verl recipe does not support "
                f"{'single-rollout replay (selector adv_priority)' if rc.unit != 'group' else 'PER loss weights'} "
                "yet; use the TRL integration, or another selector / hdr.is_beta=0",
                field="selector" if rc.unit != "group" else "is_beta")
        observers(diagnostics, rc)  # checked here: adaptive tau's bounds must hold tau
        out = recipe["diagnostics_dir"]
        return cls(replay_config=rc, diagnostics=diagnostics, unit=unit, diagnostics_dir=str(out) if out else None,
                   resume_without_state=bool(recipe["resume_without_state"]), v1=v1)


#: verl v1 trainer modes the recipe has a trainer for (``trainer.v1.trainer_mode``)
V1_MODES = ("sync", "colocate_async", "separate_async")


def validate_verl_config(config: Any) -> HDRSettings:
    """Check a composed verl config for the recipe; returns the resolved :class:`HDRSettings`.

    Raises ReplayConfigError listing every problem, each naming the key to change.  With
    ``hdr.selector=none`` (or ``hdr.k_rep=0``) only the ``hdr`` section is checked: the trainer is
    then plain verl.  Left alone on purpose (orthogonal to replay, see docs/verl.md): verl's staleness
    bound ``trainer.v1.sampler.max_off_policy_*``, DAPO's ``algorithm.filter_groups`` (v1), and rollout
    correction in decoupled mode (``algorithm.rollout_correction.rollout_is`` / ``rollout_rs``: replayed rows carry
    their birth weights and mask, :func:`_rollout_correction_problems`).
    """
    problems = type_problems(config)
    if problems:  # the checks below read these keys
        _raise(problems)
    try:
        settings = HDRSettings.from_config(config)
    except ReplayConfigError as e:
        settings = None
        problems.append(str(e))
    v1 = _typed(config, "trainer.use_v1", True)
    active = settings.active if settings is not None else (
        _get(config, "hdr.selector", "none") != "none" and _get(config, "hdr.k_rep", 0) != 0)
    if not active:
        _raise(problems)
        return settings
    problems += _common_problems(config, v1=v1)
    problems += _v1_problems(config) if v1 else _v0_problems(config, settings)
    _raise(problems)
    return settings


def _common_problems(config: Any, *, v1: bool) -> list[str]:
    problems = []
    if _get(config, f"{ACTOR}.shuffle", False):
        problems.append(f"{ACTOR}.shuffle=true: replay rows must fill the first mini-batches in order, and verl "
                        "shuffles each rank's rows; set it to false")
    epochs = _get(config, f"{ACTOR}.ppo_epochs", 1)
    if epochs != 1:
        problems.append(f"{ACTOR}.ppo_epochs={epochs}: the replay-prefix layout is defined for one pass over the "
                        "actor batch; set it to 1")
    est = str(_get(config, "algorithm.adv_estimator", "gae"))
    if est in TOKEN_LEVEL_ESTIMATORS:
        problems.append(f"algorithm.adv_estimator={est}: replay stores one advantage per response (GRPO-style group "
                        "estimators such as grpo, rloo, grpo_passk, gpg, opo); token-level or critic-based estimators "
                        "are not supported")
    if _get(config, "critic.enable", None):
        problems.append("critic.enable=true: replayed groups carry no values/returns for a critic; disable the critic")
    problems += _rollout_correction_problems(config, v1=v1)
    if _get(config, f"{ACTOR}.use_prefix_grouper", False):
        problems.append(f"{ACTOR}.use_prefix_grouper=true: it keeps uid groups together on ranks, which conflicts "
                        "with the per-mini-batch row balancing of the replay layout; set it to false")
    if _get(config, "distillation.enabled", False):
        problems.append("distillation.enabled=true: replayed rows carry no teacher outputs; disable distillation")
    n = _typed(config, "actor_rollout_ref.rollout.n", 1)
    if n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={n}: a GRPO group needs n >= 2 responses to be mixed; "
                        "raise rollout.n")
    return problems


def _rollout_correction_problems(config: Any, *, v1: bool) -> list[str]:
    """verl's rollout correction with replay (docs/verl.md, "Rollout correction"): a replayed row carries its birth
    ``rollout_is_weights`` (pi_old / pi_rollout at birth, truncated), so with the PPO ratio against its stored
    ``old_log_probs`` its weight is what a fresh row's is; ``rollout_rs`` acts on the fresh rows' mask before the
    seam and replay stores that mask.  Refused: what has no birth-time meaning for a replayed row.  ``bypass_mode`` on
    the v1 recipe is checked by :mod:`.async_settings` (asynchronous pipelines: replay measures Drift against the
    stored rollout log-probs there, with a floor)."""
    rc = _get(config, "algorithm.rollout_correction")
    if rc is None:
        return []
    key, problems = "algorithm.rollout_correction", []
    if _get(rc, "bypass_mode", False) and not v1:
        problems.append(f"{key}.bypass_mode=true: it replaces old_log_probs by the inference engine's log-probs, so "
                        "Drift would be measured against them (never 0 even at unchanged weights); set "
                        f"{key}.bypass_mode=false (decoupled mode, where replayed rows keep their birth weights)")
    level = _get(rc, "rollout_is")
    if level:
        if not _get(config, "actor_rollout_ref.rollout.calculate_log_probs", False):  # verl's default
            problems.append(f"{key}.rollout_is={level} with actor_rollout_ref.rollout.calculate_log_probs=false: "
                            "without the inference engine's log-probs verl computes no importance weights (silently), "
                            "and replayed groups would store none; set actor_rollout_ref.rollout.calculate_log_probs="
                            f"true, or {key}.rollout_is=null")
        if _get(rc, "rollout_is_batch_normalize", False):
            problems.append(f"{key}.rollout_is_batch_normalize=true: it divides each weight by the mean over the batch "
                            "it was computed in, so a replayed row's birth weight was normalized in another batch "
                            "than the one it trains in, and the actor batch's weights no longer average to 1; set "
                            f"{key}.rollout_is_batch_normalize=false")
    return problems


#: verl dtype names -> :data:`hdreplay.diagnostics.noise_floor.PRECISIONS`
_DTYPES = {"bf16": "bf16_weights", "bfloat16": "bf16_weights", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def actor_precision(config: Any) -> str:
    """The precision of the actor's log-prob forward (a key of :data:`hdreplay.diagnostics.noise_floor.PRECISIONS`):
    verl's FSDP engine casts the parameters to ``fsdp_config.mixed_precision.param_dtype`` (default bf16) for the
    forward, Megatron computes in ``megatron.dtype`` (default bfloat16); either way bf16 parameters, i.e.
    ``bf16_weights``."""
    if str(_get(config, f"{ACTOR}.strategy", "fsdp")) == "megatron":
        name = _get(config, f"{ACTOR}.megatron.dtype", "bfloat16")
    else:
        name = _get(config, f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", "bf16")
    return _DTYPES.get(str(name).lower(), "bf16_weights")


def warn_drift_floor(config: Any, settings: HDRSettings) -> str | None:
    """Warn (:class:`hdreplay.diagnostics.noise_floor.DriftFloorWarning`) when the measured Drift floor of the actor's
    precision reaches tau/10; returns the message (None: no warning)."""
    from ...diagnostics.noise_floor import DriftFloorWarning, floor_warning

    msg = floor_warning(settings.replay_config, actor_precision(config),
                        adaptive=settings.diagnostics.adaptive_tau) if settings.active else None
    if msg:
        warnings.warn(msg, DriftFloorWarning, stacklevel=3)
    return msg


def _v1_problems(config: Any) -> list[str]:
    from .async_settings import async_problems

    mode = _get(config, "trainer.v1.trainer_mode", "sync")
    if mode not in V1_MODES:
        return [f"trainer.v1.trainer_mode={mode}: the recipe has trainers for {list(V1_MODES)}; pick one of them "
                "or run with hdr.selector=none"]
    return async_problems(lambda key, default=None: _get(config, key, default))


def _v0_problems(config: Any, settings: HDRSettings | None) -> list[str]:
    problems = []
    if _get(config, "algorithm.filter_groups.enable", False):
        problems.append("algorithm.filter_groups.enable=true with trainer.use_v1=false: verl's v0 RayPPOTrainer "
                        "ignores DAPO dynamic sampling (it runs only in the v1 trainer); set trainer.use_v1=true")
    tbs = _get(config, "data.train_batch_size")
    mbs = _get(config, f"{ACTOR}.ppo_mini_batch_size")
    if isinstance(tbs, int) and isinstance(mbs, int) and mbs > 0 and tbs % mbs:
        problems.append(f"data.train_batch_size={tbs} is not a multiple of {ACTOR}.ppo_mini_batch_size={mbs}; verl "
                        "trains whole mini-batches, so the fresh batch must divide into them")
    if settings is not None and settings.replay_config.k_rep < settings.replay_config.truncate_multiple:
        k, u = settings.replay_config.k_rep, settings.replay_config.truncate_multiple
        problems.append(f"hdr.k_rep={k} is smaller than the replay unit u={u} groups (lcm of "
                        f"{ACTOR}.ppo_mini_batch_size={mbs} and hdr.truncate_multiple): accepted groups are cut to "
                        "a multiple of u, so nothing could ever be replayed; raise hdr.k_rep or lower "
                        "ppo_mini_batch_size (or use the v1 recipe, trainer.use_v1=true, whose unit is 1 group)")
    return problems


def _raise(problems: list[str]) -> None:
    if problems:
        raise ReplayConfigError("hdreplay verl recipe: incompatible configuration:\n  - " + "\n  - ".join(problems))
