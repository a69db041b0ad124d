"""What the method decided, step by step and group by group: records, flat ``replay/*`` metrics, a JSONL writer.

Files written under a diagnostics directory:
    steps.jsonl    one :class:`StepRecord` per committed step
    groups.jsonl   one lifetime record per group when it leaves the buffer (FIFO eviction),
                   plus, at :meth:`DiagnosticsWriter.close`, one per group still buffered
                   (``"evicted_step": null``)
    <log>.rewound-from-step-<k>.<UTC time>.jsonl
                   what a resume's rewind set aside (:meth:`DiagnosticsWriter.rewind`): the records of steps k and
                   later of a run that resumed from an earlier checkpoint; never deleted, the resumed run writes
                   those steps again into the log itself

Non-finite floats are written as JSON ``null``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .checkpoint.atomic import atomic_write_text
from .errors import ReplayInputError
from .selectors import Selection
from .validate import check_step, is_int, is_real

STEPS_FILE = "steps.jsonl"
GROUPS_FILE = "groups.jsonl"


def _f(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _mean(a: np.ndarray) -> float:
    return float(np.mean(a)) if len(a) else float("nan")


@dataclass
class StepRecord:
    """One committed replay step: the schema of ``steps.jsonl`` (one JSON object per line) and of the
    ``replay/*`` metrics.  Every writer (the controller) and reader (``hdreplay_lab.analysis``) uses it.

    Counts are groups.  ``scan_*`` lists are per scanned group in scan order (length = ``scanned``).
    ``None`` = not defined this step (e.g. nothing scanned); non-finite floats are written as ``null``.
    """

    step: int
    selector: str
    k_rep: int
    tau: float | None
    #: groups in the buffer when selection ran (before this step's ingress) / after commit
    buffer_size: int = 0
    buffer_size_after: int = 0
    #: fresh groups offered to the ingress rule / admitted by it (entered the buffer at commit)
    ingress_candidates: int = 0
    ingress_admitted: int = 0
    evicted: int = 0
    #: fresh groups in the actor batch, and fresh + replayed (|A_t|)
    num_fresh_groups: int = 0
    actor_groups: int = 0
    #: groups re-scored and counted (scan depth); passed the gate; replayed after truncation; cut by it
    scanned: int = 0
    accepted_gate: int = 0
    accepted: int = 0
    truncated: int = 0
    #: gate pass rate among scanned groups (None when nothing was scanned)
    accept_rate: float | None = None
    #: accepted / k_rep
    budget_fill: float | None = None
    drift_accepted: float | None = None
    drift_rejected: float | None = None
    #: token-weighted mean k3 KL(pi_gen || pi_theta) over replayed tokens (None when not scored)
    replay_kl: float | None = None
    mean_age: float | None = None
    accepted_ages: list[int] = field(default_factory=list)
    scorer_calls: int = 0
    scored_unused: int = 0
    #: the scan stopped at the scan budget (max_scan) before the replay budget was filled
    scan_capped: bool = False
    scan_age: list[int] = field(default_factory=list)
    scan_drift: list[float | None] = field(default_factory=list)
    scan_pass: list[bool] = field(default_factory=list)
    scan_cached_headroom: list[float | None] = field(default_factory=list)
    scan_headroom: list[float | None] = field(default_factory=list)
    #: cost of the step, comparable across replay strategies (rows = responses): rows and completion tokens of
    #: stored data forwarded under the current policy to select (re-scoring, entropy picks), rows replayed, and --
    #: when the integration reports it -- fresh responses generated (discarded and re-evaluation ones included)
    rescored_rows: int = 0
    rescored_tokens: int = 0
    replayed_rows: int = 0
    generated_rows: int | None = None
    #: what the gate's forward cost beside the fresh batch's (issue 37): prompt + completion tokens a full-row forward
    #: runs -- re-scored by the gate, and of the step's fresh groups -- and wall-clock seconds inside the gate's scorer
    #: and (when the integration measures it) the fresh batch's old-log-prob forward; seconds are None when unmeasured
    rescore_forward_tokens: int = 0
    fresh_forward_tokens: int = 0
    rescore_seconds: float | None = None
    fresh_forward_seconds: float | None = None
    #: where the re-scoring went (issue 27): completion tokens replayed; forwarded for groups the gate rejected, and
    #: for groups touched beyond the stopping index; groups rejected before being forwarded whole (their scan_drift
    #: is a lower bound: scan_exact False); rejected groups whose previous scan had rejected them too; groups the
    #: scan left out after a wide rejection (skip_rejected)
    replayed_tokens: int = 0
    rescored_tokens_rejected: int = 0
    rescored_tokens_unused: int = 0
    early_rejected: int = 0
    rejected_again: int = 0
    skipped: int = 0
    scan_exact: list[bool] = field(default_factory=list)
    #: per scanned group, the consecutive scans that had rejected it before this step's
    scan_streak: list[int] = field(default_factory=list)
    #: what diagnostics, experiments and peers add beyond the method (:mod:`hdreplay.diagnostics`: the same-buffer
    #: counterfactual ``cf_*``, adaptive tau ``tau_next`` / ``tau_action``; a peer's ``strategy`` and its
    #: ``strategy_counters``), written flat beside the method's fields
    extras: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict written to ``steps.jsonl`` (``generated_rows`` left out when unknown; extras flat)."""
        d = asdict(self)
        extras = d.pop("extras")
        if d["generated_rows"] is None:
            del d["generated_rows"]
        return {**d, **{k: v for k, v in extras.items() if k not in d}}


#: the method's fields of a step record
STEP_FIELDS = tuple(f.name for f in fields(StepRecord) if f.name != "extras")
#: fields diagnostics and peers may add (hdreplay.diagnostics, the baselines), with the types steps.jsonl holds
EXTRA_STEP_TYPES: dict[str, Any] = {
    "cf_size": int, "cf_drift_selected": float | None, "cf_drift_recency": float | None,
    "cf_headroom_selected": float | None, "cf_headroom_recency": float | None, "tau_next": float | None,
    "tau_action": str | None, "strategy": str | None, "strategy_counters": dict[str, float] | None}
EXTRA_STEP_FIELDS = tuple(EXTRA_STEP_TYPES)


def step_record(
    sel: Selection,
    *,
    k_rep: int,
    tau: float,
    ingress_candidates: int,
    ingress_admitted: int,
    evicted: int,
    num_fresh_groups: int,
    accepted_ages: np.ndarray,
    buffer_size_after: int,
    replayed_rows: int = 0,
    replayed_tokens: int = 0,
    unit_size: int = 1,
) -> StepRecord:
    """The per-step record of a committed selection (``unit_size``: stored units per replay group of the budget --
    the group size for single-rollout replay, whose budget is k_rep groups' worth of rows -- else 1)."""
    gate_ok = sel.scanned_pass
    n_scan = len(sel.scanned)
    n_pass = int(gate_ok.sum())
    kept = len(sel.accepted)
    # replay KL over the replayed groups' tokens (token-weighted), when they were scored
    kl = float("nan")
    if sel.scored and kept:
        pos = {int(g): j for j, g in enumerate(sel.scanned.tolist())}
        idx = np.asarray([pos[int(g)] for g in sel.accepted.tolist()])
        tok = sel.scanned_tokens[idx]
        kl = float((sel.scanned_kl[idx] * tok).sum() / max(tok.sum(), 1))
    return StepRecord(
        step=sel.step,
        selector=sel.selector,
        k_rep=k_rep,
        tau=_f(tau),
        buffer_size=sel.buffer_size,
        buffer_size_after=buffer_size_after,
        ingress_candidates=ingress_candidates,
        ingress_admitted=ingress_admitted,
        evicted=evicted,
        num_fresh_groups=num_fresh_groups,
        actor_groups=num_fresh_groups + kept,
        scanned=n_scan,
        accepted_gate=n_pass if sel.scored else kept + len(sel.truncated),
        accepted=kept,
        truncated=len(sel.truncated),
        accept_rate=_f(n_pass / n_scan) if n_scan else None,
        budget_fill=_f(kept / (k_rep * unit_size)) if k_rep else None,
        drift_accepted=_f(_mean(sel.scanned_drift[gate_ok])) if n_scan else None,
        drift_rejected=_f(_mean(sel.scanned_drift[~gate_ok])) if n_scan else None,
        replay_kl=_f(kl),
        mean_age=_f(_mean(accepted_ages)),
        accepted_ages=[int(a) for a in accepted_ages],
        scorer_calls=sel.scorer_calls,
        scored_unused=sel.scored_unused,
        scan_capped=bool(sel.scan_capped),
        scan_age=[int(a) for a in sel.scanned_age],
        scan_drift=[_f(x) for x in sel.scanned_drift],
        scan_pass=[bool(x) for x in gate_ok],
        scan_cached_headroom=[_f(x) for x in sel.scanned_cached],
        scan_headroom=[_f(x) for x in sel.scanned_headroom],
        rescored_rows=sel.rescored_rows,
        rescored_tokens=sel.rescored_tokens,
        replayed_rows=replayed_rows,
        rescore_forward_tokens=sel.cost.forward_tokens if sel.cost else 0,
        rescore_seconds=sel.cost.seconds if sel.cost else None,
        **_waste_fields(sel, gate_ok, replayed_tokens),
    )


def _waste_fields(sel: Selection, gate_ok: np.ndarray, replayed_tokens: int) -> dict[str, Any]:
    exact, cost, streak = sel.scanned_exact, sel.scanned_rescored_tokens, sel.scanned_streak
    rejected = ~gate_ok if sel.scored else np.zeros(len(exact), bool)
    return {
        "replayed_tokens": int(replayed_tokens),
        "rescored_tokens_rejected": int(cost[rejected].sum()),
        "rescored_tokens_unused": int(sel.unused_tokens),
        "early_rejected": int((~exact).sum()),
        "rejected_again": int((rejected & (streak > 0)).sum()),
        "skipped": int(sel.skipped),
        "scan_exact": [bool(x) for x in exact],
        "scan_streak": [int(x) for x in streak],
    }


#: keys of a step record exported as flat ``replay/<key>`` metrics.
METRIC_KEYS = (
    "buffer_size", "ingress_admitted", "scanned", "accepted", "accept_rate", "budget_fill",
    "drift_accepted", "drift_rejected", "replay_kl", "mean_age", "evicted", "scorer_calls", "tau", "scan_capped",
    "rescored_rows", "rescored_tokens", "replayed_rows", "replayed_tokens", "rescored_tokens_rejected",
    "early_rejected", "rejected_again", "skipped", "rescore_forward_tokens", "fresh_forward_tokens",
)
#: step-record fields that are wall-clock measurements (the rest of a record is a function of the run's inputs)
TIMING_FIELDS = ("rescore_seconds", "fresh_forward_seconds")


def metrics_from_record(rec: "StepRecord | Mapping[str, Any]", prefix: str = "replay/") -> dict[str, float]:
    """Flat namespaced metrics; missing values (e.g. no scan this step) become NaN."""
    if not isinstance(rec, (StepRecord, Mapping)) or not isinstance(prefix, str):
        raise ReplayInputError(f"metrics_from_record needs a StepRecord or a mapping and a str prefix, got "
                               f"{type(rec).__name__}, {type(prefix).__name__}")
    get = rec.get if isinstance(rec, Mapping) else (lambda k: getattr(rec, k, None))
    out = {}
    for k in METRIC_KEYS:
        v = get(k)
        if v is not None and not isinstance(v, (int, float, np.integer, np.floating)):
            raise ReplayInputError(f"record[{k!r}]: must be a number or None, got {v!r}")
        out[f"{prefix}{k}"] = float("nan") if v is None else float(v)
    for k in ("generated_rows",):
        if get(k) is not None:
            out[f"{prefix}{k}"] = float(get(k))
    extras = get("extras") if not isinstance(rec, Mapping) else rec
    for k, v in ((extras or {}).get("strategy_counters") or {}).items():
        out[f"{prefix}{k}"] = float(v)
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


class DiagnosticsWriter:
    """Appends step and group-lifetime records as JSON lines under ``directory``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ReplayInputError(f"directory: must be a path, got {type(directory).__name__}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ReplayInputError(f"directory: {self.directory} is a file, not a directory; give the directory the "
                                   "step and group logs go to")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ReplayInputError(f"directory: cannot create {self.directory} ({e.strerror or e}); give a writable "
                                   "directory") from None
        self.steps_path = self.directory / STEPS_FILE
        self.groups_path = self.directory / GROUPS_FILE

    def _append(self, path: Path, records: Iterable[Mapping[str, Any]]) -> None:
        records = list(records)
        if not all(isinstance(r, Mapping) for r in records):
            raise ReplayInputError("records: must be mappings (JSON objects)")
        try:
            lines = "".join(_dumps(r) + "\n" for r in records)
        except (TypeError, ValueError) as e:
            raise ReplayInputError(f"records: not JSON-serialisable ({e})") from None
        if lines:
            with open(path, "a") as f:
                f.write(lines)

    def write_step(self, record: "StepRecord | Mapping[str, Any]") -> None:
        self._append(self.steps_path, [record.to_json() if isinstance(record, StepRecord) else record])

    def write_groups(self, records: Iterable[Mapping[str, Any]]) -> None:
        self._append(self.groups_path, records)

    def rewind(self, step: int | None, stamp: str | None = None) -> list[Path]:
        """Set aside the records written after ``step`` (a run resumes from a checkpoint whose last committed step is
        ``step``; None: nothing was committed, every record is set aside): step records with ``step > step`` and group
        records evicted after it or written at close move to side files (:func:`rewind_jsonl`, named with ``stamp``);
        returns those."""
        step = None if step is None else check_step("step", step)
        after, stamp = step + 1 if step is not None else 0, stamp or rewind_stamp()
        moved = [rewind_jsonl(self.steps_path, lambda r: step is not None and r.get("step", -1) <= step, after, stamp),
                 rewind_jsonl(self.groups_path, lambda r: step is not None and r.get("evicted_step") is not None
                              and r["evicted_step"] <= step, after, stamp)]
        return [p for p in moved if p is not None]


#: a side file a rewind writes: ``<stem>.rewound-from-step-<k>.<UTC time>.jsonl`` beside ``<stem>.jsonl``
REWOUND = "rewound-from-step"


def rewound_files(path: str | os.PathLike) -> list[Path]:
    """The side files rewinds of the log ``path`` wrote (oldest first)."""
    path = Path(path)
    return sorted(path.parent.glob(f"{path.stem}.{REWOUND}-*{path.suffix}"))


def rewind_stamp() -> str:
    """The time a rewind's side files are named with (UTC, to the microsecond)."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def rewind_jsonl(path: Path, keep, first_step: int, stamp: str | None = None) -> Path | None:
    """Move the lines of the JSONL log ``path`` that ``keep(record)`` rejects (and any line that does not parse: a
    torn last line of a crash) to a new side file beside it, named with ``first_step`` (the first step moved) and the
    time (``stamp``, default now); returns it (None when nothing moves).  Never deletes a record: the side file is
    complete on disk before ``path`` is rewritten (a crash in between leaves the records in both)."""
    if not path.exists():
        return None
    kept, moved = [], []
    with open(path) as f:
        for line in f:
            line = line if line.endswith("\n") else line + "\n"
            try:
                ok = keep(json.loads(line))
            except (json.JSONDecodeError, AttributeError, TypeError):
                ok = False
            (kept if ok else moved).append(line)
    if not moved:
        return None
    stamp = stamp or rewind_stamp()
    side, k = path.with_name(f"{path.stem}.{REWOUND}-{first_step}.{stamp}{path.suffix}"), 1
    while side.exists():  # (two rewinds within a microsecond)
        k += 1
        side = path.with_name(f"{path.stem}.{REWOUND}-{first_step}.{stamp}-{k}{path.suffix}")
    atomic_write_text(side, "".join(moved))
    atomic_write_text(path, "".join(kept))
    return side


#: what ``commit(counters=...)`` accepts
COUNTER_KEYS = ("generated_rows", "rescored_rows", "rescored_tokens", "fresh_forward_seconds", "strategy",
                "strategy_counters")


def check_counters(counters: Mapping[str, Any] | None) -> dict[str, Any]:
    if counters is None:
        return {"fresh_forward_seconds": None}
    if not isinstance(counters, Mapping) or set(counters) - set(COUNTER_KEYS):
        raise ReplayInputError(f"commit: counters must be a mapping with keys from {list(COUNTER_KEYS)}, got "
                               f"{counters!r:.100}")
    out = {"fresh_forward_seconds": None, **counters}
    for k in ("generated_rows", "rescored_rows", "rescored_tokens"):
        if k in out and not (is_int(out[k]) and out[k] >= 0):
            raise ReplayInputError(f"commit: counters[{k!r}] must be an int >= 0, got {out[k]!r}")
        if k in out:
            out[k] = int(out[k])
    fs = out.get("fresh_forward_seconds")
    if fs is not None and not (is_real(fs) and math.isfinite(fs) and fs >= 0):
        raise ReplayInputError(f"commit: counters['fresh_forward_seconds'] must be a finite number >= 0 (seconds of "
                               f"the fresh batch's old-log-prob forward), got {fs!r}")
    if "strategy" in out and not isinstance(out["strategy"], str):
        raise ReplayInputError(f"commit: counters['strategy'] must be a name, got {out['strategy']!r}")
    sc = out.get("strategy_counters")
    if sc is not None:
        if not isinstance(sc, Mapping) or not all(isinstance(k, str) and is_real(v) for k, v in sc.items()):
            raise ReplayInputError(f"commit: counters['strategy_counters'] must map names to numbers, got {sc!r:.100}")
        out["strategy_counters"] = {k: float(v) for k, v in sc.items()}
    return out
