"""The staleness ledger: where every generated group of an asynchronous run went (see :mod:`hdreplay.staleness`).

Per update, groups and tokens (completion tokens, loss-mask or not) that were

    generated        arrived at the trainer this update (routed)
    fresh            trained as fresh (within the framework's bound); ``fresh_mixed``: of those, mixed outcome
    diverted         beyond the bound, mixed: entered the buffer instead of being dropped
    dropped          beyond the bound and zero-variance (or too old to divert): dropped, as the framework would
    admitted         diverted groups replayed for the first time ("admitted later")
    replayed         every replayed group this update (admitted ones, repeats, fresh groups ingested earlier)
    evicted_unused   diverted groups that left the buffer (FIFO capacity) without ever being replayed

plus the Drift of diverted groups at their first scan and at admission (after the floor is subtracted), the
floor, age histograms (policy versions behind: generated, fresh, diverted, dropped, admitted) and histograms of
the mean completion length of trained (fresh + replayed) and discarded (dropped + evicted unused) groups -- the
length bias age-based dropping causes.  ``async.jsonl`` holds one record per update (:meth:`close_step`);
:meth:`metrics` flattens it into ``async/*`` metrics for the trainer's logger, ``hdreplay report`` summarises it.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping

import numpy as np

LEDGER_FILE = "async.jsonl"
KINDS = ("generated", "fresh", "fresh_mixed", "diverted", "dropped", "admitted", "replayed", "evicted_unused")
AGE_KINDS = ("generated", "fresh", "diverted", "dropped", "admitted")


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _mean(xs) -> float | None:
    return _num(np.mean(xs)) if len(xs) else None


class StalenessLedger:
    """Counts of one update (reset by :meth:`close_step`) and cumulative ``totals`` (groups and tokens)."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {f"{k}_{u}": 0 for k in KINDS for u in ("groups", "tokens")}
        self._reset()

    def _reset(self) -> None:
        self.counts = Counter()
        self.ages = {k: Counter() for k in AGE_KINDS}
        self.lengths = {"trained": Counter(), "discarded": Counter()}
        self.drift_divert: list[float] = []
        self.drift_admit: list[float] = []

    def _count(self, kind: str, tokens: int) -> None:
        for key, v in ((f"{kind}_groups", 1), (f"{kind}_tokens", int(tokens))):
            self.counts[key] += v
            self.totals[key] += v

    def on_route(self, r: str, group, *, age: int, mixed: bool) -> None:
        length = round(float(group.response_lengths.double().mean()))
        self._count("generated", group.num_tokens)
        self.ages["generated"][age] += 1
        kind = {"fresh": "fresh", "divert": "diverted", "drop": "dropped"}[r]
        self._count(kind, group.num_tokens)
        self.ages[kind][age] += 1
        if r == "fresh":
            self.lengths["trained"][length] += 1
            if mixed:
                self._count("fresh_mixed", group.num_tokens)
        elif r == "drop":
            self.lengths["discarded"][length] += 1

    def on_first_scan(self, drift: float) -> None:
        self.drift_divert.append(float(drift))

    def on_admit(self, group, *, age: int, drift: float) -> None:
        self._count("admitted", group.num_tokens)
        self.ages["admitted"][age] += 1
        self.drift_admit.append(float(drift))

    def on_replay(self, group, *, age: int) -> None:
        self._count("replayed", group.num_tokens)
        self.lengths["trained"][round(float(group.response_lengths.double().mean()))] += 1

    def on_evict_unused(self, info: Mapping[str, Any], *, age: int) -> None:
        self._count("evicted_unused", info["tokens"])
        self.lengths["discarded"][round(float(info["length"]))] += 1

    def close_step(self, step: int, **extra) -> dict[str, Any]:
        """The update's record (JSON-able: NaN written as null) and a reset of the per-update counts."""
        hist = lambda c: {str(k): int(v) for k, v in sorted(c.items())}  # noqa: E731
        rec = {"step": int(step), **{f"{k}_{u}": int(self.counts[f"{k}_{u}"]) for k in KINDS
                                      for u in ("groups", "tokens")},
               "drift_divert": [_num(x) for x in self.drift_divert], "drift_admit": [_num(x) for x in self.drift_admit],
               "ages": {k: hist(v) for k, v in self.ages.items()},
               "lengths": {k: hist(v) for k, v in self.lengths.items()},
               "totals": dict(self.totals)}
        for k, v in extra.items():
            rec[k] = _num(v) if isinstance(v, float) else v
        self._reset()
        return rec

    @staticmethod
    def metrics(rec: Mapping[str, Any], prefix: str = "async/") -> dict[str, float]:
        """Flat ``async/*`` metrics of one :meth:`close_step` record (undefined values left out)."""
        out = {f"{prefix}{k}_{u}": float(rec[f"{k}_{u}"]) for k in KINDS for u in ("groups", "tokens")}
        tot = rec["totals"]
        if tot["generated_groups"]:
            out[f"{prefix}useful_group_share_cum"] = (tot["fresh_mixed_groups"] + tot["admitted_groups"]) / tot[
                "generated_groups"]
            out[f"{prefix}discarded_group_share_cum"] = (tot["dropped_groups"] + tot["evicted_unused_groups"]) / tot[
                "generated_groups"]
        if tot["generated_tokens"]:
            out[f"{prefix}useful_token_share_cum"] = (tot["fresh_mixed_tokens"] + tot["admitted_tokens"]) / tot[
                "generated_tokens"]
        for name in ("floor", "floor_step"):
            if rec.get(name) is not None:
                out[f"{prefix}{name}"] = float(rec[name])
        if "floor_ready" in rec:
            out[f"{prefix}floor_ready"] = float(bool(rec["floor_ready"]))
        if "buffered_diverted" in rec:
            out[f"{prefix}buffered_diverted"] = float(rec["buffered_diverted"])
        for name in ("drift_divert", "drift_admit"):
            vals = [x for x in rec[name] if x is not None]
            if vals:
                out[f"{prefix}{name}_mean"] = float(np.mean(vals))
        for kind, hist in rec["ages"].items():
            if hist:
                ages = np.repeat([int(a) for a in hist], [int(c) for c in hist.values()])
                out[f"{prefix}age_{kind}_mean"] = float(ages.mean())
                out[f"{prefix}age_{kind}_max"] = float(ages.max())
        for kind, hist in rec["lengths"].items():
            if hist:
                lens = np.repeat([int(a) for a in hist], [int(c) for c in hist.values()])
                out[f"{prefix}len_{kind}_mean"] = float(lens.mean())
        return out
