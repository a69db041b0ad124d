"""ReplayConfig: every knob of the replay primitive, documented once, validated on construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Union

from .adaptive import AdaptiveTau
from .errors import ReplayConfigError
from .ingress import INGRESS_RULES, make_ingress_rule
from .scores import DRIFT_NORMS, HEADROOM_WEIGHTINGS
from .selection import SELECTORS


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class ReplayConfig:
    """Configuration of Headroom-Drift Replay and its baselines.

    Attributes:
        selector: which replay rule runs (see ``hdreplay.SELECTORS``):
            ``headroom_drift`` (paper: cached-Headroom order + Drift gate),
            ``headroom_only`` (Headroom order, no gate), ``drift_only`` (recency order + gate),
            ``recency`` (latest K groups, the paper's "GRPO + replay"), ``none`` (on-policy).
        k_rep: replay budget K_rep, groups per step (>= 0).
        tau: Drift threshold; a scanned group is accepted iff Drift <= tau (>= 0; the paper uses
            1e-3 for single-turn reasoning and 1e-2 for agentic search with the l2 norm).
        capacity: FIFO buffer capacity C in groups (>= 1; the paper uses 512).
        drift_norm: ``l2`` (mean squared log-prob change, paper) or ``l1`` (mean absolute).
        headroom_weighting: ``sign`` (paper) or ``advantage`` (|A_i|-weighted).
        ingress: ``mixed`` (rewards not all equal), ``answer`` (answer-mixed, needs
            ``answer_threshold``) or a callable ``GroupRecord -> bool``.
        answer_threshold: a_i = 1[r_i >= answer_threshold] for ``ingress="answer"``.
        truncate_multiple: u; the accepted list is cut to a multiple of u, keeping its
            highest-priority prefix (1 = no truncation).
        scan_chunk: groups re-scored per scorer call; ``None`` sizes each chunk from the
            remaining budget and the running acceptance rate.
        max_scan_chunk: upper bound on an automatically sized chunk (memory bound of one call).
        acceptance_ema: weight of the newest step in the running acceptance rate (0, 1].
        group_size: if set, every ingress group must have exactly this many responses.
        diagnose_ungated: also re-score groups chosen by ``recency`` (which needs no scoring)
            so that their Drift and replay KL are reported; costs one forward over them.
        counterfactual: also score the subset recency replay would take from the same pre-step
            buffer (same size) and record its Drift / Headroom next to the selection's (the paper's
            same-buffer counterfactual); costs a forward over the recency groups not scanned anyway.
        adaptive_tau: if set, an :class:`~hdreplay.adaptive.AdaptiveTau` that moves tau within its
            bounds (loosen when replay is starved, tighten when replay KL rises); ``tau`` is the start.
    """

    selector: str = "headroom_drift"
    k_rep: int = 64
    tau: float = 1e-3
    capacity: int = 512
    drift_norm: str = "l2"
    headroom_weighting: str = "sign"
    ingress: Union[str, Callable] = "mixed"
    answer_threshold: float | None = None
    truncate_multiple: int = 1
    scan_chunk: int | None = None
    max_scan_chunk: int = 1024
    acceptance_ema: float = 0.5
    group_size: int | None = None
    diagnose_ungated: bool = False
    counterfactual: bool = False
    adaptive_tau: "AdaptiveTau | None" = None

    def __post_init__(self) -> None:
        if self.selector not in SELECTORS:
            raise ReplayConfigError(f"unknown selector {self.selector!r}; valid: {sorted(SELECTORS)}")
        if not _is_int(self.k_rep) or self.k_rep < 0:
            raise ReplayConfigError(f"k_rep (replay budget in groups) must be an int >= 0, got {self.k_rep!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or math.isnan(self.tau) or self.tau < 0:
            raise ReplayConfigError(f"tau (Drift threshold) must be a number >= 0, got {self.tau!r}")
        if not _is_int(self.capacity) or self.capacity < 1:
            raise ReplayConfigError(f"capacity (buffer size in groups) must be an int >= 1, got {self.capacity!r}")
        if self.drift_norm not in DRIFT_NORMS:
            raise ReplayConfigError(f"unknown drift_norm {self.drift_norm!r}; valid: {list(DRIFT_NORMS)}")
        if self.headroom_weighting not in HEADROOM_WEIGHTINGS:
            raise ReplayConfigError(
                f"unknown headroom_weighting {self.headroom_weighting!r}; valid: {list(HEADROOM_WEIGHTINGS)}"
            )
        if not callable(self.ingress) and self.ingress not in INGRESS_RULES:
            raise ReplayConfigError(f"unknown ingress rule {self.ingress!r}; valid: {list(INGRESS_RULES)} or a callable")
        make_ingress_rule(self.ingress, answer_threshold=self.answer_threshold)  # validates the threshold
        if not _is_int(self.truncate_multiple) or self.truncate_multiple < 1:
            raise ReplayConfigError(f"truncate_multiple (u) must be an int >= 1, got {self.truncate_multiple!r}")
        if self.scan_chunk is not None and (not _is_int(self.scan_chunk) or self.scan_chunk < 1):
            raise ReplayConfigError(f"scan_chunk must be None (auto) or an int >= 1, got {self.scan_chunk!r}")
        if not _is_int(self.max_scan_chunk) or self.max_scan_chunk < 1:
            raise ReplayConfigError(f"max_scan_chunk must be an int >= 1, got {self.max_scan_chunk!r}")
        a = self.acceptance_ema
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0 < a <= 1):
            raise ReplayConfigError(f"acceptance_ema must be in (0, 1], got {a!r}")
        if self.group_size is not None and (not _is_int(self.group_size) or self.group_size < 1):
            raise ReplayConfigError(f"group_size must be None or an int >= 1, got {self.group_size!r}")
        if self.adaptive_tau is not None:
            if not isinstance(self.adaptive_tau, AdaptiveTau):
                raise ReplayConfigError(f"adaptive_tau must be None or an AdaptiveTau, got {self.adaptive_tau!r}")
            lo, hi = self.adaptive_tau.tau_min, self.adaptive_tau.tau_max
            if not (lo <= self.tau <= hi):
                raise ReplayConfigError(f"tau={self.tau:g} must lie within adaptive_tau's bounds [{lo:g}, {hi:g}]")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (a callable ingress rule is shown by its name)."""
        d = asdict(self)
        if self.adaptive_tau is not None:
            d["adaptive_tau"] = asdict(self.adaptive_tau)
        if callable(self.ingress):
            d["ingress"] = getattr(self.ingress, "__name__", type(self.ingress).__name__)
        return d

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
