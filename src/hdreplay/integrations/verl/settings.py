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
from dataclasses import dataclass
from typing import Any

from omegaconf import ListConfig

from ...config import ReplayConfig
from ...errors import ReplayConfigError
from ..common import INTEGRATION_KNOBS
from .schema import checked_section

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
        recipe = {k.name: values.pop(k.name) for k in INTEGRATION_KNOBS}
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
        diag = recipe["diagnostics_dir"]
        return cls(replay_config=rc, unit=unit, diagnostics_dir=str(diag) if diag else None,
                   resume_without_state=bool(recipe["resume_without_state"]), v1=v1)


#: verl v1 trainer modes the recipe has a trainer for (``trainer.v1.trainer_mode``)
V1_MODES = ("sync", "colocate_async", "separate_async")


def validate_verl_config(config: Any) -> HDRSettings:
    """Check a composed verl config for the recipe; returns the resolved :class:`HDRSettings`.

    Raises ReplayConfigError listing every problem, each naming the key to change.  With
    ``hdr.selector=none`` (or ``hdr.k_rep=0``) only the ``hdr`` section is checked: the trainer is
    then plain verl.  Left alone on purpose (orthogonal to replay, see docs/verl.md): verl's staleness
    bound ``trainer.v1.sampler.max_off_policy_*``, DAPO's ``algorithm.filter_groups`` (v1), and rollout
    rejection sampling ``algorithm.rollout_correction.rollout_rs`` (v1: acts on the fresh rows' mask before
    the seam; replay stores the mask it produced).
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
    rc = _get(config, "algorithm.rollout_correction")
    v1_bypass = v1 and rc is not None and bool(_get(rc, "bypass_mode", False))  # supported: see async_settings.py
    if v1_bypass:
        pass
    elif rc is not None and (_get(rc, "rollout_is") or _get(rc, "bypass_mode", False) or (not v1 and _get(rc, "rollout_rs"))):
        keys = "rollout_is / bypass_mode" if v1 else "rollout_is / rollout_rs / bypass_mode"
        problems.append(f"algorithm.rollout_correction ({keys}) is set: replayed rows have no rollout importance "
                        "weights (and with bypass_mode Drift would be measured against the inference engine's "
                        "log-probs, never 0 even at unchanged weights); set rollout_is=null, bypass_mode=false"
                        + ("" if v1 else ", rollout_rs=null"))
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
