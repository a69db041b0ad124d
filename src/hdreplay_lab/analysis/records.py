"""What a record of each run file must look like: one ``check_*`` per kind, each returning why a parsed record is
unusable (naming the field and what it must be) or None.  Pure; :mod:`.load` applies them.

    steps.jsonl          :func:`check_step_record`   (hdreplay.records.StepRecord's fields and types)
    groups.jsonl         :func:`check_group_record`  (ReplayBuffer.lifetime_record)
    fresh_groups.jsonl   :func:`check_fresh_record`  (hdreplay_lab.sandbox.rewardlog)
    train_log.jsonl,     :func:`check_log_record`    ("step" and numbers: HDRLogCallback's entries, TRL's
    trainer_state.json                                log_history, TensorBoard scalars)
    async.jsonl          :func:`check_ledger_record` (hdreplay.ledger.StalenessLedger.close_step)
    run.json             :func:`check_run_meta`      (the fields the report reads)
    metrics.json         :func:`check_metrics`       (the lab's fields; what the report leaves out of its table)

The files hdreplay writes with ``allow_nan=False`` (steps, groups, async) never hold a NaN / Infinity literal (Python's
``json`` reads them, strict JSON has none): a record holding one was not written by hdreplay and is refused.
"""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any

from hdreplay.records import EXTRA_STEP_TYPES, StepRecord

STEP_LISTS = ("accepted_ages", "scan_age", "scan_drift", "scan_pass", "scan_cached_headroom", "scan_headroom")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a StepRecord field's type (a float field may be null: non-finite values are written
    as null; an int is a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return value is None or _is_num(value)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    return True


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "").replace("NoneType", "null")


#: the type of every steps.jsonl field (StepRecord's annotations and what diagnostics add); fields not listed (newer
#: writers) are not checked
STEP_TYPES = {**{k: v for k, v in typing.get_type_hints(StepRecord).items() if k != "extras"}, **EXTRA_STEP_TYPES}


def _non_finite(rec: dict) -> str | None:
    """Why a record holds a NaN / Infinity literal, naming the field; None if it holds none."""
    def bad(v: Any) -> float | None:
        if isinstance(v, float):
            return None if math.isfinite(v) else v
        inner = v if isinstance(v, list) else list(v.values()) if isinstance(v, dict) else ()
        return next((b for b in map(bad, inner) if b is not None), None)

    k = next((k for k, v in rec.items() if bad(v) is not None), None)
    if k is None:
        return None
    lit = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[str(bad(rec[k]))]
    return (f"{k!r} {'is' if isinstance(rec[k], float) else 'holds'} {lit}, which is not JSON (hdreplay writes a "
            "non-finite number as null): write null")


def _step(rec: dict) -> str | None:
    return (None if _is_int(rec.get("step")) and rec["step"] >= 0
            else f"'step' must be an int >= 0, got {rec.get('step')!r:.40}")


def check_step_record(rec: dict) -> str | None:
    """Why a parsed steps.jsonl object is unusable, or None if it is fine: 'step' an int >= 0, every StepRecord field
    present of its declared type, scan lists of one length, at least one StepRecord field besides 'step', no
    NaN / Infinity literal."""
    why = _step(rec) or _non_finite(rec)
    if why:
        return why
    other = [k for k in rec if k != "step"]
    if not any(k in STEP_TYPES for k in other):
        extra = f" and fields no StepRecord has ({', '.join(map(repr, other[:3]))})" if other else ""
        return (f"holds only 'step'{extra}, no replay field such as 'selector', 'k_rep' or 'accepted': not a replay "
                "step record (hdreplay.records.StepRecord)")
    wrong = next((k for k, v in rec.items() if k not in STEP_LISTS and k in STEP_TYPES
                  and not _fits(v, STEP_TYPES[k])), None)
    if wrong is not None:
        return f"{wrong!r} must be {_type_name(STEP_TYPES[wrong])}, got {rec[wrong]!r:.40}"
    bad = next((k for k in STEP_LISTS if k in rec and not isinstance(rec[k], list)), None)
    if bad is None:
        bad = next((k for k in STEP_LISTS if k in rec and not _fits(rec[k], STEP_TYPES[k])), None)
        if bad is not None:
            return f"{bad!r} must be {_type_name(STEP_TYPES[bad])}, got {rec[bad]!r:.40}"
    lens = {k: len(rec[k]) for k in STEP_LISTS[1:] if k in rec and not bad}
    return (f"{bad!r} must be a list, got {type(rec[bad]).__name__}" if bad
            else f"scan lists have different lengths {lens}" if len(set(lens.values())) > 1 else None)


def check_fresh_record(rec: dict) -> str | None:
    """Why a parsed fresh_groups.jsonl object is unusable, or None if it is fine."""
    r = rec.get("rewards")
    if _step(rec):
        return _step(rec)
    if not isinstance(r, list) or not all(isinstance(g, list) and g for g in r):
        return "'rewards' must be a list of non-empty lists (one per group)"
    bad = next((v for g in r for v in g if v is not None and not _is_num(v)), None)
    return f"'rewards' must hold numbers or null, got {bad!r}" if bad is not None else None


#: groups.jsonl fields (ReplayBuffer.lifetime_record): (name, required, test, what it must be)
GROUP_RULES = (("birth_step", True, _is_int, "an int"), ("replay_count", True, _is_int, "an int"),
               ("ref_headroom", True, _is_num, "a number"),
               ("evicted_step", False, lambda v: v is None or _is_int(v), "an int or null"),
               ("insertion_id", False, _is_int, "an int"),
               ("group_id", False, lambda v: isinstance(v, str), "a string"),
               ("cached_headroom", False, lambda v: v is None or _is_num(v), "a number or null"),
               ("exposure", False, lambda v: v is None or _is_num(v), "a number or null"))


def check_group_record(rec: dict) -> str | None:
    """Why a parsed groups.jsonl object is unusable (a field of :data:`GROUP_RULES` missing or of the wrong type, a
    NaN / Infinity literal), or None if it is fine."""
    bad = next(((k, what) for k, required, ok, what in GROUP_RULES if (required or k in rec) and not ok(rec.get(k))),
               None)
    return _non_finite(rec) or (f"{bad[0]!r} must be {bad[1]}, got {rec.get(bad[0])!r:.40}" if bad else None)


def check_log_record(rec: dict) -> str | None:
    """Why a trainer log entry (a train_log.jsonl line, an entry of trainer_state.json's log_history) is unusable:
    'step' an int >= 0 and every other value a number or null (what HDRLogCallback and TRL write)."""
    bad = next((k for k, v in rec.items() if k != "step" and v is not None and not _is_num(v)), None)
    return _step(rec) or (f"{bad!r} must be a number or null, got {rec[bad]!r:.40}" if bad is not None else None)


def _hist(h: Any) -> bool:  # {"age or length": count}
    return isinstance(h, dict) and all(k.lstrip("-").isdigit() and _is_int(v) for k, v in h.items())


def check_ledger_record(rec: dict) -> str | None:
    """Why a parsed async.jsonl object is unusable: 'step' an int >= 0, 'totals' an object of numbers, 'ages' /
    'lengths' objects of histograms ({"value": count}), 'drift_*' lists of numbers or null, 'floor' a number or null,
    'floor_ready' a bool or null."""
    tot = rec.get("totals")
    rules = (("totals", isinstance(tot, dict) and all(_is_num(v) for v in tot.values()), "an object of numbers"),
             ("ages", "ages" not in rec or isinstance(rec["ages"], dict) and all(map(_hist, rec["ages"].values())),
              'an object of {"age": count} objects'),
             ("lengths", "lengths" not in rec or isinstance(rec["lengths"], dict)
              and all(map(_hist, rec["lengths"].values())), 'an object of {"length": count} objects'),
             *((k, k not in rec or isinstance(rec[k], list) and all(v is None or _is_num(v) for v in rec[k]),
                "a list of numbers or null") for k in ("drift_divert", "drift_admit")),
             ("floor", rec.get("floor") is None or _is_num(rec["floor"]), "a number or null"),
             ("floor_ready", rec.get("floor_ready") is None or isinstance(rec["floor_ready"], bool), "a bool or null"))
    bad = next(((k, what) for k, ok, what in rules if not ok), None)
    return _step(rec) or _non_finite(rec) or (f"{bad[0]!r} must be {bad[1]}, got {rec.get(bad[0])!r:.40}" if bad
                                              else None)


#: run.json fields the report reads, with their JSON types (checked when present)
META_TYPES = {"method": (str, "a string"), "task": (str, "a string"), "label": (str, "a string"),
              "seed": (int, "an int"), "replay": (dict, "an object")}
REPLAY_TYPES = {"selector": (str, "a string"), "k_rep": (int, "an int"), "tau": (float, "a number"),
                "capacity": (int, "an int"), "ingress": (str, "a string"), "answer_threshold": (float, "a number"),
                "counterfactual": (bool, "a bool")}


def _of(v: Any, typ: type) -> bool:
    return v is None or (_is_int(v) if typ is int else _is_num(v) if typ is float else isinstance(v, typ))


def check_run_meta(meta: dict) -> list[str]:
    """Why run.json's fields the report reads are unusable: one reason per field of the wrong type."""
    out = [f"{k!r} must be {what} or null, got {meta[k]!r:.40}" for k, (t, what) in META_TYPES.items()
           if k in meta and not _of(meta[k], t)]
    rc = meta.get("replay")
    return out + [f"'replay.{k}' must be {what} or null, got {rc[k]!r:.40}" for k, (t, what) in REPLAY_TYPES.items()
                  if isinstance(rc, dict) and k in rc and not _of(rc[k], t)]


#: metrics.json fields of the lab's own runs (a "format" that starts with "hdreplay."), with their JSON types
METRICS_TYPES = {"format": (str, "a string"), "method": (str, "a string"), "seed": (int, "an int"),
                 "steps": (int, "an int"), "n": (int, "an int"), "benchmarks": (dict, "an object"),
                 **{f"{a}_{b}_at_n": (float, "a number") for a in ("macro", "weighted") for b in ("mean", "best")}}
JSON_TYPES = {str: "a string", list: "a list", dict: "an object", bool: "a bool", float: "not finite"}


def check_metrics(metrics: dict) -> tuple[list[str], list[str]]:
    """``(problems, left_out)`` of a metrics.json object.  problems: a field of the lab's own file
    (:data:`METRICS_TYPES`) of the wrong type.  left_out: in a file the lab did not write, each top-level value the
    final-metrics table leaves out (not a finite number, not null), as ``"'key' (a string)"``."""
    own = isinstance(metrics.get("format"), str) and metrics["format"].startswith("hdreplay.")
    problems = [f"{k!r} must be {what} or null, got {metrics[k]!r:.40}" for k, (t, what) in METRICS_TYPES.items()
                if own and k in metrics and not _of(metrics[k], t)]
    left = [f"{k!r} ({JSON_TYPES.get(type(v), type(v).__name__)})" for k, v in metrics.items()
            if not own and v is not None and not (_is_num(v) and math.isfinite(v))]
    return problems, left


def parse_json(text: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why)`` for text that is not JSON or is nested too deeply to parse."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg})"
    except RecursionError:
        return None, "nested too deeply (no file hdreplay or TRL writes is)"
