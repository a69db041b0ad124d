"""HDRGRPOConfig: GRPOConfig plus the replay settings, each declared literally below with its help (TRL's idiom).

The fields are grouped as the method (one-to-one with :class:`hdreplay.ReplayConfig`: same names, defaults and help,
which ``tests/trl/test_trl_config_fields.py`` holds), the scan's engineering, the peers, the diagnostics
(:class:`hdreplay.diagnostics.DiagnosticsConfig`) and the trainer's own settings.  The only TRL-specific default is
``replay_k_rep`` (unset = half the fresh groups of a step).  The replay arithmetic (fresh groups per step,
truncation unit, refusals and warnings) is :func:`.plan.plan_replay`.  Both are worked out once, when the config is
built (:meth:`HDRGRPOConfig.replay_settings`: one validated :class:`ReplayConfig` and its plan), and handed to the
trainer, its strategy and the log callback.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union

from trl import GRPOConfig

from ...config import ReplayConfig, knobs
from ...diagnostics import DiagnosticsConfig
from ...errors import ReplayConfigError
from .plan import ReplayPlan, ReplaySettingWarning, plan_replay

PREFIX = "replay_"
MICRO_STEP_MODES = ("chunk", "grow")
TRAIN_SCOPES = ("update", "generation")


@dataclass
class _ReplayFields:
    """The replay settings of :class:`HDRGRPOConfig` (``--replay_<name>`` in a TrlParser script)."""

    # ---- the method (Algorithm 1), one-to-one with hdreplay.ReplayConfig
    replay_selector: Literal["headroom_drift", "headroom_only", "drift_only", "recency", "uniform", "freshper",
                             "adv_priority", "none"] = field(default='headroom_drift', metadata={"help": (
        'replay rule: headroom_drift (the paper: cached-Headroom order + Drift gate), headroom_only (no gate), '
        "drift_only (recency order + gate), recency (latest K groups, the paper's 'GRPO + replay'), none "
        '(on-policy); the peers (registered by importing hdreplay.baselines; the trainers do): uniform (K groups '
        'uniformly at random), freshper (K groups in proportion to ((mean|r| + eps) exp(-age/age_decay))^alpha), '
        'adv_priority (k_rep x n single rollouts in proportion to |A|^alpha)')})
    replay_k_rep: Optional[int] = field(default=None, metadata={"help": (
        'replay budget K_rep: groups replayed per step (>= 0). Unset = half the fresh groups of one replay step '
        "(one optimizer update; the paper's b + b/2), cut to the truncation unit (refused when that is 0; a "
        'config converted from args=None or a plain GRPOConfig replays one unit then, warned).')})
    replay_tau: float = field(default=0.001, metadata={"help": (
        'Drift threshold: a scanned group is replayed iff Drift <= tau (>= 0; paper: 1e-3 single-turn reasoning, '
        '1e-2 agentic search, l2 norm)')})
    replay_capacity: int = field(default=512, metadata={"help": (
        'FIFO buffer capacity C in groups (>= 1; paper: 512)')})
    replay_drift_norm: Literal['l2', 'l1'] = field(default='l2', metadata={"help": (
        'l2: mean squared log-prob change (paper); l1: mean absolute change')})
    replay_headroom_weighting: Literal['sign', 'advantage'] = field(default='sign', metadata={"help": (
        'sign (paper) or advantage (|A_i|-weighted Headroom)')})
    replay_ingress: Literal['mixed', 'answer', 'all'] = field(default='mixed', metadata={"help": (
        'ingress rule: mixed (rewards not all equal), answer (1 <= #{r_i >= answer_threshold} <= n-1) or all '
        '(every group); from Python also a callable GroupRecord -> bool')})
    replay_answer_threshold: Optional[float] = field(default=None, metadata={"help": (
        'a_i = 1[r_i >= answer_threshold] for ingress=answer (paper: 0.9 for rewards 0/0.1/0.9/1.0)')})
    replay_truncate_multiple: int = field(default=1, metadata={"help": (
        'u: the accepted list is cut to a multiple of u, keeping its highest-priority prefix (1 = no cut)')})
    # ---- the scan's engineering (ReplayConfig.paper() gives the paper's scan)
    replay_max_scan: Optional[int] = field(default=None, metadata={"help": (
        "scan budget: at most this many groups are re-scored per step; unset = no cap, the paper's scan (to K_rep"
        ' admitted groups or the end of the buffer). A cap saves forwards when the gate passes few groups and C >'
        " 8 K_rep; at the paper's settings (C 512, K_rep 128) a cap of 8 K_rep never binds")})
    replay_scan_passes: int = field(default=4, metadata={"help": (
        "exact early rejection: each scanned group's responses are forwarded in at most this many slices (batched"
        ' across the groups of a scan window) and a group stops being forwarded once the Drift of what was '
        "forwarded already proves Drift > tau; the gate decisions are the full scan's. 1 = every group forwarded "
        'whole')})
    replay_scan_refresh: Literal['slice', 'finish'] = field(default='slice', metadata={"help": (
        'cached Headroom of a group rejected early: slice (refresh from the responses forwarded), finish (forward'
        " the rest of the group for its exact Headroom: the paper's refresh, at the full scan's cost for those "
        'groups)')})
    replay_scan_tokens: Optional[int] = field(default=None, metadata={"help": (
        'token budget of one scorer forward (prompt + completion tokens of the rows it runs; the trainers set it '
        "from their own old-log-prob forward's batch). Set: each scan window is filled to whole forwards of this "
        'size, further groups scored in the room left (speculatively: beyond the stop their results are '
        'discarded, their cache untouched), and groups are sliced (scan_passes) only where the running acceptance'
        ' rate says slicing saves at least one forward. Unset: windows sized by the groups still needed, every '
        'group sliced. It must fit the largest group (refused before any forward otherwise)')})
    replay_scan_chunk: Optional[int] = field(default=None, metadata={"help": (
        'groups re-scored per scorer call; unset = sized from the remaining budget and the running acceptance '
        'rate')})
    replay_max_scan_chunk: int = field(default=1024, metadata={"help": (
        'upper bound on an automatically sized chunk (memory of one scorer call)')})
    replay_acceptance_ema: float = field(default=0.5, metadata={"help": (
        'weight of the newest step in the running acceptance rate that sizes chunks, in (0, 1]')})
    replay_skip_rejected: int = field(default=0, metadata={"help": (
        'futile re-scoring: a group the gate rejects with Drift D (or the early-rejection bound of it) is not '
        "scanned at the next min(skip_rejected, 1 + floor(log2(D / tau))) steps (0 = off, the paper's scan: a "
        'rejected group may be scanned again at the next step)')})
    # ---- the peers (hdreplay.baselines): the random orders' settings, then one strategy instead of a selector
    replay_seed: int = field(default=0, metadata={"help": (
        'seed of the random orders (uniform, freshper, adv_priority); their generator state is checkpointed, so a'
        ' resumed run draws what the uninterrupted one draws')})
    replay_priority_alpha: float = field(default=0.6, metadata={"help": (
        "freshper / adv_priority: units are drawn in proportion to priority^alpha (>= 0; 0 = uniform; FreshPER's "
        'priority_exponent 0.6)')})
    replay_age_decay: Optional[float] = field(default=None, metadata={"help": (
        "freshper / adv_priority: multiply the priority by exp(-age / age_decay), age in steps (> 0; FreshPER's "
        'tau_age; unset = no decay, i.e. plain PER)')})
    replay_is_beta: float = field(default=0.0, metadata={"help": (
        "freshper / adv_priority: PER importance weights (N P(i))^-beta / max on the replayed rows' loss, in [0, "
        '1] (0 = off; FreshPER / PER: 0.4)')})
    replay_max_age: Optional[int] = field(default=None, metadata={"help": (
        'no unit older than max_age steps is replayed, and units reaching that age are evicted at commit (>= 1; '
        "unset = FIFO capacity only; adv_priority's tau_max)")})
    replay_repo: Optional[Union[dict, str]] = field(default=None, metadata={"help": (
        "RePO's per-prompt replay instead of a selector (replay_selector='none'): a dict / JSON object of "
        'hdreplay.baselines.repo.RepoOptions fields, e.g. {"retrieval": "recent"} (retrieval recent | highest | '
        'max_variance, num_replays 8, min_cache 16, max_cache 16, off_coef 1.0); one process, micro_step chunk, a'
        ' row-mean loss_type')})
    replay_exgrpo: Optional[Union[dict, str]] = field(default=None, metadata={"help": (
        "ExGRPO's experience pool instead of a selector (replay_selector='none'): a dict / JSON object of "
        'hdreplay.baselines.exgrpo.ExgrpoOptions fields, e.g. {} for the released recipe (ratio 0.5, start_solved'
        " 0.35, gamma 0.1, sigma 1.0, correct 1.0, lbound 0, rbound n - 1, seed = the run's seed); one process, "
        'text only, micro_step chunk, loss_type grpo | bnpo | dr_grpo | dapo, beta 0, entropy_coef 0')})
    replay_bapo: Optional[Union[dict, str]] = field(default=None, metadata={"help": (
        "BAPO's buffer-driven batch construction instead of a selector (replay_selector='none'): a dict / JSON "
        'object of hdreplay.baselines.bapo.BapoOptions fields, e.g. {"max_reeval": 16} (bad_thr 1/8, target_range'
        ' [1/8, 2/8], train_range [1/8, 7/8], reeval_every 2, max_reeval 16, max_uids 128, max_target 8, '
        'stale_steps 3, seed 0); one process, text only, one generation per update')})
    replay_popo: Optional[Union[dict, str]] = field(default=None, metadata={"help": (
        "POPO's group replay instead of a selector (replay_selector='none'): each fresh group whose rewards are "
        'all equal is swapped for one of the newest buffered effective groups, trained with decoupled importance '
        'sampling; a dict / JSON object of hdreplay.baselines.popo.PopoOptions fields, e.g. {} (capacity 64, '
        'is_cap 2.0); one process, text only, micro_step chunk, one generation per update')})
    replay_dynamic_sampling: bool = field(default=False, metadata={"help": (
        "DAPO's dynamic sampling: drop groups whose rewards are all equal and generate further prompt batches "
        'until the batch holds only mixed groups (at most dynamic_sampling_max_batches rounds); one process, '
        "replay_selector='none'")})
    replay_dynamic_sampling_max_batches: int = field(default=10, metadata={"help": (
        "generation rounds per batch at most with replay_dynamic_sampling (verl's max_num_gen_batches; >= 1); at "
        'the limit the batch is completed with zero-variance groups (zero advantage) and the shortfall logged')})
    # ---- diagnostics and experiments (hdreplay.diagnostics.DiagnosticsConfig):
    # none changes what is replayed but adaptive tau
    replay_diagnose_ungated: bool = field(default=False, metadata={"help": (
        'also re-score the groups recency replay picks, so their Drift and replay KL are reported (one forward '
        'over them)')})
    replay_counterfactual: bool = field(default=False, metadata={"help": (
        'also score the subset recency replay would take from the same pre-step buffer and record it beside the '
        "selection (the paper's same-buffer counterfactual; one forward over the recency groups not scanned "
        'anyway)')})
    replay_adaptive_tau: Optional[Union[dict, str]] = field(default=None, metadata={"help": (
        'move tau within bounds (loosen when replay starves, tighten when replay KL rises); tau is the start. An '
        'AdaptiveTau, or its fields as a dict / JSON object, e.g. {"tau_min": 1e-4, "tau_max": 0.1}')})
    # ---- the trainer (this integration)
    replay_score_batch_size: Optional[int] = field(default=None, metadata={"help": (
        'rows per forward call when re-scoring replay candidates; unset = per_device_train_batch_size')})
    replay_train_scope: Literal['update', 'generation'] = field(default='update', metadata={"help": (
        'which optimizer updates train a replay row: update = only the update whose Drift gate admitted it (every'
        " replayed token is trained within tau, the paper's guarantee; with steps_per_generation > "
        "gradient_accumulation_steps its rows fill that update's micro-steps, with num_iterations > 1 a later "
        'iteration trains them only if it falls in the same update); generation = spread over every micro-step of'
        ' the generation, also in the updates after the gate, without gating them again (the behaviour before '
        '0.2: measured Drift above tau in the next update, docs/trl.md)')})
    replay_micro_step: Literal['chunk', 'grow'] = field(default='chunk', metadata={"help": (
        'how replay rows enter a micro-step: chunk = extra forward/backward passes of at most '
        'per_device_train_batch_size rows each (activation memory as without replay; the fresh rows form exactly '
        "plain TRL's micro-batch); grow = one forward/backward over fresh + replay rows (activation memory grows "
        'by (fresh + replay rows) / fresh rows). Both run under DDP, DeepSpeed ZeRO-2/3 and FSDP2')})
    replay_diagnostics_dir: Optional[str] = field(default=None, metadata={"help": (
        "directory of steps.jsonl / groups.jsonl; unset = the trainer's default (TRL: <output_dir>/replay, verl: "
        '<default_local_dir>/hdreplay_diagnostics), empty string = off')})
    replay_resume_without_state: bool = field(default=False, metadata={"help": (
        'allow resuming from a checkpoint that has no replay state (e.g. written without hdreplay), or one whose '
        'replay state belongs to another run or step; the buffer then starts empty. Off by default: losing the buffer '
        'silently changes the run')})


REPLAY_FIELDS = tuple(f.name for f in fields(_ReplayFields))
#: the diagnostics' fields (hdreplay.diagnostics.DiagnosticsConfig), the trainer's own, the peers' strategies
DIAGNOSTIC_FIELDS = tuple(PREFIX + n for n in DiagnosticsConfig.field_names())


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
        strategies = [PREFIX + name for name, opts in self._options().items() if opts is not None]
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
        if self.replay_train_scope not in TRAIN_SCOPES:
            raise ReplayConfigError(f"HDRGRPOConfig: replay_train_scope must be one of {list(TRAIN_SCOPES)}, got "
                                    f"{self.replay_train_scope!r}", field="replay_train_scope")
        self.diagnostics_config()
        settings = self.replay_settings()  # built once: every core replay_* field validated, the plan worked out
        if emit:
            settings.plan.warn()

    def repo_options(self):
        """``replay_repo`` as :class:`~hdreplay.baselines.repo.RepoOptions` (None when unset)."""
        return self._options()["repo"]

    def exgrpo_options(self):
        """``replay_exgrpo`` as :class:`~hdreplay.baselines.exgrpo.ExgrpoOptions` (None when unset)."""
        return self._options()["exgrpo"]

    def bapo_options(self):
        """``replay_bapo`` as :class:`~hdreplay.baselines.bapo.BapoOptions` (None when unset)."""
        return self._options()["bapo"]

    def popo_options(self):
        """``replay_popo`` as :class:`~hdreplay.baselines.popo.PopoOptions` (None when unset)."""
        return self._options()["popo"]

    def strategy(self) -> tuple[str, Any]:
        """(name, options) of the run's replay strategy: a peer of :mod:`hdreplay.baselines` set by its JSON knob
        (``repo``, ``exgrpo``, ``bapo``, ``popo``), ``dynamic`` (DAPO's dynamic sampling), else ``replay`` (the core
        controller with ``replay_selector``; options None)."""
        chosen = [(name, opts) for name, opts in self._options().items() if opts is not None]
        if chosen:
            return chosen[0]
        return ("dynamic", None) if self.replay_dynamic_sampling else ("replay", None)

    def _options(self) -> dict[str, Any]:
        """The peers' JSON knobs parsed once (again only after one of them changed): name -> options or None."""
        from ...baselines import BapoOptions, ExgrpoOptions, PopoOptions, RepoOptions

        classes = {"repo": RepoOptions, "exgrpo": ExgrpoOptions, "bapo": BapoOptions, "popo": PopoOptions}
        key = repr(tuple(getattr(self, PREFIX + name) for name in classes))
        cached = self.__dict__.get("_hdr_options")
        if cached is None or cached[0] != key:
            cached = (key, {name: _strategy_options(getattr(self, PREFIX + name), PREFIX + name, cls)
                            for name, cls in classes.items()})
            self.__dict__["_hdr_options"] = cached
        return cached[1]

    @property
    def world(self) -> int:
        return self.generation_batch_size // (self.per_device_train_batch_size * self.steps_per_generation)

    def diagnostics_config(self) -> DiagnosticsConfig:
        """``replay_diagnose_ungated``, ``replay_counterfactual`` and ``replay_adaptive_tau`` as the
        :class:`~hdreplay.diagnostics.DiagnosticsConfig` of the run (errors name the field as spelled here)."""
        try:
            return DiagnosticsConfig(**{n: getattr(self, PREFIX + n) for n in DiagnosticsConfig.field_names()})
        except ReplayConfigError as e:
            name = PREFIX + (e.field or "adaptive_tau")
            raise ReplayConfigError(f"HDRGRPOConfig: {name}: {e.message}",
                                    field=name) from None

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
        new._fill_zero_budget()
        new._check_replay(emit=True)
        return new

    def _fill_zero_budget(self) -> None:
        """For a config the user did not write (``args=None``, a plain GRPOConfig): when the default K_rep (half the
        fresh groups of a step, cut to the truncation unit) is 0 -- TRL's defaults give 1 fresh group per update --
        replay one truncation unit instead, and say so."""
        probe = plan_replay(world=self.world, per_device=self.per_device_train_batch_size,
                            ga=self.gradient_accumulation_steps, spg=self.steps_per_generation,
                            iterations=self.num_iterations, n=self.num_generations, k_rep=None,
                            capacity=self.replay_capacity, max_scan=None, selector="none")
        if self.replay_selector == "none" or self.replay_k_rep is not None or probe.k_rep > 0:
            return
        self.replay_k_rep = k = probe.unit
        F = probe.fresh_groups
        warnings.warn(
            f"HDRGRPOTrainer: with {F} fresh group(s) per optimizer update (per_device_train_batch_size="
            f"{self.per_device_train_batch_size} x gradient_accumulation_steps={self.gradient_accumulation_steps} x "
            f"{self.world} process(es) / num_generations={self.num_generations}, TRL's defaults) the default replay "
            f"budget, half the fresh groups, would be 0 and nothing would be replayed; replaying replay_k_rep={k} "
            f"group(s) per update instead (replay:fresh {k / F:.2f}, fresh share alpha {F / (F + k):.2f}; the paper's "
            "b + b/2 is 0.5). Pass HDRGRPOConfig(..., replay_k_rep=...) to choose, a larger batch for more fresh "
            "groups, or replay_selector='none' for plain GRPO.", ReplaySettingWarning, stacklevel=4)

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
    if args is None:  # as GRPOTrainer: GRPOConfig(f"{model_name}-GRPO"), with the default replay settings
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return HDRGRPOConfig.from_grpo_config(GRPOConfig(f"{name.split('/')[-1]}-GRPO"))
    if isinstance(args, GRPOConfig):
        new = HDRGRPOConfig.from_grpo_config(args)
        warnings.warn(
            f"HDRGRPOTrainer got a plain GRPOConfig: converted to HDRGRPOConfig with the default replay settings "
            f"(replay_selector={new.replay_selector!r}, replay_k_rep={new.replay_plan().k_rep}, "
            f"replay_tau={new.replay_tau}, replay_capacity={new.replay_capacity}). Pass HDRGRPOConfig(...) to choose "
            "them, or HDRGRPOConfig(..., replay_selector='none') for plain GRPO.", UserWarning, stacklevel=3)
        return new
    raise TypeError(f"HDRGRPOTrainer: args must be an HDRGRPOConfig, a GRPOConfig or None, got {type(args).__name__}")
