"""Run directories -> DataFrames, refusing what is not a run.  A run directory holds any of::

    run.json                  {"method", "seed", "task", "replay": ReplayConfig dict | null, ...}
    train_log.jsonl           one trainer log entry per logging step ("step", "reward", "entropy", ...), as the
                              sandbox and hdreplay.integrations.trl.callback.HDRLogCallback write it; else, in a
                              plain TRL output directory, trainer_state.json's log_history (its own or the newest
                              checkpoint-*'s), else TensorBoard scalars ("train/reward" -> "reward")
    replay/steps.jsonl        per-step replay records (hdreplay.records.StepRecord); replay/groups.jsonl: per-group
                              lifetime records; a bare diagnostics directory (steps.jsonl inside) is a run too, and
                              hdreplay/ (HDRAsyncGRPOTrainer's default) is read like replay/
    metrics.json              final evaluation
    fresh_groups.jsonl        per step, the rewards of every fresh group (hdreplay_lab.sandbox.rewardlog)
    async.jsonl               the asynchronous pipeline's ledger (here, in the replay directory, or in hdreplay/)

A resume's rewind sets the records of the steps after its checkpoint aside beside each log
(``steps.rewound-from-step-<k>.<time>.jsonl``, :mod:`hdreplay.records`): they are not read, and a note lists them
(``RunData.rewound``).  What a crash leaves is read around: a JSONL line cut short (a record that opens with ``{`` and
does not parse) is skipped with a warning naming file:line (``on_bad_line="skip"``), and an empty groups.jsonl (a rewind
on resume) is no records.  Everything else that cannot be read is refused with :class:`AnalysisInputError`, one line per
problem naming the file (and line or field) and the fix: a file that is not a regular file (directory, FIFO, dangling
link), a JSON file that does not parse or is not an object, an empty JSONL file, a line that is not a JSON object, a
record of the wrong shape (:mod:`.records`; a NaN / Infinity literal in a file hdreplay writes as strict JSON),
TensorBoard files without a scalar, a directory with nothing to analyse.  What is readable but left out is said in a
note (``RunData.notes``): a run with neither replay diagnostics nor an async ledger (its report has the trainer log's
sections only), the values of a foreign metrics.json that are not numbers.  Nothing here computes statistics.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from hdreplay.errors import ReplayError
from hdreplay.records import EXTRA_STEP_TYPES, STEP_FIELDS, StepRecord, rewound_files

from .records import (
    STEP_LISTS,
    check_fresh_record,
    check_group_record,
    check_ledger_record,
    check_log_record,
    check_metrics,
    check_run_meta,
    check_step_record,
    parse_json,
)

__all__ = ["AnalysisInputError", "BadLineWarning", "RunData", "check_fresh_record", "check_group_record",
           "check_step_record", "group_frame", "load_run", "read_jsonl", "step_frame", "tensorboard_log",
           "unique_labels"]

ON_BAD_LINE = ("skip", "stop")
GROUP_FIELDS = ("group_id", "insertion_id", "birth_step", "evicted_step", "ref_headroom", "replay_count", "exposure")
STEPS_FILES = ("replay/steps.jsonl", "steps.jsonl", "hdreplay/steps.jsonl")
FILES = ("run.json", "train_log.jsonl", *STEPS_FILES, "trainer_state.json", "metrics.json", "fresh_groups.jsonl")
LEDGER_FILE = "async.jsonl"
#: what a file is for, in the fix of an error about it ("restore it, or remove it to report the run without ...")
ROLE = {"run.json": "its settings", "metrics.json": "its final evaluation", "train_log.jsonl": "its trainer log",
        "steps.jsonl": "replay diagnostics", "groups.jsonl": "group lifetimes", LEDGER_FILE: "the async ledger",
        "fresh_groups.jsonl": "the fresh-group reward log", "trainer_state.json": "this trainer log"}


class AnalysisInputError(ReplayError, ValueError):
    """A run directory or log file cannot be analysed (missing, empty, malformed); the message says what, one line
    per problem.  ``messages``: one message per run directory when several are refused at once."""

    def __init__(self, message: str = "", messages: Iterable[str] = ()) -> None:
        self.messages = list(messages) or [message]
        super().__init__(message or "\n".join(self.messages))


class BadLineWarning(UserWarning):
    """A JSONL line was skipped (``on_bad_line="skip"``); the message names file:line."""


def read_jsonl(path: str | Path, *, on_bad_line: str = "skip", check: Callable[[dict], str | None] | None = None,
               problems: list[str] | None = None, malformed: list[str] | None = None) -> pd.DataFrame:
    """A JSONL file as a DataFrame, one row per good line; blank lines are ignored.

    A line cut short -- it opens a JSON object (``{``) but does not parse: what a crash mid-write leaves, also when a
    resumed writer appended to it -- is dropped with ``"<file>:<line>: <reason> -- line skipped"`` appended to
    ``problems`` (``on_bad_line="skip"``).  Every other bad line (not JSON and not a record cut short, a JSON value
    that is not an object, one nested too deeply, an object ``check`` rejects) goes to ``malformed`` with the fix, for
    the caller to refuse the file; without ``malformed`` it is dropped like a line cut short.
    ``on_bad_line="stop"`` raises :class:`AnalysisInputError` at the first bad line of either kind."""
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    good = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            text = line.strip()
            if not text:
                continue
            torn = False
            try:
                obj = json.loads(text)
                reason = (f"expected a JSON object, got {type(obj).__name__}" if not isinstance(obj, dict)
                          else check(obj) if check else None)
            except json.JSONDecodeError as e:
                torn = text.startswith("{")
                reason = (f"not valid JSON ({e.msg}; a record cut short, as a crash mid-write leaves it)" if torn
                          else f"not a JSON object ({e.msg})")
            except RecursionError:
                reason = "nested too deeply to be a record"
            if reason is None:
                good.append(text)
            elif on_bad_line == "stop":
                raise AnalysisInputError(f"{path}:{n}: {reason}" + (" (use --on-bad-line skip to skip lines cut short)"
                                                                     if torn else "; fix or remove this line"))
            elif not torn and malformed is not None:
                malformed.append(f"{path}:{n}: {reason}; fix or remove this line")
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
    ``problems`` (skipped lines, each naming file:line), ``fresh`` (fresh_groups.jsonl rows), ``ledger`` /
    ``ledger_source`` (async.jsonl's records and path), ``notes`` (what the run lacks or what was left out of it:
    the report still runs, the command says them on stderr), ``rewound`` (the side files a resume's rewind set beside
    the logs read: records of steps the resumed run wrote again, not read)."""

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
    ledger: pd.DataFrame = field(default_factory=pd.DataFrame)
    ledger_source: str | None = None
    notes: list[str] = field(default_factory=list)
    rewound: list[str] = field(default_factory=list)

    @property
    def has_replay(self) -> bool:
        return len(self.steps) > 0

    @property
    def replay_config(self) -> dict:
        return self.meta["replay"] if isinstance(self.meta.get("replay"), dict) else {}


def _not_a_file(q: Path) -> str | None:
    """Why ``q`` (a name that exists) is not a regular file to read, with the fix; None if it is one (also through
    a symbolic link).  Checked before opening: a FIFO would block the open."""
    try:
        mode = q.stat().st_mode
    except FileNotFoundError:
        return f"{q}: a dangling symbolic link (to {os.readlink(q)}); restore its target or remove the link"
    except OSError as e:
        return f"{q}: cannot be read ({e.strerror}); fix its permissions or restore it"
    if stat.S_ISREG(mode):
        return None
    kind = ("directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode)
            else "device")
    return f"{q}: expected a file, found a {kind}; the run directory is damaged (move {q} away or restore the file)"


def _fix(q: Path) -> str:
    return f"restore it, or remove it to report the run without {ROLE.get(q.name, 'it')}"


def _read_object(q: Path, errors: list[str], fix: str) -> dict | None:
    """A JSON file's object, or None with the reason (and ``fix``) appended to ``errors``."""
    obj, why = parse_json(q.read_text(encoding="utf-8", errors="replace"))
    if why is None and not isinstance(obj, dict):
        why = f"expected a JSON object, got {type(obj).__name__}"
    if why:
        errors.append(f"{q}: {why}; {fix}")
    return None if why else obj


def _trainer_state_log(q: Path, errors: list[str], malformed: list[str], ckpt: bool) -> pd.DataFrame:
    """trainer_state.json's log_history as a frame (entries checked like train_log.jsonl lines)."""
    fix = f"restore it, or remove {q.parent} to read the previous checkpoint" if ckpt else _fix(q)
    state = _read_object(q, errors, fix)
    history = None if state is None else state.get("log_history")
    if state is not None and not isinstance(history, list):
        errors.append(f"{q}: 'log_history' must be a list of log entries, got {history!r:.40}; not a TRL / "
                      f"transformers trainer state: {fix}")
    if not isinstance(history, list):
        return pd.DataFrame()
    for i, e in enumerate(history):
        why = check_log_record(e) if isinstance(e, dict) else f"expected a JSON object, got {type(e).__name__}"
        if why:
            malformed.append(f"{q}: log_history[{i}]: {why}; fix or remove this entry")
    return pd.DataFrame(history)


def tensorboard_log(p: Path) -> pd.DataFrame:
    """The scalars of every TensorBoard event file under ``p``, one row per step ("train/x" -> column "x")."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = []
    for f in sorted(p.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        rows += [(e.step, tag.removeprefix("train/"), e.value)
                 for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    df = pd.DataFrame(rows, columns=["step", "key", "value"])
    return df.pivot_table(index="step", columns="key", values="value", aggfunc="last").reset_index()


def load_run(path: str | Path, *, label: str | None = None, on_bad_line: str = "skip", warn: bool = True) -> RunData:
    """Load one run directory (module docstring).  Raises AnalysisInputError, naming every problem on its own line,
    for anything the module docstring says is refused, whatever ``on_bad_line``; with ``on_bad_line="stop"`` also
    on the first line cut short.  With ``warn=True`` every skipped line is also a :class:`BadLineWarning`."""
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"--on-bad-line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    p = Path(path)
    if not p.is_dir():
        raise AnalysisInputError(f"{p}: not a directory; pass the run directory, not a file inside it" if p.exists()
                                 else f"{p}: no such directory; pass a run directory (one holding run.json, "
                                      "train_log.jsonl, trainer_state.json or replay/steps.jsonl)")
    if not any(p.iterdir()):
        raise AnalysisInputError(f"{p}: the directory is empty; did the run write its logs somewhere else?")
    found = {m: p / m for m in FILES if os.path.lexists(p / m)}
    ckpts = {int(c.parent.name[11:]): c for c in p.glob("checkpoint-*/trainer_state.json")
             if c.parent.name[11:].isdigit()}
    state = found.get("trainer_state.json") or (ckpts[max(ckpts)] if ckpts else None)
    events = sorted(p.rglob("events.out.tfevents.*")) if "train_log.jsonl" not in found and not state else []
    if not ({"run.json", "train_log.jsonl", *STEPS_FILES} & set(found) or state or events):
        raise AnalysisInputError(f"{p}: not a run directory (no run.json, train_log.jsonl, trainer_state.json, "
                                 "TensorBoard events or replay/steps.jsonl in it)")
    run = RunData(path=p, label=label or p.resolve().name or str(p))
    errors: list[str] = []  # one line per problem, with its fix
    malformed: list[str] = []  # records that are not JSON objects or have fields of the wrong type

    def readable(q: Path | None) -> bool:
        why = None if q is None else _not_a_file(q)
        errors.extend([why] if why else [])
        return q is not None and why is None

    def jsonl(q: Path, check: Callable[[dict], str | None], *, empty_ok: bool = False) -> pd.DataFrame:
        skipped = len(run.problems)
        df = read_jsonl(q, on_bad_line=on_bad_line, check=check, problems=run.problems, malformed=malformed)
        cut = len(run.problems) - skipped
        if not len(df) and not empty_ok and not any(m.startswith(f"{q}:") for m in malformed):
            errors.append(f"{q}: holds no record" + (f" ({cut} line(s) cut short)" if cut else "") + "; the run "
                          "stopped before writing one, or the file was emptied: " + _fix(q))
        return df

    for name in ("run.json", "metrics.json"):
        obj = _read_object(found[name], errors, _fix(found[name])) if readable(found.get(name)) else None
        bad, left = ([], []) if obj is None else (check_run_meta(obj), []) if name == "run.json" else check_metrics(obj)
        errors += [f"{found[name]}: {why}; fix the field or restore the file" for why in bad]
        if left:
            run.notes.append(f"{found[name]}: left out of the final-metrics table (not finite numbers): "
                             f"{', '.join(left)}")
        if name == "run.json":
            run.meta = obj or {}
        else:
            run.metrics = obj
    if "train_log.jsonl" in found:
        run.log_source = str(found["train_log.jsonl"])
        run.log = jsonl(found["train_log.jsonl"], check_log_record) if readable(found["train_log.jsonl"]) else run.log
    elif state:
        run.log_source = str(state)
        if readable(state):
            run.log = _trainer_state_log(state, errors, malformed, ckpt=state.parent != p)
    elif events and all(readable(f) for f in events):
        run.log, run.log_source = tensorboard_log(p), f"{p} (TensorBoard events)"
        if not len(run.log):
            errors.append(f"{p}: its TensorBoard event files ({', '.join(str(f.relative_to(p)) for f in events[:3])}"
                          f"{', ...' if len(events) > 3 else ''}) hold no TensorBoard scalar (empty, cut short or not "
                          "event files); restore them, or remove them to report the run from its other files")
    if "fresh_groups.jsonl" in found and readable(found["fresh_groups.jsonl"]):
        run.fresh = jsonl(found["fresh_groups.jsonl"], check_fresh_record)
    steps = next((found[m] for m in STEPS_FILES if m in found), None)
    if steps:
        run.replay_dir = steps.parent
        if readable(steps):
            raw = jsonl(steps, check_step_record)
            run.steps = step_frame(raw)
            if len(raw) > len(run.steps):
                run.problems.append(f"{steps}: {len(raw) - len(run.steps)} repeated step record(s) (a resumed run?); "
                                    "the last record of each step is used")
        if os.path.lexists(run.replay_dir / "groups.jsonl") and readable(run.replay_dir / "groups.jsonl"):
            run.groups = group_frame(jsonl(run.replay_dir / "groups.jsonl", check_group_record, empty_ok=True))
    ledger = next((d / LEDGER_FILE for d in (p, run.replay_dir, p / "hdreplay", p / "replay")
                   if d is not None and os.path.lexists(d / LEDGER_FILE)), None)
    if ledger is not None and readable(ledger):
        run.ledger, run.ledger_source = jsonl(ledger, check_ledger_record), str(ledger)
    if not (errors or malformed or len(run.log) or run.has_replay or len(run.ledger)):
        errors.append(f"{p}: nothing to analyse: no trainer log entry" + (f" in {run.log_source}" if run.log_source
                      else "") + ", replay step record or async ledger record; rerun, or pass the directory the run "
                      "wrote its logs to")
    if malformed or len(errors) > 1:  # not what a crash leaves (a line cut short): a foreign writer or an edit
        what = [f"{len(malformed)} malformed record(s) (not JSON objects, or fields of the wrong type: not written by "
                "hdreplay or TRL, or edited)"] * bool(malformed) + [f"{len(errors)} other problem(s)"] * bool(errors)
        raise AnalysisInputError(f"{p}: cannot be read as a run: {' and '.join(what)}; fix what each line below "
                                 "names:\n" + "\n".join(errors + malformed))
    if errors:
        raise AnalysisInputError(errors[0])
    logs = [steps, run.replay_dir / "groups.jsonl" if run.replay_dir else None, ledger]
    run.rewound = [str(f) for q in logs if q is not None for f in rewound_files(q)]
    if run.rewound:
        run.notes.append(f"{p}: a resume set {len(run.rewound)} file(s) of records aside beside the logs (the steps "
                         "after the checkpoint it resumed from, which the resumed run wrote again): "
                         f"{', '.join(run.rewound)}; the report reads the logs themselves, the run as resumed")
    if not (run.has_replay or len(run.ledger)) and run.meta.get("replay", "unset") is not None:  # not on-policy
        run.notes.append(f"{p}: no replay diagnostics (no {', '.join(STEPS_FILES)}) and no async ledger: the report "
                         f"covers its trainer log ({run.log_source}) only, every replay section is n/a; if the run "
                         "replayed, pass the directory its diagnostics were written to")
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
