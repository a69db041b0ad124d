"""The staleness rule's state inside the controller's checkpoint (crash-safe, all-or-nothing, like the buffer).

:class:`~.rule.AsyncReplay` registers a :class:`StalenessState` as an observer of its controller, so
``ReplayController.save`` writes the rule's state into the same checkpoint directory, under the same single commit
point, as the buffer, and ``ReplayController.load`` validates both before changing either.  What is saved is the
state *as of the last commit* (the floor estimate, the ledger's cumulative totals, the diverted groups still tracked,
which groups are sampler-referenced, whether the floor warning was given), the counterpart of the controller's
committed buffer; plus ``AsyncReplay.routing``, the integration's own JSON state of its routing (what it had queued
when it saved), which the rule never reads and the integration parses (``AsyncReplay.routing_parser``).

A checkpoint without this state (written without the staleness rule, or by hdreplay before it was saved) is
refused with an error naming the front end's option that accepts an empty start (``resume_option``); with that
option set, the rule starts empty (a :class:`~hdreplay.ReplayResumeWarning` says so).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError, ReplayProtocolError, ReplayResumeWarning
from ..records import rewind_jsonl
from ..validate import is_int, is_real
from .ledger import StalenessLedger

#: ``ar`` below is a :class:`~.rule.AsyncReplay`; typed ``Any`` so that this module, which rule.py imports, imports
#: nothing of rule.py (no import circle)
_AsyncReplay = Any

#: the observer name (the key of this state in the controller checkpoint's ``observers``)
STATE_NAME = "staleness"
_INFO = {"birth": "int", "tokens": "int", "length": "number", "admitted": "bool", "first_drift": "number or null"}


def snapshot(ar: _AsyncReplay) -> dict[str, Any]:
    """The rule's JSON state now (call it with no update open: it is what the next update starts from)."""
    f = ar.floor
    return {"step": ar.controller.last_step,
            "floor": {"estimate": f.estimate, "groups": f.groups, "last_step_mean": f.last_step_mean},
            "totals": dict(ar.ledger.totals),
            "tracked": [[gid, dict(info)] for gid, info in ar.tracked.items()],
            "sampler_ref": sorted(ar.sampler_ref, key=lambda g: (isinstance(g, str), g)),
            "warned_floor": bool(ar._warned_floor)}


def _gid(x: Any) -> bool:
    return isinstance(x, str) or is_int(x)


def _number(x: Any, *, null: bool = False) -> bool:
    return (null and x is None) or (is_real(x) and math.isfinite(x) and x >= 0)


def parse(d: Any) -> dict[str, Any]:
    """A validated copy of a :func:`snapshot` (CheckpointError naming the first bad field; nothing is changed)."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"staleness state: {msg}")

    keys = {"step", "floor", "totals", "tracked", "sampler_ref", "warned_floor"}
    if not isinstance(d, Mapping) or not keys <= set(d):
        raise bad(f"expected a mapping with {sorted(keys)}, got {sorted(d) if isinstance(d, Mapping) else d!r:.80}")
    if d["step"] is not None and not (is_int(d["step"]) and d["step"] >= 0):
        raise bad(f"step must be a step (int >= 0) or null, got {d['step']!r:.40}")
    fl = d["floor"]
    if not (isinstance(fl, Mapping) and set(fl) == {"estimate", "groups", "last_step_mean"}
            and _number(fl["estimate"], null=True) and is_int(fl["groups"]) and fl["groups"] >= 0
            and _number(fl["last_step_mean"], null=True)):
        raise bad(f"floor must hold estimate (number >= 0 or null), groups (int >= 0) and last_step_mean "
                  f"(number >= 0 or null), and nothing else, got {fl!r:.120}")
    want = set(StalenessLedger().totals)
    tot = d["totals"]
    if not isinstance(tot, Mapping) or set(tot) != want or not all(is_int(v) and 0 <= v < 2**62 for v in tot.values()):
        raise bad(f"totals must map exactly {sorted(want)} to ints >= 0, got {tot!r:.120}")
    tracked = d["tracked"]
    if not isinstance(tracked, list):
        raise bad(f"tracked must be a list of [group_id, info] pairs, got {type(tracked).__name__}")
    out_tracked = {}
    for t in tracked:
        if not (isinstance(t, list) and len(t) == 2 and _gid(t[0]) and isinstance(t[1], Mapping)):
            raise bad(f"tracked must hold [group_id, info] pairs, got {t!r:.80}")
        info = t[1]
        ok = (set(info) == set(_INFO) and is_int(info["birth"]) and info["birth"] >= 0 and is_int(info["tokens"])
              and info["tokens"] >= 0 and _number(info["length"]) and isinstance(info["admitted"], bool)
              and (info["first_drift"] is None
                   or (is_real(info["first_drift"]) and math.isfinite(info["first_drift"]))))
        if not ok or t[0] in out_tracked:
            raise bad(f"tracked group {t[0]!r}: info must be {_INFO} (each group once), got {dict(info)!r:.120}")
        out_tracked[t[0]] = dict(info)
    refs = d["sampler_ref"]
    if not isinstance(refs, list) or not all(_gid(g) for g in refs):
        raise bad(f"sampler_ref must be a list of group ids, got {refs!r:.80}")
    if not isinstance(d["warned_floor"], bool):
        raise bad(f"warned_floor must be a bool, got {d['warned_floor']!r:.20}")
    return {"step": d["step"], "floor": dict(fl), "totals": {k: int(v) for k, v in tot.items()},
            "tracked": out_tracked, "sampler_ref": set(refs), "warned_floor": d["warned_floor"]}


def cross_check(parsed: dict[str, Any], *, last_step: int | None, buffered: Mapping[Any, tuple[int, int]]) -> None:
    """A :func:`parse`d state against the controller state it is loaded with (``buffered``: group id -> (birth step,
    completion tokens) of every buffered group): the same step (the state is taken at the controller's commit),
    diverted / sampler-referenced groups that the buffer holds, with the buffer's birth step and token count, a floor
    estimate over at least one group (and over none without one), ledger totals that add up.  CheckpointError naming
    the first mismatch."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"staleness state: {msg}; it does not belong to the controller state it was saved "
                               "with (edited, or copied from another checkpoint): resume from an intact checkpoint")

    if parsed["step"] != last_step:
        raise bad(f"step {parsed['step']!r} differs from the controller's last committed step {last_step!r}")
    for what, ids in (("tracked (diverted) group", parsed["tracked"]), ("sampler-referenced group",
                                                                        parsed["sampler_ref"])):
        missing = sorted((g for g in ids if g not in buffered), key=repr)
        if missing:
            raise bad(f"{what} id(s) {missing[:5]!r:.120} are not in the buffer")
    late = [g for g, info in parsed["tracked"].items() if last_step is None or info["birth"] > last_step]
    if late:
        raise bad(f"tracked group(s) {late[:5]!r:.120} were born after the last committed step {last_step!r}")
    for g, info in parsed["tracked"].items():
        if (info["birth"], info["tokens"]) != buffered[g]:
            raise bad(f"tracked group {g!r}: birth {info['birth']} / {info['tokens']} tokens, the buffer holds it with "
                      f"birth {buffered[g][0]} / {buffered[g][1]} tokens")
    fl = parsed["floor"]
    if (fl["estimate"] is None) != (fl["groups"] == 0) or (fl["last_step_mean"] is not None and fl["estimate"] is None):
        raise bad(f"floor estimate {fl['estimate']!r} over {fl['groups']} group(s) (last step mean "
                  f"{fl['last_step_mean']!r}): an estimate needs at least one group, and a group gives one")
    t = parsed["totals"]
    for u in ("groups", "tokens"):
        parts = t[f"fresh_{u}"] + t[f"diverted_{u}"] + t[f"dropped_{u}"]
        if t[f"generated_{u}"] != parts:
            raise bad(f"totals: generated_{u} {t[f'generated_{u}']} != fresh + diverted + dropped ({parts})")
        for part, whole in (("admitted", "diverted"), ("evicted_unused", "diverted"), ("fresh_mixed", "fresh")):
            if t[f"{part}_{u}"] > t[f"{whole}_{u}"]:
                raise bad(f"totals: {part}_{u} {t[f'{part}_{u}']} exceeds {whole}_{u} {t[f'{whole}_{u}']}")
    if len(parsed["tracked"]) > t["diverted_groups"] - t["evicted_unused_groups"]:
        raise bad(f"{len(parsed['tracked'])} tracked diverted groups, but the totals leave "
                  f"{t['diverted_groups'] - t['evicted_unused_groups']} diverted and not evicted")
    if last_step is None and (any(t.values()) or parsed["warned_floor"]):
        raise bad("totals or warnings recorded before the first committed step")


def install(ar: _AsyncReplay, parsed: dict[str, Any] | None) -> None:
    """Put a :func:`parse`d state (None: the empty state) into ``ar`` (nothing here can fail)."""
    ar.floor = type(ar.floor)(initial=ar.floor.initial, ema=ar.floor.ema, min_groups=ar.floor.min_groups)
    ar.ledger = StalenessLedger()
    ar.tracked, ar.sampler_ref, ar._warned_floor = {}, set(), False
    if parsed is not None:
        fl = parsed["floor"]
        ar.floor.estimate = None if fl["estimate"] is None else float(fl["estimate"])
        ar.floor.groups = int(fl["groups"])
        ar.floor.last_step_mean = None if fl["last_step_mean"] is None else float(fl["last_step_mean"])
        ar.ledger.totals.update(parsed["totals"])
        ar.tracked = {gid: dict(info) for gid, info in parsed["tracked"].items()}
        ar.sampler_ref, ar._warned_floor = set(parsed["sampler_ref"]), parsed["warned_floor"]
    ar._pending, ar._step = [], None
    ar._committed = snapshot(ar)


def rewind_ledger(ar: _AsyncReplay, step: int | None, stamp: str | None = None) -> Path | None:
    """Set aside the ledger file's records written after ``step`` (a resumed run writes them again) in a side file
    (:func:`hdreplay.records.rewind_jsonl`; None: nothing was committed, every record is set aside); returns the side
    file, or None when nothing moved."""
    if ar.path is None:
        return None
    return rewind_jsonl(ar.path, lambda rec: step is not None and is_int(rec.get("step")) and rec["step"] <= step,
                        0 if step is None else step + 1, stamp)


class StalenessState:
    """The controller observer that saves and restores an :class:`~.rule.AsyncReplay` (see the module doc)."""

    name = STATE_NAME

    def __init__(self, ar: _AsyncReplay) -> None:
        self.ar = ar

    def state_dict(self) -> dict[str, Any]:
        return {**self.ar._committed, "routing": self.ar.routing}

    def check_state(self, d: Any, loading: Any = None) -> tuple[dict | None, Any]:
        """Validate a saved state alone (:func:`parse`) and against ``loading``, the controller state it is loaded with
        (:func:`cross_check`); CheckpointError naming the first mismatch, nothing changed."""
        ar = self.ar
        if ar._step is not None:
            raise ReplayProtocolError(f"load() while the staleness rule's step {ar._step} is open; commit() first")
        if d is None:
            if not ar.resume_without_state:
                raise CheckpointError(
                    "it holds no staleness state (the floor estimate, the ledger, which buffered groups were diverted "
                    "and are sampler-referenced, the routing): it was written without the asynchronous staleness "
                    f"rule, or by an hdreplay that did not save it. Resume from a checkpoint written by this "
                    f"trainer, or set {ar.resume_option}=True to start the staleness rule empty (its history is "
                    "lost and buffered diverted groups are gated without the floor)")
            warnings.warn(f"hdreplay: the checkpoint holds no staleness state; the floor, the ledger and the routing "
                          f"start empty ({ar.resume_option}=True)", ReplayResumeWarning, stacklevel=4)
            return None, None
        parsed = parse(d)
        if loading is not None:
            cross_check(parsed, last_step=loading.last_step,
                        buffered={gid: (int(blk.birth_steps[j]), int(blk.tok_off[j + 1] - blk.tok_off[j]))
                                  for blk in loading.buffer.blocks for j, gid in enumerate(blk.group_ids)})
        routing = d.get("routing") if isinstance(d, Mapping) else None
        if routing is not None and ar.routing_parser is not None:
            try:
                routing = ar.routing_parser(routing)
            except CheckpointError as e:
                raise CheckpointError(f"staleness state: routing: {e}") from None
        return parsed, routing

    def rewind_files(self, step: int | None, stamp: str | None = None) -> list[Path]:
        """After every check of the load passed, or on a resume without a state (the controller calls it): the ledger
        file back to the checkpoint's last committed ``step``; returns the side file written, if any."""
        side = rewind_ledger(self.ar, step, stamp)
        return [] if side is None else [side]

    def restore(self, controller, parsed: tuple[dict | None, Any]) -> None:
        state, routing = parsed
        install(self.ar, state)
        self.ar.routing = routing
