"""Run directories -> DataFrames, with a bad-line policy.  A run directory holds any of::

    run.json                  {"method", "seed", "task", "replay": ReplayConfig dict | null, ...}
    train_log.jsonl           one trainer log entry per logging step ("step", "reward", "entropy", ...), as the
                              sandbox and hdreplay.integrations.trl.callback.HDRLogCallback write it; else, in a
                              plain TRL output directory, trainer_state.json's log_history (its own or the newest
                              checkpoint-*'s), else TensorBoard scalars ("train/reward" -> "reward")
    replay/steps.jsonl        per-step replay records (hdreplay.records.StepRecord); replay/groups.jsonl: per-group
                              lifetime records; a bare diagnostics directory (steps.jsonl inside) is a run too
    metrics.json              final evaluation
    fresh_groups.jsonl        per step, the rewards of every fresh group (hdreplay_lab.sandbox.rewardlog)
Nothing here computes statistics.
"""

from __future__ import annotations

import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from hdreplay.records import EXTRA_STEP_TYPES, STEP_FIELDS, StepRecord
from hdreplay.errors import ReplayError

ON_BAD_LINE = ("skip", "stop")
STEP_LISTS = ("accepted_ages", "scan_age", "scan_drift", "scan_pass", "scan_cached_headroom", "scan_headroom")
GROUP_FIELDS = ("group_id", "insertion_id", "birth_step", "evicted_step", "ref_headroom", "replay_count", "exposure")
FILES = ("run.json", "train_log.jsonl", "replay/steps.jsonl", "steps.jsonl", "trainer_state.json", "metrics.json",
         "replay/groups.jsonl", "groups.jsonl", "fresh_groups.jsonl")


class AnalysisInputError(ReplayError, ValueError):
    """A run directory or log file cannot be analysed (missing, empty, malformed); the message says what."""


class BadLineWarning(UserWarning):
    """A JSONL line was skipped (``on_bad_line="skip"``); the message names file:line."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
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


def check_step_record(rec: dict) -> str | None:
    """Why a parsed steps.jsonl object is unusable, or None if it is fine: 'step' an int >= 0, every StepRecord field
    present of its declared type, scan lists of one length."""
    if not _is_int(rec.get("step")) or rec["step"] < 0:
        return f"'step' must be an int >= 0, got {rec.get('step')!r}"
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
    if not _is_int(rec.get("step")) or rec["step"] < 0:
        return f"'step' must be an int >= 0, got {rec.get('step')!r}"
    if not isinstance(r, list) or not all(isinstance(g, list) and g for g in r):
        return "'rewards' must be a list of non-empty lists (one per group)"
    bad = next((v for g in r for v in g if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))),
               None)
    return f"'rewards' must hold numbers or null, got {bad!r}" if bad is not None else None


def check_group_record(rec: dict) -> str | None:
    """Why a parsed groups.jsonl object is unusable, or None if it is fine."""
    bad = next((k for k in ("birth_step", "replay_count") if not _is_int(rec.get(k))), None)
    h, ev = rec.get("ref_headroom"), rec.get("evicted_step")
    return (f"{bad!r} must be an int, got {rec.get(bad)!r}" if bad
            else f"'ref_headroom' must be a number, got {h!r}" if isinstance(h, bool) or not isinstance(h, (int, float))
            else f"'evicted_step' must be an int or null, got {ev!r}" if ev is not None and not _is_int(ev) else None)


def read_jsonl(path: str | Path, *, on_bad_line: str = "skip", check: Callable[[dict], str | None] | None = None,
               problems: list[str] | None = None, malformed: list[str] | None = None) -> pd.DataFrame:
    """A JSONL file as a DataFrame, one row per good line.  A line that is not JSON, not an object, or that
    ``check`` rejects is dropped with ``"<file>:<line>: <reason>"`` appended to ``problems`` (``on_bad_line="skip"``)
    or raises :class:`AnalysisInputError` with that text (``"stop"``).  With ``malformed``, records that are JSON
    objects but that ``check`` rejects (fields of the wrong type) go there instead of ``problems``.  Blank lines are
    ignored."""
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    good = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = False
            try:
                obj = json.loads(line)
                record = isinstance(obj, dict)
                reason = (f"expected a JSON object, got {type(obj).__name__}" if not record
                          else check(obj) if check else None)
            except json.JSONDecodeError as e:
                reason = f"not valid JSON ({e.msg}; truncated line?)"
            if reason is None:
                good.append(line.strip())
            elif on_bad_line == "stop":
                raise AnalysisInputError(f"{path}:{n}: {reason} (use --on-bad-line skip to skip bad lines)")
            elif record and malformed is not None:
                malformed.append(f"{path}:{n}: {reason}")
            elif problems is not None:
                problems.append(f"{path}:{n}: {reason} -- line skipped")
    return pd.read_json(StringIO("\n".join(good)), lines=True, dtype=False) if good else pd.DataFrame()


def step_frame(records: pd.DataFrame | Iterable[StepRecord | dict] = ()) -> pd.DataFrame:
    """Step records (StepRecords, dicts or a frame) -> one row per step, sorted, with every StepRecord column
    (a repeated step keeps its last record; missing lists are [], other missing values NaN)."""
    if not isinstance(records, pd.DataFrame):
        records = pd.DataFrame([r.to_json() if isinstance(r, StepRecord) else r for r in records])
    df = records.reindex(columns=list(dict.fromkeys([*STEP_FIELDS, *EXTRA_STEP_TYPES, *records.columns])))
    for k in STEP_LISTS:
        df[k] = [v if isinstance(v, list) else [] for v in df[k]]
    return df.drop_duplicates("step", keep="last").sort_values("step", kind="stable").reset_index(drop=True)


def group_frame(records: pd.DataFrame | Iterable[dict] = ()) -> pd.DataFrame:
    """Group lifetime records with every column the sections read (missing ones NaN)."""
    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records))
    return df.reindex(columns=list(dict.fromkeys([*GROUP_FIELDS, *df.columns])))


@dataclass
class RunData:
    """One loaded run directory (raw rows, no statistics): ``steps`` / ``groups`` (:func:`step_frame` /
    :func:`group_frame`), ``log`` (trainer log entries) and ``log_source`` (the file they came from), ``meta``
    (run.json, {} if absent), ``metrics`` (metrics.json or None), ``replay_dir`` (where steps.jsonl was found) and
    ``problems`` (skipped lines and ignored files, each naming file:line), ``fresh`` (fresh_groups.jsonl rows)."""

    path: Path
    label: str
    meta: dict = field(default_factory=dict)
    steps: pd.DataFrame = field(default_factory=step_frame)
    groups: pd.DataFrame = field(default_factory=group_frame)
    log: pd.DataFrame = field(default_factory=pd.DataFrame)
    log_source: str | None = None
    metrics: dict | None = None
    replay_dir: Path | None = None
    problems: list[str] = field(default_factory=list)
    fresh: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def has_replay(self) -> bool:
        return len(self.steps) > 0

    @property
    def replay_config(self) -> dict:
        return self.meta["replay"] if isinstance(self.meta.get("replay"), dict) else {}


def _read_json(path: Path, on_bad_line: str, problems: list[str]) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        reason = None if isinstance(obj, dict) else f"expected a JSON object, got {type(obj).__name__}"
    except json.JSONDecodeError as e:
        obj, reason = None, f"not valid JSON ({e.msg})"
    if reason and on_bad_line == "stop":
        raise AnalysisInputError(f"{path}: {reason} (use --on-bad-line skip to ignore it)")
    problems += [f"{path}: {reason} -- file ignored"] if reason else []
    return {} if reason else obj


def tensorboard_log(p: Path) -> pd.DataFrame:
    """The scalars of every TensorBoard event file under ``p``, one row per step ("train/x" -> column "x")."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = []
    for f in sorted(p.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        rows += [(e.step, tag.removeprefix("train/"), e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    df = pd.DataFrame(rows, columns=["step", "key", "value"])
    return df.pivot_table(index="step", columns="key", values="value", aggfunc="last").reset_index()


def load_run(path: str | Path, *, label: str | None = None, on_bad_line: str = "skip", warn: bool = True) -> RunData:
    """Load one run directory (module docstring).  Raises AnalysisInputError if ``path`` is missing, not a
    directory, empty, holds no log, holds a directory where a log file belongs, holds records whose fields have the
    wrong type (one line per such record, whatever ``on_bad_line``), or (``on_bad_line="stop"``) on the first bad
    line.  With ``warn=True`` every skipped line is also a :class:`BadLineWarning`."""
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"--on-bad-line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    p = Path(path)
    if not p.is_dir():
        raise AnalysisInputError(f"{p}: not a directory; pass the run directory, not a file inside it" if p.exists()
                                 else f"{p}: no such directory; pass a run directory (one holding run.json, "
                                      "train_log.jsonl, trainer_state.json or replay/steps.jsonl)")
    if not any(p.iterdir()):
        raise AnalysisInputError(f"{p}: the directory is empty; did the run write its logs somewhere else?")
    found = {m: p / m for m in FILES if (p / m).exists()}
    for q in found.values():
        if not q.is_file():
            raise AnalysisInputError(f"{q}: expected a file, found a directory; the run directory is damaged "
                                     f"(move {q} away or restore it)")
    ckpts = {int(c.parent.name[11:]): c for c in p.glob("checkpoint-*/trainer_state.json") if c.parent.name[11:].isdigit()}
    state = found.get("trainer_state.json") or (ckpts[max(ckpts)] if ckpts else None)
    events = "train_log.jsonl" not in found and not state and next(p.rglob("events.out.tfevents.*"), None)
    if not (set(FILES[:4]) & set(found) or state or events):
        raise AnalysisInputError(f"{p}: not a run directory (no run.json, train_log.jsonl, trainer_state.json, "
                                 "TensorBoard events or replay/steps.jsonl in it)")
    run = RunData(path=p, label=label or p.resolve().name or str(p))
    malformed: list[str] = []
    run.meta = _read_json(found["run.json"], on_bad_line, run.problems) if "run.json" in found else {}
    run.metrics = _read_json(found["metrics.json"], on_bad_line, run.problems) if "metrics.json" in found else None
    if "train_log.jsonl" in found:
        run.log_source = str(found["train_log.jsonl"])
        run.log = read_jsonl(found["train_log.jsonl"], on_bad_line=on_bad_line, problems=run.problems)
    elif state:
        history = _read_json(state, on_bad_line, run.problems).get("log_history")
        run.log, run.log_source = pd.DataFrame(history if isinstance(history, list) else []), str(state)
    elif events:
        run.log, run.log_source = tensorboard_log(p), f"{p} (TensorBoard events)"
    if "fresh_groups.jsonl" in found:
        run.fresh = read_jsonl(found["fresh_groups.jsonl"], on_bad_line=on_bad_line, check=check_fresh_record,
                               problems=run.problems, malformed=malformed)
    steps = found.get("replay/steps.jsonl") or found.get("steps.jsonl")
    if steps:
        run.replay_dir = steps.parent
        raw = read_jsonl(steps, on_bad_line=on_bad_line, check=check_step_record, problems=run.problems,
                         malformed=malformed)
        run.steps = step_frame(raw)
        if len(raw) > len(run.steps):
            run.problems.append(f"{steps}: {len(raw) - len(run.steps)} repeated step record(s) (a resumed run?); "
                                "the last record of each step is used")
        if (run.replay_dir / "groups.jsonl").exists():
            run.groups = group_frame(read_jsonl(run.replay_dir / "groups.jsonl", on_bad_line=on_bad_line,
                                                check=check_group_record, problems=run.problems, malformed=malformed))
    if malformed:  # not what a crash leaves (a truncated line): a foreign writer or an edit; never analysed around
        raise AnalysisInputError(f"{p}: {len(malformed)} malformed record(s) (fields of the wrong type; not written by "
                                 "hdreplay, or edited); fix or remove these lines:\n" + "\n".join(malformed))
    for msg in run.problems if warn else ():
        warnings.warn(msg, BadLineWarning, stacklevel=2)
    return run


def unique_labels(labels: list[str]) -> list[str]:
    """Make labels unique by suffixing repeats with #2, #3, ... (skipping suffixes already taken)."""
    taken: set[str] = set()
    out = []
    for lab in labels:
        new, k = lab, 1
        while new in taken:
            k += 1
            new = f"{lab}#{k}"
        taken.add(new)
        out.append(new)
    return out
