"""Loading run directories: JSONL with a bad-line policy, run metadata, replay diagnostics.

Run directory contract (what the sandbox and the TRL trainer write)::

    RUN_DIR/run.json               {"method", "seed", "task", "replay": ReplayConfig dict | null, ...}  optional
    RUN_DIR/train_log.jsonl        one trainer log entry per logging step ("step", "reward", "entropy", ...)
    RUN_DIR/replay/steps.jsonl     per-step replay records (hdreplay.diagnostics), replay methods only
    RUN_DIR/replay/groups.jsonl    per-group lifetime records, replay methods only
    RUN_DIR/metrics.json           final evaluation, optional

A bare diagnostics directory (``steps.jsonl`` directly inside, as ``ReplayController(diagnostics_dir=...)``
writes it) is accepted too.  Nothing here computes statistics; see the section modules.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hdreplay.errors import ReplayError

ON_BAD_LINE = ("skip", "stop")
RUN_MARKERS = ("run.json", "train_log.jsonl", "replay/steps.jsonl", "steps.jsonl")
_STEP_LISTS = ("scan_age", "scan_drift", "scan_pass", "scan_cached_headroom", "scan_headroom")


class AnalysisInputError(ReplayError, ValueError):
    """A run directory or log file cannot be analysed (missing, empty, malformed); the message says what."""


class BadLineWarning(UserWarning):
    """A JSONL line was skipped (``on_bad_line="skip"``); the message names file:line."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_step_record(rec: dict) -> str | None:
    """Why a parsed steps.jsonl object is unusable, or None if it is fine."""
    if not _is_int(rec.get("step")) or rec["step"] < 0:
        return f"'step' must be an int >= 0, got {rec.get('step')!r}"
    for key in ("accepted_ages", *_STEP_LISTS):
        if key in rec and not isinstance(rec[key], list):
            return f"{key!r} must be a list, got {type(rec[key]).__name__}"
    lens = {k: len(rec[k]) for k in _STEP_LISTS if k in rec}
    if len(set(lens.values())) > 1:
        return f"scan lists have different lengths {lens}"
    return None


def check_group_record(rec: dict) -> str | None:
    """Why a parsed groups.jsonl object is unusable, or None if it is fine."""
    for key in ("birth_step", "replay_count"):
        if not _is_int(rec.get(key)):
            return f"{key!r} must be an int, got {rec.get(key)!r}"
    if not isinstance(rec.get("ref_headroom"), (int, float)) or isinstance(rec.get("ref_headroom"), bool):
        return f"'ref_headroom' must be a number, got {rec.get('ref_headroom')!r}"
    ev = rec.get("evicted_step")
    if ev is not None and not _is_int(ev):
        return f"'evicted_step' must be an int or null, got {ev!r}"
    return None


def read_jsonl(
    path: str | Path,
    *,
    on_bad_line: str = "skip",
    check: Callable[[dict], str | None] | None = None,
    problems: list[str] | None = None,
) -> list[dict]:
    """Parse a JSONL file into a list of objects.

    Blank lines are ignored.  A line that is not JSON, not a JSON object, or that ``check`` rejects
    is a *bad line*: with ``on_bad_line="skip"`` it is dropped and ``"<file>:<line>: <reason>"`` is
    appended to ``problems``; with ``"stop"`` an :class:`AnalysisInputError` with that text is raised.
    """
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    path = Path(path)
    out: list[dict] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            reason = None
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                reason = f"not valid JSON ({e.msg}; truncated line?)"
            else:
                if not isinstance(obj, dict):
                    reason = f"expected a JSON object, got {type(obj).__name__}"
                elif check is not None:
                    reason = check(obj)
            if reason is None:
                out.append(obj)
                continue
            msg = f"{path}:{n}: {reason}"
            if on_bad_line == "stop":
                raise AnalysisInputError(msg + " (use --on-bad-line skip to skip bad lines)")
            if problems is not None:
                problems.append(msg + " -- line skipped")
    return out


def _read_json(path: Path, on_bad_line: str, problems: list[str]) -> dict | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        reason = f"{path}: not valid JSON ({e.msg})"
    else:
        if isinstance(obj, dict):
            return obj
        reason = f"{path}: expected a JSON object, got {type(obj).__name__}"
    if on_bad_line == "stop":
        raise AnalysisInputError(reason + " (use --on-bad-line skip to ignore it)")
    problems.append(reason + " -- file ignored")
    return None


@dataclass
class RunData:
    """Everything loaded from one run directory (raw records, no statistics).

    steps:     steps.jsonl records sorted by step, one per step (the last one kept if repeated)
    groups:    groups.jsonl lifetime records
    train_log: train_log.jsonl entries, file order
    meta:      run.json ({} if absent or unreadable)
    metrics:   metrics.json or None
    replay_dir: where steps.jsonl was found, or None (a run without replay)
    problems:  human-readable notes on skipped lines / ignored files, each naming file:line
    """

    path: Path
    label: str
    meta: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    train_log: list[dict] = field(default_factory=list)
    metrics: dict | None = None
    replay_dir: Path | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def has_replay(self) -> bool:
        return bool(self.steps)

    @property
    def replay_config(self) -> dict:
        rc = self.meta.get("replay")
        return rc if isinstance(rc, dict) else {}


def _replay_dir(path: Path) -> Path | None:
    if (path / "replay" / "steps.jsonl").is_file():
        return path / "replay"
    if (path / "steps.jsonl").is_file():
        return path
    return None


def load_run(path: str | Path, *, label: str | None = None, on_bad_line: str = "skip",
             warn: bool = True) -> RunData:
    """Load one run directory (see module docstring).

    Raises AnalysisInputError if ``path`` is missing, not a directory, empty or holds none of
    run.json / train_log.jsonl / replay/steps.jsonl, or (``on_bad_line="stop"``) on the first bad line.
    With ``warn=True`` every skipped line is also reported as a :class:`BadLineWarning`.
    """
    if on_bad_line not in ON_BAD_LINE:
        raise AnalysisInputError(f"--on-bad-line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    p = Path(path)
    if not p.exists():
        raise AnalysisInputError(f"{p}: no such directory; pass a run directory (one holding run.json, "
                                 "train_log.jsonl or replay/steps.jsonl)")
    if not p.is_dir():
        raise AnalysisInputError(f"{p}: not a directory; pass the run directory, not a file inside it")
    if not any(p.iterdir()):
        raise AnalysisInputError(f"{p}: the directory is empty; did the run write its logs somewhere else?")
    if not any((p / m).is_file() for m in RUN_MARKERS):
        raise AnalysisInputError(f"{p}: not a run directory (none of {', '.join(RUN_MARKERS)} found in it)")
    run = RunData(path=p, label=label or p.resolve().name or str(p))
    if (p / "run.json").is_file():
        run.meta = _read_json(p / "run.json", on_bad_line, run.problems) or {}
    if (p / "metrics.json").is_file():
        run.metrics = _read_json(p / "metrics.json", on_bad_line, run.problems)
    if (p / "train_log.jsonl").is_file():
        run.train_log = read_jsonl(p / "train_log.jsonl", on_bad_line=on_bad_line, problems=run.problems)
    rdir = _replay_dir(p)
    if rdir is not None:
        run.replay_dir = rdir
        steps = read_jsonl(rdir / "steps.jsonl", on_bad_line=on_bad_line, check=check_step_record,
                           problems=run.problems)
        run.steps = _dedupe_steps(steps, rdir / "steps.jsonl", run.problems)
        if (rdir / "groups.jsonl").is_file():
            run.groups = read_jsonl(rdir / "groups.jsonl", on_bad_line=on_bad_line, check=check_group_record,
                                    problems=run.problems)
    if warn:
        for msg in run.problems:
            warnings.warn(msg, BadLineWarning, stacklevel=2)
    return run


def _dedupe_steps(steps: list[dict], path: Path, problems: list[str]) -> list[dict]:
    by_step: dict[int, dict] = {}
    for rec in steps:
        by_step[rec["step"]] = rec
    if len(by_step) < len(steps):
        problems.append(f"{path}: {len(steps) - len(by_step)} repeated step record(s) (a resumed run?); "
                        "the last record of each step is used")
    return [by_step[s] for s in sorted(by_step)]


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
