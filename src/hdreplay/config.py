"""ReplayConfig: every knob of the replay primitive, declared, documented and validated once.

Each field is declared with :func:`knob` (default + one help text).  The integrations derive their
settings from these declarations instead of restating them:

* TRL: ``HDRGRPOConfig`` gets one ``replay_<name>`` field per knob (type, default and help generated
  from :func:`knobs`), and builds the core config with :meth:`ReplayConfig.from_flat`;
* verl: the ``hdr`` section is an OmegaConf structured config generated from :func:`knobs`;
* the lab CLI (``hdreplay compare ...``) takes ``--replay.<name>`` options generated the same way.

Errors are :class:`~hdreplay.errors.ReplayConfigError` with ``.field`` set, so each front end
re-labels the field with the name its users type (``replay_tau``, ``hdr.tau``, ``--replay.tau``).
A front end builds one ReplayConfig per run and hands it down (TRL: ``HDRGRPOConfig.replay_settings()``,
verl: ``HDRSettings.replay_config``); nothing downstream re-validates it.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Mapping, Union

from .errors import ReplayConfigError
from .ingress import INGRESS_RULES
from .scores import DRIFT_NORMS, HEADROOM_WEIGHTINGS
from .selectors import SCAN_REFRESH, SELECTORS
from .validate import MAX_CAPACITY, MAX_COUNT, MAX_TOKENS  # noqa: F401  (re-exported: the bounds every front end shows)


def knob(default: Any, help: str, *, flat: type | str | None = None, choices: tuple | None = None,
         derived: bool = False):
    """Declare a ReplayConfig field.

    Args:
        default: the default value.
        help: the one help text every front end shows.
        flat: the type front ends parse (``int``, ``float``, ``str``, ``bool``, ``"json"``); default:
            inferred from the default.
        choices: the valid values of a string knob (shown in help, checked by ``__post_init__``); a mapping
            (a registry such as ``SELECTORS``) is read when :func:`knobs` is called.
        derived: set by the integration from its own settings (e.g. ``group_size`` from
            ``num_generations``), not exposed as a knob.
    """
    meta = {"help": help, "flat": flat, "choices": choices, "derived": derived}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Knob:
    """One exposed replay setting, as front ends see it."""

    name: str
    flat: type | str  # int | float | str | bool | "json"
    default: Any
    optional: bool  # None is a valid value
    help: str
    choices: tuple | None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _err(name: str, msg: str) -> ReplayConfigError:
    return ReplayConfigError(f"{name}: {msg}", field=name)


@dataclass(frozen=True)
class ReplayConfig:
    """Configuration of Headroom-Drift Replay and its baselines (one field per knob, see :func:`knobs`).

    Frozen: every value is validated once, at construction (use ``dataclasses.replace`` to derive
    a changed configuration).  Types are strict: no value of the wrong kind is coerced (``"0.9"`` is
    not a number, ``1`` is not ``True``, ``2.0`` is not an int).

    >>> cfg = ReplayConfig(k_rep=4, tau=1e-3, capacity=64)
    >>> cfg.scan_budget  # max_scan unset: the paper's scan, up to the whole buffer
    64
    >>> try:
    ...     ReplayConfig(tau=-1.0)
    ... except ReplayConfigError as e:
    ...     print(e.field, "|", e.message.split(" (")[0])
    tau | the Drift threshold must be a finite number >= 0
    """

    # ---- the method (Algorithm 1): what the paper sets
    selector: str = knob(
        "headroom_drift",
        "replay rule: headroom_drift (the paper: cached-Headroom order + Drift gate), headroom_only (no gate), "
        "drift_only (recency order + gate), recency (latest K groups, the paper's 'GRPO + replay'), none (on-policy); "
        "the peers (registered by importing hdreplay.baselines; the trainers do): uniform (K groups uniformly at "
        "random), freshper (K groups in proportion to ((mean|r| + eps) exp(-age/age_decay))^alpha), adv_priority "
        "(k_rep x n single rollouts in proportion to |A|^alpha)",
        choices=SELECTORS)  # the live registry: the peers register when hdreplay.baselines is imported
    k_rep: int = knob(64, "replay budget K_rep: groups replayed per step (>= 0)")
    tau: float = knob(1e-3, "Drift threshold: a scanned group is replayed iff Drift <= tau (>= 0; paper: 1e-3 "
                            "single-turn reasoning, 1e-2 agentic search, l2 norm)")
    capacity: int = knob(512, "FIFO buffer capacity C in groups (>= 1; paper: 512)")
    drift_norm: str = knob("l2", "l2: mean squared log-prob change (paper); l1: mean absolute change",
                           choices=DRIFT_NORMS)
    headroom_weighting: str = knob("sign", "sign (paper) or advantage (|A_i|-weighted Headroom)",
                                   choices=HEADROOM_WEIGHTINGS)
    ingress: Union[str, Callable] = knob(
        "mixed", "ingress rule: mixed (rewards not all equal), answer (1 <= #{r_i >= answer_threshold} <= n-1) or "
                 "all (every group); from Python also a callable GroupRecord -> bool", flat=str, choices=INGRESS_RULES)
    answer_threshold: float | None = knob(
        None, "a_i = 1[r_i >= answer_threshold] for ingress=answer (paper: 0.9 for rewards 0/0.1/0.9/1.0)",
        flat=float)
    truncate_multiple: int = knob(
        1, "u: the accepted list is cut to a multiple of u, keeping its highest-priority prefix (1 = no cut)")

    # ---- the scan's engineering: how the selection is computed (ReplayConfig.paper() sets the paper's scan)
    max_scan: int | None = knob(
        None, "scan budget: at most this many groups are re-scored per step; unset = no cap, the paper's scan (to "
              "K_rep admitted groups or the end of the buffer). A cap saves forwards when the gate passes few groups "
              "and C > 8 K_rep; at the paper's settings (C 512, K_rep 128) a cap of 8 K_rep never binds", flat=int)
    scan_passes: int = knob(
        4, "exact early rejection: each scanned group's responses are forwarded in at most this many slices (batched "
           "across the groups of a scan window) and a group stops being forwarded once the Drift of what was forwarded "
           "already proves Drift > tau; the gate decisions are the full scan's. 1 = every group forwarded whole")
    scan_refresh: str = knob(
        "slice", "cached Headroom of a group rejected early: slice (refresh from the responses forwarded), finish "
                 "(forward the rest of the group for its exact Headroom: the paper's refresh, at the full scan's cost "
                 "for those groups)", choices=SCAN_REFRESH)
    scan_tokens: int | None = knob(
        None, "token budget of one scorer forward (prompt + completion tokens of the rows it runs; the trainers set it "
              "from their own old-log-prob forward's batch). Set: each scan window is filled to whole forwards of this "
              "size, further groups scored in the room left (speculatively: beyond the stop their results are "
              "discarded, their cache untouched), and groups are sliced (scan_passes) only where the running acceptance "  # noqa: E501
              "rate says slicing saves at least one forward. Unset: windows sized by the groups still needed, every "
              "group sliced. It must fit the largest group (refused before any forward otherwise)", flat=int)
    scan_chunk: int | None = knob(
        None, "groups re-scored per scorer call; unset = sized from the remaining budget and the running "
              "acceptance rate", flat=int)
    max_scan_chunk: int = knob(1024, "upper bound on an automatically sized chunk (memory of one scorer call)")
    acceptance_ema: float = knob(0.5, "weight of the newest step in the running acceptance rate that sizes "
                                      "chunks, in (0, 1]")
    skip_rejected: int = knob(
        0, "futile re-scoring: a group the gate rejects with Drift D (or the early-rejection bound of it) is not "
           "scanned at the next min(skip_rejected, 1 + floor(log2(D / tau))) steps (0 = off, the paper's scan: a "
           "rejected group may be scanned again at the next step)")
    group_size: int | None = knob(None, "if set, every ingress group must have exactly this many responses",
                                  flat=int, derived=True)

    # ---- the peers (hdreplay.baselines): their random orders and age limits
    seed: int = knob(0, "seed of the random orders (uniform, freshper, adv_priority); their generator state is "
                        "checkpointed, so a resumed run draws what the uninterrupted one draws")
    priority_alpha: float = knob(0.6, "freshper / adv_priority: units are drawn in proportion to priority^alpha "
                                      "(>= 0; 0 = uniform; FreshPER's priority_exponent 0.6)")
    age_decay: float | None = knob(
        None, "freshper / adv_priority: multiply the priority by exp(-age / age_decay), age in steps (> 0; FreshPER's "
              "tau_age; unset = no decay, i.e. plain PER)", flat=float)
    is_beta: float = knob(0.0, "freshper / adv_priority: PER importance weights (N P(i))^-beta / max on the replayed "
                               "rows' loss, in [0, 1] (0 = off; FreshPER / PER: 0.4)")
    max_age: int | None = knob(
        None, "no unit older than max_age steps is replayed, and units reaching that age are evicted at commit "
              "(>= 1; unset = FIFO capacity only; adv_priority's tau_max)", flat=int)

    def __post_init__(self) -> None:
        if not isinstance(self.selector, str) or self.selector not in SELECTORS:
            peers = "" if "uniform" in SELECTORS else (" (the peers' random orders register when hdreplay.baselines "
                                                       "is imported)")
            raise _err("selector", f"unknown selector {self.selector!r}; valid: {sorted(SELECTORS)}{peers}")
        if not _is_int(self.k_rep) or not 0 <= self.k_rep <= MAX_COUNT:
            raise _err("k_rep", f"the replay budget (groups per step) must be an int in [0, {MAX_COUNT}], "
                                f"got {self.k_rep!r}")
        if not _is_real(self.tau) or not math.isfinite(self.tau) or self.tau < 0:
            raise _err("tau", f"the Drift threshold must be a finite number >= 0 (to replay without a gate use "
                              f"selector=headroom_only), got {self.tau!r}")
        if not _is_int(self.capacity) or not 1 <= self.capacity <= MAX_CAPACITY:
            raise _err("capacity", f"the buffer size in groups must be an int in [1, {MAX_CAPACITY}], "
                                   f"got {self.capacity!r}")
        if not isinstance(self.drift_norm, str) or self.drift_norm not in DRIFT_NORMS:
            raise _err("drift_norm", f"unknown drift norm {self.drift_norm!r}; valid: {list(DRIFT_NORMS)}")
        if not isinstance(self.headroom_weighting, str) or self.headroom_weighting not in HEADROOM_WEIGHTINGS:
            raise _err("headroom_weighting", f"unknown weighting {self.headroom_weighting!r}; valid: "
                                             f"{list(HEADROOM_WEIGHTINGS)}")
        if not callable(self.ingress) and (not isinstance(self.ingress, str) or self.ingress not in INGRESS_RULES):
            raise _err("ingress", f"unknown ingress rule {self.ingress!r}; valid: {list(INGRESS_RULES)} or a callable")
        if self.answer_threshold is not None and (not _is_real(self.answer_threshold)
                                                  or not math.isfinite(self.answer_threshold)):
            raise _err("answer_threshold", f"must be a finite number or unset, got {self.answer_threshold!r}")
        if self.ingress == "answer" and self.answer_threshold is None:
            raise _err("answer_threshold", "ingress=answer needs it (a_i = 1[r_i >= threshold]; the paper uses 0.9 "
                                           "for rewards 0/0.1/0.9/1.0)")
        if not _is_int(self.truncate_multiple) or not 1 <= self.truncate_multiple <= MAX_COUNT:
            raise _err("truncate_multiple", f"u must be an int in [1, {MAX_COUNT}], got {self.truncate_multiple!r}")
        if self.scan_chunk is not None and (not _is_int(self.scan_chunk) or not 1 <= self.scan_chunk <= MAX_COUNT):
            raise _err("scan_chunk", f"must be unset (auto) or an int in [1, {MAX_COUNT}], got {self.scan_chunk!r}")
        if self.scan_tokens is not None and (not _is_int(self.scan_tokens) or not 1 <= self.scan_tokens <= MAX_TOKENS):
            raise _err("scan_tokens", f"must be unset (windows sized by the groups still needed) or an int in "
                       f"[1, {MAX_TOKENS}] (prompt + completion tokens per forward), got {self.scan_tokens!r}")
        if not _is_int(self.max_scan_chunk) or not 1 <= self.max_scan_chunk <= MAX_COUNT:
            raise _err("max_scan_chunk", f"must be an int in [1, {MAX_COUNT}], got {self.max_scan_chunk!r}")
        if self.max_scan is not None and (not _is_int(self.max_scan) or not 1 <= self.max_scan <= MAX_CAPACITY):
            raise _err("max_scan", f"must be unset (auto) or an int in [1, {MAX_CAPACITY}], got {self.max_scan!r}")
        if not _is_int(self.scan_passes) or not 1 <= self.scan_passes <= MAX_COUNT:
            raise _err("scan_passes",
                       f"must be an int in [1, {MAX_COUNT}] (1 = whole groups), got {self.scan_passes!r}")
        if not isinstance(self.scan_refresh, str) or self.scan_refresh not in SCAN_REFRESH:
            raise _err("scan_refresh", f"unknown refresh {self.scan_refresh!r}; valid: {list(SCAN_REFRESH)}")
        if not _is_int(self.skip_rejected) or not 0 <= self.skip_rejected <= MAX_CAPACITY:
            raise _err("skip_rejected", f"must be an int in [0, {MAX_CAPACITY}] (steps; 0 = off), got "
                                        f"{self.skip_rejected!r}")
        a = self.acceptance_ema
        if not _is_real(a) or not math.isfinite(a) or not (0 < a <= 1):
            raise _err("acceptance_ema", f"must be in (0, 1], got {a!r}")
        if self.group_size is not None and (not _is_int(self.group_size) or not 1 <= self.group_size <= MAX_COUNT):
            raise _err("group_size", f"must be unset or an int >= 1, got {self.group_size!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise _err("seed", f"must be an int in [0, 2**63), got {self.seed!r}")
        if not _is_real(self.priority_alpha) or not math.isfinite(self.priority_alpha) or self.priority_alpha < 0:
            raise _err("priority_alpha", f"must be a finite number >= 0, got {self.priority_alpha!r}")
        if self.age_decay is not None and (not _is_real(self.age_decay) or not math.isfinite(self.age_decay)
                                           or self.age_decay <= 0):
            raise _err("age_decay", f"must be unset or a finite number > 0 (steps), got {self.age_decay!r}")
        if not _is_real(self.is_beta) or not 0 <= self.is_beta <= 1:
            raise _err("is_beta", f"must be a number in [0, 1], got {self.is_beta!r}")
        if self.max_age is not None and (not _is_int(self.max_age) or not 1 <= self.max_age <= MAX_CAPACITY):
            raise _err("max_age", f"must be unset or an int in [1, {MAX_CAPACITY}] (steps), got {self.max_age!r}")
        spec = SELECTORS[self.selector]
        if (self.age_decay is not None or self.is_beta > 0) and spec.order != "proportional":
            name = "age_decay" if self.age_decay is not None else "is_beta"
            raise _err(name, f"applies to the proportional selectors (freshper, adv_priority), not "
                             f"selector={self.selector!r}; leave it unset")
        if spec.unit == "rollout" and self.group_size is None:
            raise _err("group_size", f"selector {self.selector!r} stores single rollouts and counts k_rep and capacity "
                                     "in groups' worth of rows (x group_size); set group_size")

    @classmethod
    def paper(cls, **settings: Any) -> "ReplayConfig":
        """The paper's method exactly: Headroom order, Drift gate, the whole buffer scanned until K_rep are admitted
        (no ``max_scan`` cap), every scanned group forwarded whole (``scan_passes=1``: its refreshed Headroom is the
        whole group's), no group left out of the walk.  ``settings``: the paper's own knobs (k_rep, tau, capacity,
        drift_norm, headroom_weighting, ingress, answer_threshold, truncate_multiple, group_size).

        >>> ReplayConfig.paper(k_rep=128, tau=1e-3).scan_budget == ReplayConfig.paper().capacity
        True
        """
        engineering = {"selector", "max_scan", "scan_passes", "scan_refresh", "skip_rejected", "max_age"}
        bad = sorted(set(settings) & engineering)
        if bad:
            raise ReplayConfigError(f"ReplayConfig.paper: {bad} are what paper() fixes to the paper's scan; build "
                                    "ReplayConfig(...) directly to change them", field=bad[0])
        return cls(selector="headroom_drift", scan_passes=1, scan_refresh="finish", skip_rejected=0, max_scan=None,
                   **settings)

    @property
    def unit(self) -> str:
        """What the buffer stores: "group" or "rollout" (single responses; ``adv_priority``)."""
        return SELECTORS[self.selector].unit

    @property
    def rows_per_unit(self) -> int:
        """Budgets are in groups: a rollout-unit buffer holds ``capacity * group_size`` rollouts and replays
        ``k_rep * group_size`` of them, the rows ``k_rep`` groups would give."""
        return self.group_size if self.unit == "rollout" else 1

    @property
    def unit_budget(self) -> int:
        """Units replayed per step at most (k_rep groups, or k_rep x group_size rollouts)."""
        return self.k_rep * self.rows_per_unit

    @property
    def unit_capacity(self) -> int:
        return self.capacity * self.rows_per_unit

    @property
    def unit_multiple(self) -> int:
        """The accepted list is cut to a multiple of this many units (``truncate_multiple`` groups' worth)."""
        return self.truncate_multiple * self.rows_per_unit

    @property
    def scan_budget(self) -> int:
        """Groups that may be re-scored per step: ``max_scan``, or (unset) the whole buffer."""
        if self.max_scan is not None:
            return self.max_scan * self.rows_per_unit
        return self.unit_capacity

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (a callable ingress rule is shown by its name)."""
        d = asdict(self)
        if callable(self.ingress):
            d["ingress"] = getattr(self.ingress, "__name__", type(self.ingress).__name__)
        return d

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], *, label: Callable[[str], str] = str,
                  where: str = "") -> "ReplayConfig":
        """Build from flat front-end values (``adaptive_tau`` may be a dict or a JSON string).

        Args:
            values: knob name -> value; names not given keep their defaults.
            label: how the front end spells a knob (``lambda n: f"replay_{n}"``); errors use it.
            where: prefix of error messages (e.g. ``"HDRGRPOConfig"``).
        Raises:
            ReplayConfigError naming ``label(field)`` and what to change.
        """
        if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
            raise ReplayConfigError(f"values: must be a mapping knob name -> value, got {type(values).__name__}")
        if not callable(label) or not isinstance(where, str):
            raise ReplayConfigError("from_flat: label must be a callable and where a str")
        pre = f"{where}: " if where else ""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ReplayConfigError(f"{pre}unknown replay setting(s) {[label(k) for k in unknown]}; valid: "
                                    f"{[label(k.name) for k in knobs()]}", field=label(unknown[0]))
        try:
            return cls(**values)
        except ReplayConfigError as e:
            name = e.field or ""
            raise ReplayConfigError(f"{pre}{label(name)}: {e.message}", field=label(name)) from None


def knobs(*, include_derived: bool = False) -> list[Knob]:
    """The exposed replay settings, in declaration order (what every front end generates its options from)."""
    out = []
    for f in fields(ReplayConfig):
        meta = f.metadata
        if meta.get("derived") and not include_derived:
            continue
        default = f.default if f.default is not MISSING else None
        flat = meta.get("flat") or type(default)
        out.append(Knob(name=f.name, flat=flat, default=default, optional=default is None or flat == "json",
                        help=meta["help"], choices=None if meta.get("choices") is None else tuple(meta["choices"])))
    return out
