"""The ``hdr`` config section as an OmegaConf structured config, declared literally below.

:class:`HDRSection` has one field per replay setting, grouped as the method (one-to-one with
:class:`hdreplay.ReplayConfig`: same names, defaults and help, held by ``tests/verl/test_verl_config.py``), the scan's
engineering, the peers' random orders, the diagnostics (:class:`hdreplay.diagnostics.DiagnosticsConfig`) and the
recipe's own settings.  :func:`register_hdr_schema` puts it in Hydra's ConfigStore as ``hdr_schema``, which
``config/hdr_trainer.yaml`` lists in its defaults, so every setting can be overridden as ``hdr.<name>=...`` and unknown
keys or wrong types are refused by OmegaConf itself.  Booleans are declared ``Any``: OmegaConf reads any int as a
bool (``2`` -> true) and 'yes'/'off' strings too; :func:`checked_section` accepts true / false only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Mapping, Optional, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ...diagnostics import AdaptiveTau
from ...errors import ReplayConfigError

SCHEMA_NAME = "hdr_schema"


@dataclass
class AdaptiveTauSection:
    """``hdr.adaptive_tau``: the fields of :class:`hdreplay.diagnostics.AdaptiveTau` plus ``enabled`` (off by default),
    so ``hdr.adaptive_tau.enabled=true hdr.adaptive_tau.tau_min=1e-4`` works as ordinary dotted overrides."""

    enabled: Any = False
    tau_min: float = 0.0001
    tau_max: float = 0.1
    factor: float = 2.0
    accept_low: float = 0.1
    kl_rise: float = 0.25
    fast: float = 0.3
    slow: float = 0.05
    patience: int = 5
    warmup: int = 5


@dataclass
class HDRSection:
    """The ``hdr`` section of the recipe's config (``hdr.<name>=...`` overrides)."""

    # ---- the method (Algorithm 1), one-to-one with hdreplay.ReplayConfig
    selector: str = field(default='headroom_drift', metadata={"help": (
        'replay rule: headroom_drift (the paper: cached-Headroom order + Drift gate), headroom_only (no gate), '
        "drift_only (recency order + gate), recency (latest K groups, the paper's 'GRPO + replay'), none "
        '(on-policy); the peers (registered by importing hdreplay.baselines; the trainers do): uniform (K groups '
        'uniformly at random), freshper (K groups in proportion to ((mean|r| + eps) exp(-age/age_decay))^alpha), '
        'adv_priority (k_rep x n single rollouts in proportion to |A|^alpha)')})
    k_rep: int = field(default=64, metadata={"help": (
        'replay budget K_rep: groups replayed per step (>= 0)')})
    tau: float = field(default=0.001, metadata={"help": (
        'Drift threshold: a scanned group is replayed iff Drift <= tau (>= 0; paper: 1e-3 single-turn reasoning, '
        '1e-2 agentic search, l2 norm)')})
    capacity: int = field(default=512, metadata={"help": (
        'FIFO buffer capacity C in groups (>= 1; paper: 512)')})
    drift_norm: str = field(default='l2', metadata={"help": (
        'l2: mean squared log-prob change (paper); l1: mean absolute change')})
    headroom_weighting: str = field(default='sign', metadata={"help": (
        'sign (paper) or advantage (|A_i|-weighted Headroom)')})
    ingress: str = field(default='mixed', metadata={"help": (
        'ingress rule: mixed (rewards not all equal), answer (1 <= #{r_i >= answer_threshold} <= n-1) or all '
        '(every group); from Python also a callable GroupRecord -> bool')})
    answer_threshold: Optional[float] = field(default=None, metadata={"help": (
        'a_i = 1[r_i >= answer_threshold] for ingress=answer (paper: 0.9 for rewards 0/0.1/0.9/1.0)')})
    truncate_multiple: int = field(default=1, metadata={"help": (
        'u: the accepted list is cut to a multiple of u, keeping its highest-priority prefix (1 = no cut)')})
    # ---- the scan's engineering (ReplayConfig.paper() gives the paper's scan)
    max_scan: Optional[int] = field(default=None, metadata={"help": (
        "scan budget: at most this many groups are re-scored per step; unset = no cap, the paper's scan (to K_rep"
        ' admitted groups or the end of the buffer). A cap saves forwards when the gate passes few groups and C >'
        " 8 K_rep; at the paper's settings (C 512, K_rep 128) a cap of 8 K_rep never binds")})
    scan_passes: int = field(default=4, metadata={"help": (
        "exact early rejection: each scanned group's responses are forwarded in at most this many slices (batched"
        ' across the groups of a scan window) and a group stops being forwarded once the Drift of what was '
        "forwarded already proves Drift > tau; the gate decisions are the full scan's. 1 = every group forwarded "
        'whole')})
    scan_refresh: str = field(default='slice', metadata={"help": (
        'cached Headroom of a group rejected early: slice (refresh from the responses forwarded), finish (forward'
        " the rest of the group for its exact Headroom: the paper's refresh, at the full scan's cost for those "
        'groups)')})
    scan_tokens: Optional[int] = field(default=None, metadata={"help": (
        'token budget of one scorer forward (prompt + completion tokens of the rows it runs; the trainers set it '
        "from their own old-log-prob forward's batch). Set: each scan window is filled to whole forwards of this "
        'size, further groups scored in the room left (speculatively: beyond the stop their results are '
        'discarded, their cache untouched), and groups are sliced (scan_passes) only where the running acceptance'
        ' rate says slicing saves at least one forward. Unset: windows sized by the groups still needed, every '
        'group sliced. It must fit the largest group (refused before any forward otherwise)')})
    scan_chunk: Optional[int] = field(default=None, metadata={"help": (
        'groups re-scored per scorer call; unset = sized from the remaining budget and the running acceptance '
        'rate')})
    max_scan_chunk: int = field(default=1024, metadata={"help": (
        'upper bound on an automatically sized chunk (memory of one scorer call)')})
    acceptance_ema: float = field(default=0.5, metadata={"help": (
        'weight of the newest step in the running acceptance rate that sizes chunks, in (0, 1]')})
    skip_rejected: int = field(default=0, metadata={"help": (
        'futile re-scoring: a group the gate rejects with Drift D (or the early-rejection bound of it) is not '
        "scanned at the next min(skip_rejected, 1 + floor(log2(D / tau))) steps (0 = off, the paper's scan: a "
        'rejected group may be scanned again at the next step)')})
    # ---- the peers' random orders (hdreplay.baselines)
    seed: int = field(default=0, metadata={"help": (
        'seed of the random orders (uniform, freshper, adv_priority); their generator state is checkpointed, so a'
        ' resumed run draws what the uninterrupted one draws')})
    priority_alpha: float = field(default=0.6, metadata={"help": (
        "freshper / adv_priority: units are drawn in proportion to priority^alpha (>= 0; 0 = uniform; FreshPER's "
        'priority_exponent 0.6)')})
    age_decay: Optional[float] = field(default=None, metadata={"help": (
        "freshper / adv_priority: multiply the priority by exp(-age / age_decay), age in steps (> 0; FreshPER's "
        'tau_age; unset = no decay, i.e. plain PER)')})
    is_beta: float = field(default=0.0, metadata={"help": (
        "freshper / adv_priority: PER importance weights (N P(i))^-beta / max on the replayed rows' loss, in [0, "
        '1] (0 = off; FreshPER / PER: 0.4)')})
    max_age: Optional[int] = field(default=None, metadata={"help": (
        'no unit older than max_age steps is replayed, and units reaching that age are evicted at commit (>= 1; '
        "unset = FIFO capacity only; adv_priority's tau_max)")})
    # ---- diagnostics and experiments (hdreplay.diagnostics.DiagnosticsConfig)
    diagnose_ungated: Any = field(default=False, metadata={"help": (
        'also re-score the groups recency replay picks, so their Drift and replay KL are reported (one forward '
        'over them)')})
    counterfactual: Any = field(default=False, metadata={"help": (
        'also score the subset recency replay would take from the same pre-step buffer and record it beside the '
        "selection (the paper's same-buffer counterfactual; one forward over the recency groups not scanned "
        'anyway)')})
    adaptive_tau: AdaptiveTauSection = field(default_factory=AdaptiveTauSection, metadata={"help": (
        'move tau within bounds (loosen when replay starves, tighten when replay KL rises); tau is the start. An '
        'AdaptiveTau, or its fields as a dict / JSON object, e.g. {"tau_min": 1e-4, "tau_max": 0.1} '
        '(hdr.adaptive_tau.enabled=true turns it on)')})
    # ---- the recipe
    diagnostics_dir: Optional[str] = field(default=None, metadata={"help": (
        "directory of steps.jsonl / groups.jsonl; unset = the trainer's default (TRL: <output_dir>/replay, verl: "
        '<default_local_dir>/hdreplay_diagnostics), empty string = off')})
    resume_without_state: Any = field(default=False, metadata={"help": (
        'allow resuming from a checkpoint that has no replay state (e.g. written without hdreplay), or one whose '
        'replay state belongs to another run or step; the buffer then starts empty. Off by default: losing the buffer '
        'silently changes the run')})


#: the diagnostics' keys (handed to hdreplay.diagnostics.DiagnosticsConfig) and the recipe's own
DIAGNOSTIC_KEYS = ("diagnose_ungated", "counterfactual", "adaptive_tau")
RECIPE_KEYS = ("diagnostics_dir", "resume_without_state")


def _bool_keys(schema: type = HDRSection, prefix: str = "hdr") -> set[str]:
    out = set()
    for name, typ in get_type_hints(schema).items():
        if is_dataclass(typ):
            out |= _bool_keys(typ, f"{prefix}.{name}")
        elif typ is Any:
            out.add(f"{prefix}.{name}")
    return out


def hdr_schema() -> type:
    """The dataclass behind the ``hdr`` section."""
    return HDRSection


@functools.lru_cache(maxsize=None)
def _structured() -> DictConfig:
    return OmegaConf.structured(hdr_schema())


def knob_help() -> dict[str, str]:
    """``hdr.<name>`` -> help text (for docs and ``--help`` style listings)."""
    return {f"hdr.{f.name}": f.metadata["help"] for f in fields(HDRSection)}


def register_hdr_schema() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent); call before composing ``hdr_trainer``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=hdr_schema(), package="hdr")


def _strict_types(raw: Mapping[str, Any], prefix: str = "hdr", schema: type | None = None) -> None:
    """Refuse what OmegaConf would coerce silently: anything but true / false for a bool knob, a bool for an int
    knob, a non-mapping for the adaptive_tau section."""
    bools = _bool_keys()
    for name, typ in get_type_hints(schema or HDRSection).items():
        if name not in raw:
            continue
        v, key = raw[name], f"{prefix}.{name}"
        if is_dataclass(typ):
            if v is not None and not isinstance(v, Mapping):
                raise ReplayConfigError(f"{key}: must be a mapping (e.g. {key}.enabled=true), got {v!r}", field=key)
            _strict_types(v or {}, key, typ)
        elif key in bools and not isinstance(v, bool):
            raise ReplayConfigError(f"{key}: must be true or false, got {v!r}", field=key)
        elif typ in (int, Optional[int]) and isinstance(v, bool):
            raise ReplayConfigError(f"{key}: must be an int, got {v!r}", field=key)


def checked_section(hdr: Any) -> dict[str, Any]:
    """Validate an ``hdr`` section (DictConfig or mapping) against the schema; plain dict of every knob.

    Raises ReplayConfigError naming ``hdr.<key>`` for an unknown key or a value of the wrong type.
    Interpolations (the packaged ``diagnostics_dir: ${trainer.default_local_dir}/...``) are resolved
    against the full config the section belongs to, before the merge detaches it."""
    if not isinstance(hdr, (DictConfig, Mapping)):
        raise ReplayConfigError(f"hdr: must be a mapping of replay settings (hdr.<name>: value), got "
                                f"{type(hdr).__name__}; e.g. hdr.selector=headroom_drift hdr.k_rep=64", field="hdr")
    try:
        raw = OmegaConf.to_container(hdr, resolve=True) if isinstance(hdr, DictConfig) else dict(hdr)
        _strict_types(raw)
        node = OmegaConf.merge(_structured(), OmegaConf.create(raw))  # (merge copies: the cached node is unchanged)
        values = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
        valid = sorted(f.name for f in fields(HDRSection))
        raise ReplayConfigError(f"hdr.{key}: {e.msg if hasattr(e, 'msg') else e} (valid hdr keys: {valid})",
                                field=f"hdr.{key}") from None
    node = dict(values.get("adaptive_tau") or {})
    enabled = node.pop("enabled", False)
    changed = sorted(k for k, v in node.items() if v != getattr(AdaptiveTau, k))
    if changed and not enabled:
        raise ReplayConfigError(f"hdr.adaptive_tau: {['hdr.adaptive_tau.' + k for k in changed]} set while "
                                "hdr.adaptive_tau.enabled=false; set hdr.adaptive_tau.enabled=true to use the "
                                "adaptive schedule, or drop those overrides", field="hdr.adaptive_tau")
    values["adaptive_tau"] = node if enabled else None
    return values
