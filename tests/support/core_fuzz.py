"""A fuzz of hdreplay's public API: every public call, one argument at a time replaced by an invalid value.

For each case the engine copies a fixture (nothing, a driven controller, a controller with an open
step, or a buffer), hashes its state, makes the call and classifies the outcome:

    refused      a ReplayError (the project's error classes) and the state hash unchanged  (expected)
    changed      a ReplayError, but the state changed: a refusal that left a trace
    unexpected   any other exception (TypeError / KeyError / IndexError ... from deep inside)
    silent       the call returned: an invalid input was accepted

Every target's valid call runs too (``valid_failed`` counts valid calls that raised), so the cases
cannot pass by refusing everything.  :func:`random_programs` adds seeded random sequences of
protocol calls on one controller, each call valid or invalid by construction.

The cases themselves: tests/support/core_fuzz_cases.py.  Used by tests/core/test_fuzz_api.py (asserts every count is 0)
and benchmarks/fuzz_core.py (the longer run whose counts the report quotes).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import hdreplay as H
from core_fuzz_cases import group, pure_cases, state_cases
from hdreplay.errors import ReplayError
from protocol import buffer_hash, policy_at, run_steps, state_hash


@dataclass
class Counts:
    calls: int = 0
    refused: int = 0
    unexpected: int = 0
    silent: int = 0
    changed: int = 0
    valid_failed: int = 0
    examples: dict = field(default_factory=lambda: {"unexpected": [], "silent": [], "changed": [],
                                                    "valid_failed": []})
    types: Counter = field(default_factory=Counter)

    def note(self, kind: str, label: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.examples[kind]) < 20:
            self.examples[kind].append(label)

    def summary(self) -> dict:
        return {k: getattr(self, k) for k in ("calls", "refused", "unexpected", "silent", "changed",
                                               "valid_failed")}


class Fixtures:
    """The states calls run against; each case gets a deep copy."""

    def __init__(self) -> None:
        self.config = H.ReplayConfig(k_rep=3, tau=5e-3, capacity=12, group_size=4)
        self.ctrl = run_steps(H.ReplayController(self.config), range(4))
        self.open = copy.deepcopy(self.ctrl)
        self.open.select(step=4, scorer=policy_at(4).scorer)
        self.buf = copy.deepcopy(self.ctrl.buffer)
        self.state = self.ctrl.state_dict()

    def get(self, kind: str):
        return {"none": lambda: None, "ctrl": lambda: copy.deepcopy(self.ctrl),
                "open": lambda: copy.deepcopy(self.open), "buf": lambda: copy.deepcopy(self.buf)}[kind]()


def fingerprint(obj) -> Any:
    if obj is None:
        return None
    return buffer_hash(obj) if isinstance(obj, H.ReplayBuffer) else state_hash(obj)


def classify(counts: Counts, label: str, fixture, call: Callable, *, valid: bool) -> None:
    before = fingerprint(fixture)
    counts.calls += 1
    try:
        call(fixture)
    except ReplayError as e:
        counts.types[type(e).__name__] += 1
        if valid:
            counts.note("valid_failed", f"{label}: {e}")
        elif fingerprint(fixture) != before:
            counts.note("changed", label)
        else:
            counts.refused += 1
        return
    except Exception as e:  # noqa: BLE001 - counting these is the point
        counts.types[type(e).__name__] += 1
        counts.note("valid_failed" if valid else "unexpected", f"{label}: {type(e).__name__}: {e}")
        return
    if not valid:
        counts.note("silent", label)


def run_cases(tmp) -> Counts:
    """Every case of :func:`pure_cases` and :func:`state_cases` once."""
    counts = Counts()
    (tmp / "afile").write_text("not a directory")
    for label, call, valid in pure_cases():
        classify(counts, label, None, call, valid=valid)
    fx = Fixtures()
    for kind, label, call, valid in state_cases(fx, tmp):
        classify(counts, label, fx.get(kind), call, valid=valid)
    return counts


# ---------------------------------------------------------------------------------------------- random programs
def random_programs(programs: int, *, seed: int, length: int = 30, counts: Counts | None = None) -> Counts:
    """``programs`` random sequences of protocol calls; each call is valid or invalid by construction."""
    counts = counts or Counts()
    rng = random.Random(seed)
    for p in range(programs):
        cfg = H.ReplayConfig(selector=rng.choice(["headroom_drift", "recency", "drift_only", "headroom_only"]),
                             k_rep=rng.randint(0, 4), tau=rng.choice([0.0, 5e-3, 1.0]), capacity=rng.randint(1, 9),
                             group_size=4)
        ctrl, step, open_ = H.ReplayController(cfg), 0, False
        selected, staged = False, set()
        for _ in range(length):
            op = rng.choice(["select", "stage", "commit", "bad_select", "bad_stage", "bad_commit", "bad_step",
                             "late_step", "load_bad"])
            pol = policy_at(step % 7)
            if op == "select":
                classify(counts, f"p{p}.select({step})", ctrl, lambda c: c.select(step=step, scorer=pol.scorer),
                         valid=not selected)
                selected, open_ = True, True
            elif op == "stage":
                gs = [group(f"{p}-{step}-{len(staged)}-{i}", step) for i in range(rng.randint(0, 3))]
                classify(counts, f"p{p}.stage({step})", ctrl, lambda c: c.stage(gs, step=step), valid=True)
                staged.update(g.group_id for g in gs)
                open_ = True
            elif op == "commit":
                classify(counts, f"p{p}.commit", ctrl, lambda c: c.commit(), valid=open_)
                if open_:
                    step += rng.randint(1, 3)
                open_, selected = False, False
            elif op == "bad_select":
                bad = rng.choice([lambda gs: None, lambda gs: [g.logprobs.abs() + 0.5 for g in gs],
                                  lambda gs: [g.logprobs.numpy() for g in gs]])
                if len(ctrl.buffer) and cfg.k_rep and cfg.selector != "recency" and not selected:
                    classify(counts, f"p{p}.select(bad scorer)", ctrl, lambda c: c.select(step=step, scorer=bad),
                             valid=False)
            elif op == "bad_stage":
                bad = rng.choice([[group("dup", step)] * 2, [group(f"x{p}", step + 1)], [group(f"y{p}", step, n=3)],
                                  "groups", [None]])
                classify(counts, f"p{p}.stage(bad)", ctrl, lambda c: c.stage(bad, step=step), valid=False)
            elif op == "bad_commit":
                v = rng.choice([-1, 1.5, True, "2"])
                if open_:
                    classify(counts, f"p{p}.commit({v!r})", ctrl, lambda c: c.commit(num_fresh_groups=v), valid=False)
            elif op == "bad_step":
                v = rng.choice([2**53, 2**63, -1, 1.0, None])
                classify(counts, f"p{p}.select(step={v!r})", ctrl, lambda c: c.select(step=v, scorer=pol.scorer),
                         valid=False)
            elif op == "late_step" and ctrl.last_step is not None:
                classify(counts, f"p{p}.stage(step<=last)", ctrl, lambda c: c.stage([], step=ctrl.last_step),
                         valid=False)
            elif op == "load_bad":
                t, m = ctrl.state_dict(allow_open_step=True)
                m = replace_meta(m, rng)
                classify(counts, f"p{p}.load_state_dict(bad)", ctrl, lambda c: c.load_state_dict(t, m),
                         valid=False)
    return counts


def replace_meta(meta: dict, rng: random.Random) -> dict:
    choices = [("last_step", "x"), ("acceptance_rate", -1.0), ("config", {**meta["config"], "capacity": 0}),
               ("buffer", {**meta["buffer"], "size": meta["buffer"]["size"] + 1})]
    k, v = rng.choice(choices)
    return {**meta, k: v}
